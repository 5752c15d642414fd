"""The router in front of two real workers (tiny model), all real processes on loopback:
routing decisions, proxying of every route (streams, batches, fan-out), the openai SDK and
the frontend DSL through the router, adding and removing workers, and failover (slow:
a second router, a hung worker, a worker killed under load)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from conftest import API_KEY, ServerHandle, free_port, launch_server, poll_until, wait_healthy

WORKER = "x-radixserve-worker"
SYSTEM_A = "You are a pirate. Answer every question in pirate speech, with nautical words. " * 3
SYSTEM_B = "You are a lawyer. Answer every question with a careful legal disclaimer first. " * 3


def launch_router(log_dir: Path, *urls: str, args: tuple[str, ...] = ()) -> ServerHandle:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve", "router", "--port", str(port), "--api-key",
           API_KEY, "--admin-api-key", API_KEY, "--health-interval-s", "0.5",
           "--health-timeout-s", "2", *args, "--worker-urls", *urls]  # fmt: skip
    log = log_dir / f"router-{port}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, log, API_KEY)
    wait_healthy(handle, timeout=60)
    return handle


def wait_all_healthy(router: ServerHandle, count: int, deadline_s: float = 30) -> None:
    with router.client() as c:

        def workers() -> list[dict]:
            return c.get("/workers").json()["workers"]

        poll_until(
            lambda: sum(w["healthy"] for w in workers()) == count,
            deadline_s,
            lambda: f"{count} healthy workers: {workers()}",
        )


@pytest.fixture(scope="module")
def workers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[ServerHandle]]:
    logs = tmp_path_factory.mktemp("router-workers")
    args = ("--max-total-tokens", "4096")
    hs = [launch_server(tiny_model_dir, logs, *args, api_key=API_KEY) for _ in "ab"]
    yield hs
    for h in hs:
        h.stop()


@pytest.fixture(scope="module")
def router(workers: list[ServerHandle], tmp_path_factory: pytest.TempPathFactory):
    h = launch_router(tmp_path_factory.mktemp("router"), *(w.url for w in workers))
    wait_all_healthy(h, 2)
    yield h
    assert h.stop() == 0, h.log_text()[-3000:]


def gen(c: httpx.Client, text: str, **sampling: object) -> httpx.Response:
    params = {"max_new_tokens": 4, "temperature": 0, **sampling}
    return c.post("/generate", json={"text": text, "sampling_params": params})


@pytest.mark.slow  # the two workers and the router start once: ~15 s
def test_cache_aware_routes_groups_to_their_worker(router: ServerHandle) -> None:
    with router.client() as c:
        flushed = c.post("/flush_cache")
        assert flushed.status_code == 200, flushed.text
        assert len(flushed.json()["workers"]) == 2
        a1 = gen(c, SYSTEM_A + "Where is the gold?")
        b1 = gen(c, SYSTEM_B + "May I park here?")
        assert a1.status_code == b1.status_code == 200
        assert a1.headers[WORKER] != b1.headers[WORKER]  # a new prefix: the emptier worker
        for i in range(3):
            a = gen(c, SYSTEM_A + f"What is your ship's name, number {i}?")
            b = gen(c, SYSTEM_B + f"Can I sue my neighbour, case {i}?")
            assert a.headers[WORKER] == a1.headers[WORKER]
            assert b.headers[WORKER] == b1.headers[WORKER]
            assert a.json()["meta_info"]["cached_tokens"] >= 40  # the system prompt is cached
            assert b.json()["meta_info"]["cached_tokens"] >= 40
        info = c.get("/get_server_info").json()
    assert info["router"]["policy"] == "cache_aware"
    assert info["decisions"]["cache"] >= 6
    assert all(w["tree_chars"] > len(SYSTEM_A) for w in info["workers"])


@pytest.mark.slow  # the two workers and the router start once: ~15 s
def test_session_id_sticks_to_one_worker(router: ServerHandle) -> None:
    """Unrelated prompts with one session id all go where the session's first one went
    (without it, a prompt with no cached prefix goes to the emptier worker)."""
    with router.client() as c:
        c.headers["X-Session-ID"] = "s-42"
        seen = {gen(c, f"{i} unrelated prompt {'x' * i}").headers[WORKER] for i in range(6)}
    assert len(seen) == 1


@pytest.mark.slow  # starts and stops processes, waits on health checks
def test_round_robin_alternates(workers: list[ServerHandle], tmp_path: Path) -> None:
    rr = launch_router(tmp_path, *(w.url for w in workers), args=("--policy", "round_robin"))
    try:
        wait_all_healthy(rr, 2)
        with rr.client() as c:
            seen = [gen(c, SYSTEM_A + "same prompt").headers[WORKER] for _ in range(4)]
    finally:
        rr.stop()
    assert seen[0] != seen[1] and seen[0::2] == [seen[0]] * 2 and seen[1::2] == [seen[1]] * 2


@pytest.mark.slow  # the two workers and the router start once: ~15 s
def test_generate_stream_batch_and_errors(router: ServerHandle, workers: list) -> None:
    with router.client() as c, workers[0].client() as direct:
        body = {
            "text": "Count: one two",
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
        }
        whole = c.post("/generate", json=body).json()
        assert whole == {
            **direct.post("/generate", json=body).json(),
            "meta_info": whole["meta_info"],
        }
        with c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            events = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
        assert events[-1] == "[DONE]" and len(events) >= 3
        assert json.loads(events[-2])["text"] == whole["text"]
        batch = c.post("/generate", json={**body, "text": ["Count: one two", "Hello"]}).json()
        assert isinstance(batch, list) and batch[0]["text"] == whole["text"]
        bad = c.post("/generate", json={"text": "x", "sampling_params": {"temperature": -1}})
        assert bad.status_code == 400 and "temperature" in bad.json()["error"]["message"]
        as_json = {"Content-Type": "application/json"}
        assert c.post("/generate", content=b"{not json", headers=as_json).status_code == 400
        huge = b"x" * (9 * 2**20)
        assert c.post("/generate", content=huge, headers=as_json).status_code == 413
        assert (
            c.post("/generate", content=b"{}", headers={"Content-Type": "text/plain"}).status_code
            == 415
        )
        assert c.get("/get_model_info").json()["is_generation"] is True
        assert c.post("/abort_request", json={"rid": "nothing-here"}).status_code == 200
        metrics = c.get("/metrics").text
    assert httpx.get(router.url + "/get_model_info").status_code == 401  # no key
    for w in workers:
        assert f'radixserve_prompt_tokens_total{{worker="{w.url}"}}' in metrics
    assert "radixserve_router_worker_in_flight" in metrics


@pytest.mark.slow  # the two workers and the router start once: ~15 s
def test_openai_sdk_through_router(router: ServerHandle, workers: list) -> None:
    from openai import OpenAI

    via = OpenAI(base_url=router.url + "/v1", api_key=API_KEY)
    direct = OpenAI(base_url=workers[1].url + "/v1", api_key=API_KEY)
    model = via.models.list().data[0].id
    msgs = [{"role": "user", "content": "Name a colour."}]
    kw = {"model": model, "messages": msgs, "max_tokens": 6, "temperature": 0}
    r = via.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert (
        r.choices[0].message.content
        == direct.chat.completions.create(**kw).choices[0].message.content
    )  # type: ignore[call-overload]
    parts = [
        ch.choices[0].delta.content or ""
        for ch in via.chat.completions.create(**kw, stream=True)  # type: ignore[call-overload]
        if ch.choices
    ]
    assert "".join(parts) == r.choices[0].message.content
    comp = via.completions.create(model=model, prompt="Once upon", max_tokens=5, temperature=0, n=2)
    assert len(comp.choices) == 2 and comp.usage is not None and comp.usage.completion_tokens == 10


@pytest.mark.slow  # the two workers and the router start once: ~15 s
def test_frontend_dsl_through_router(router: ServerHandle, workers: list) -> None:
    import radixserve as rs

    @rs.function
    def program(s, topic):  # type: ignore[no-untyped-def]
        s += f"Facts about {topic}:\n"
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"{i + 1}." + rs.gen("fact", max_tokens=6, temperature=0)
        s["facts"] = [f["fact"] for f in forks]
        s += rs.select("verdict", choices=["true", "false"])

    outs = []
    for url in (router.url, workers[0].url):
        backend = rs.RuntimeEndpoint(url, api_key=API_KEY)
        try:
            state = program.run(topic="the sea", backend=backend)
            outs.append((state["facts"], state["verdict"]))
        finally:
            backend.close()
    assert outs[0] == outs[1] and len(outs[0][0]) == 3


@pytest.mark.slow  # the two workers and the router start once: ~15 s
def test_add_and_remove_workers(router: ServerHandle, workers: list) -> None:
    gone = workers[1].url
    with router.client() as c:
        assert c.request("DELETE", "/workers", json={"url": gone}).status_code == 200
        try:
            seen = {gen(c, f"prompt {i}", max_new_tokens=1).headers[WORKER] for i in range(4)}
            assert seen == {workers[0].url}
            assert c.request("DELETE", "/workers", json={"url": gone}).status_code == 404
            bad = c.post("/workers", json={"url": "ftp://nowhere"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
        finally:
            added = c.post("/workers", json={"url": gone})
        assert added.status_code == 200 and added.json()["healthy"] is True
    wait_all_healthy(router, 2)


def connection_dropper() -> ThreadingHTTPServer:
    """A worker whose /health is fine but which drops every POST's connection unanswered."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.slow  # the two workers and the router start once: ~15 s
def test_a_broken_connection_retries_that_request_only(workers: list, tmp_path: Path) -> None:
    """Requests whose connection to a worker breaks are answered by another worker; the
    worker stays in (its health checks pass: one connection says little about others)."""
    dropper = connection_dropper()
    url = f"http://127.0.0.1:{dropper.server_address[1]}"
    slow_checks = ("--policy", "round_robin", "--health-interval-s", "60")  # none mid-test
    rt = launch_router(tmp_path, workers[0].url, url, args=slow_checks)
    try:
        wait_all_healthy(rt, 2)
        with rt.client() as c:
            rs = [gen(c, f"broken connection {i}", max_new_tokens=1) for i in range(4)]
            info = c.get("/get_server_info").json()
    finally:
        dropper.shutdown()
        assert rt.stop() == 0, rt.log_text()[-3000:]
    assert [r.status_code for r in rs] == [200] * 4
    assert {r.headers[WORKER] for r in rs} == {workers[0].url}
    assert info["router"]["retries"] >= 2  # round robin sent some to the dropper first
    assert [w["healthy"] for w in info["workers"]] == [True, True]


@pytest.mark.slow  # starts and stops processes, waits on health checks
def test_hung_worker_is_taken_out_and_comes_back(router: ServerHandle, workers: list) -> None:
    """A stopped (SIGSTOP) worker accepts connections but never answers: health checks take
    it out, the requests waiting on it are retried on the other, and it returns on SIGCONT."""
    with router.client() as c:
        home = gen(c, SYSTEM_A + "Who holds the map?").headers[WORKER]
        hung = next(w for w in workers if w.url == home)
        retries = c.get("/get_server_info").json()["router"]["retries"]
        hung.proc.send_signal(signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(4) as ex:  # the cache sends them to the hung worker
                rs = list(ex.map(lambda i: gen(c, SYSTEM_A + f"Hung question {i}?"), range(4)))
            after = c.get("/get_server_info").json()
        finally:
            hung.proc.send_signal(signal.SIGCONT)
    assert [r.status_code for r in rs] == [200] * 4
    assert {r.headers[WORKER] for r in rs} == {w.url for w in workers} - {home}
    assert after["router"]["retries"] > retries
    assert [w["healthy"] for w in after["workers"] if w["url"] == home] == [False]
    wait_all_healthy(router, 2)


@pytest.mark.slow  # starts and stops processes, waits on health checks
def test_kill_a_worker_under_load(workers: list, tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL one of two workers while both run requests: every non-streamed request is
    answered once, in full (those on the dead worker retried on the other); every stream
    ends with [DONE], complete or after an error event; the router stays up."""
    victim = launch_server(tiny_model_dir, tmp_path, "--max-total-tokens", "4096", api_key=API_KEY)
    rt = launch_router(tmp_path, workers[0].url, victim.url, args=("--policy", "round_robin"))
    sampling = {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}

    def one(c: httpx.Client, i: int) -> httpx.Response:
        body = {"text": f"request number {i}", "rid": f"kill-{i}", "sampling_params": sampling}
        return c.post("/generate", json=body)

    def stream(c: httpx.Client, i: int) -> list[dict]:
        body = {"text": f"stream number {i}", "sampling_params": sampling, "stream": True}
        with c.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200, resp.read()
            lines = [ln[5:].strip() for ln in resp.iter_lines() if ln.startswith("data:")]
        assert lines[-1] == "[DONE]", lines[-3:]
        return [json.loads(ln) for ln in lines[:-1]]

    try:
        wait_all_healthy(rt, 2)
        with rt.client() as c, victim.client() as vc, ThreadPoolExecutor(40) as ex:
            plain = [ex.submit(one, c, i) for i in range(24)]
            streams = [ex.submit(stream, c, i) for i in range(8)]
            poll_until(
                lambda: vc.get("/get_server_info").json()["scheduler"]["num_running"] >= 4,
                30,
                "the victim running 4 requests",
            )
            victim.proc.kill()
            answers = [f.result(timeout=120) for f in plain]
            events = [f.result(timeout=120) for f in streams]
        refused = [(i, a.status_code, a.text) for i, a in enumerate(answers) if a.is_error]
        assert not refused, (refused, rt.log_text()[-3000:])
        assert [a.json()["meta_info"]["id"] for a in answers] == [f"kill-{i}" for i in range(24)]
        assert all(a.json()["meta_info"]["completion_tokens"] == 160 for a in answers)
        for evs in events:  # complete, or cut by an error event once tokens were sent
            last = evs[-1]
            assert "error" in last or last["meta_info"]["completion_tokens"] == 160, last
        with rt.client() as c:
            info = c.get("/get_server_info").json()
            assert info["router"]["retries"] >= 1  # some requests were on the victim
            assert [w["healthy"] for w in info["workers"]] == [True, False]
            assert gen(c, "after the kill").headers[WORKER] == workers[0].url
    finally:
        victim.stop()
        assert rt.stop() == 0, rt.log_text()[-3000:]
