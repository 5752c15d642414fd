"""Every way a request can end leaves nothing behind: the api server's pending table, the
tokenizer's request table, the scheduler's active table, its running and waiting queues and
the KV slots held by requests all return to zero (read from /get_server_info), and the
client always gets an answer. The abort storm: 40 streams cut after 1-3 chunks and 20 client
timeouts, half of them with n = 2, clean within 10 s."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from conftest import ServerHandle, launch_server, poll_until

RUNNING = 4  # --max-running-requests: a fifth sample waits in the queue
GREEDY = {"temperature": 0, "max_new_tokens": 8}
LONG = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def leak_server(tiny_model_dir, tmp_path_factory):
    h = launch_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("leak-server"),
        "--max-total-tokens",
        "1024",
        "--max-running-requests",
        str(RUNNING),
    )
    yield h
    assert h.stop() == 0, h.log_text()[-4000:]


@pytest.fixture(scope="module")
def client(leak_server):
    with leak_server.client() as c:
        yield c


def tables(c: httpx.Client) -> dict[str, int]:
    r = c.get("/get_server_info")
    assert r.status_code == 200, r.text
    info = r.json()
    s = info["scheduler"]
    return {
        "api_pending": info["api_pending_requests"],
        "tokenizer": info["tokenizer_requests"],
        "active": s["active_requests"],
        "running": s["num_running"],
        "queued": s["num_queued"],
        "kv_held": s["kv_held_tokens"],
    }


def wait_clean(c: httpx.Client, timeout: float = 10) -> None:
    """Every table back to zero within `timeout` s, and no KV slot used once the cache is
    flushed."""
    poll_until(lambda: not any(tables(c).values()), timeout, lambda: f"clean: {tables(c)}")
    assert c.post("/flush_cache", json={}).status_code == 200
    assert c.get("/get_server_info").json()["scheduler"]["kv_used_tokens"] == 0


def body_for(route: str, k: int, n: int, stream: bool, params: dict) -> dict:
    """A request for `route` with prompt number `k`, `n` samples and the sampling `params`."""
    text = f"request {k}: tell me a long story"
    if route == "/generate":
        return {"text": text, "stream": stream, "sampling_params": {**params, "n": n}}
    sampling = {
        "max_tokens": params["max_new_tokens"],
        "temperature": params["temperature"],
        "ignore_eos": params.get("ignore_eos", False),
        "n": n,
        "stream": stream,
    }
    if route == "/v1/completions":
        return {"prompt": text, **sampling}
    return {"messages": [{"role": "user", "content": text}], **sampling}


def data_lines(r: httpx.Response):
    for line in r.iter_lines():
        if line.startswith("data: {"):
            yield json.loads(line[6:])


# ---------------------------------------------------------------- one ending at a time


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("route", ROUTES)
def test_finish(client, route, n):
    r = client.post(route, json=body_for(route, 0, n, False, GREEDY))
    assert r.status_code == 200, r.text
    wait_clean(client)


@pytest.mark.parametrize("n", [1, 2])
def test_abort_request_of_a_running_stream(client, n):
    body = {**body_for("/generate", 1, n, True, LONG), "rid": f"running-{n}"}
    reasons = {}
    with client.stream("POST", "/generate", json=body) as r:
        for chunk in data_lines(r):
            if not reasons:
                client.post("/abort_request", json={"rid": f"running-{n}"})
            reasons[chunk.get("index", 0)] = chunk["meta_info"]["finish_reason"]
    assert [reasons[i]["type"] for i in range(n)] == ["abort"] * n, reasons
    wait_clean(client)


@pytest.mark.parametrize("n", [1, 2])
def test_abort_request_of_a_queued_request_answers_its_client(leak_server, client, n):
    """The request reaches the stopped scheduler with its abort behind it: once it goes on
    it queues the request and aborts it before any step can admit it."""
    answer: dict[str, httpx.Response] = {}
    rid = f"queued-{n}"
    body = {**body_for("/generate", 2, n, False, GREEDY), "rid": rid}

    def wait_for_answer() -> None:
        with leak_server.client() as c:
            answer["r"] = c.post("/generate", json=body)

    waiter = threading.Thread(target=wait_for_answer)
    with leak_server.scheduler_stopped():
        waiter.start()

        def aborted() -> bool:  # /abort_request is a no-op until the request reached the api
            client.post("/abort_request", json={"rid": rid})
            return leak_server.abort_sent(rid)

        poll_until(aborted, 30, "the request reaching the api server (its abort sent)")
    waiter.join(30)
    assert not waiter.is_alive(), "the client of an aborted queued request was left hanging"
    out = answer["r"].json()
    outs = out if isinstance(out, list) else [out]
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * n
    wait_clean(client)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("route", ROUTES)
def test_client_disconnect_mid_stream(leak_server, client, route, n):
    with leak_server.client() as c:
        with c.stream("POST", route, json=body_for(route, 3, n, True, LONG)) as r:
            assert r.status_code == 200
            next(data_lines(r))
    wait_clean(client)


def generated(c: httpx.Client) -> int:
    return c.get("/get_server_info").json()["scheduler"]["generation_tokens_total"]


@pytest.mark.parametrize("n", [1, 2])
def test_client_timeout(leak_server, client, n):
    """A client gives up on a plain request: the api server aborts it, so it stops long
    before its 900 tokens. The scheduler is stopped until the abort is on its way, so the
    client's timeout is reached however fast this machine decodes."""
    params = {**LONG, "max_new_tokens": 900}
    body = {**body_for("/generate", 4, n, False, params), "rid": f"impatient-{n}"}
    before = generated(client)
    with leak_server.scheduler_stopped():
        with leak_server.client() as c, pytest.raises(httpx.ReadTimeout):
            c.post("/generate", json=body, timeout=0.3)
        leak_server.wait_aborts_sent([body["rid"]])
    wait_clean(client)
    assert generated(client) - before < params["max_new_tokens"]


def test_rid_clash_is_refused_and_the_first_request_is_untouched(client):
    body = {**body_for("/generate", 5, 1, True, {**LONG, "max_new_tokens": 40}), "rid": "dup"}
    with client.stream("POST", "/generate", json=body) as r:
        chunks = data_lines(r)
        next(chunks)
        clash = client.post("/generate", json={"text": "again", "rid": "dup"})
        assert clash.status_code == 400 and "already in use" in clash.text
        last = list(chunks)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length"
    assert len(last["output_ids"]) == 40
    assert client.post("/generate", json={"text": "now free", "rid": "dup"}).status_code == 200
    wait_clean(client)


def test_a_request_that_cannot_be_sent_releases_its_rid(client):
    # A lone surrogate cannot be encoded for IPC: 400, and the rid is not left "in use".
    raw = b'{"text": "\\ud800", "rid": "unsendable"}'
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    ok = client.post("/generate", json={"text": "hello", "rid": "unsendable"})
    assert ok.status_code == 200, ok.text
    wait_clean(client)


@pytest.mark.parametrize("n", [1, 2])
def test_refused_by_the_scheduler(client, n):
    body = {"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100, "n": n}}
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and "max_new_tokens" in r.text
    wait_clean(client)


@pytest.mark.parametrize("n", [1, 2])
def test_pattern_that_fails_to_compile(client, n):
    # Python parses it (so the edge lets it through); outlines cannot build a lookahead, so
    # it fails on the compile thread and the scheduler refuses all n samples.
    body = {"text": "x", "sampling_params": {"regex": "a(?=b)b", "n": n}}
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and "regex" in r.text, r.text
    wait_clean(client)


def test_client_gone_while_its_pattern_compiles(leak_server, client):
    fields = {f"field_{i}": {"type": "string"} for i in range(30)}
    schema = json.dumps({"type": "object", "properties": fields, "required": list(fields)})
    body = {"text": "x", "rid": "compiling", "sampling_params": {"json_schema": schema, "n": 2}}
    # Stopped, the scheduler receives the request and its abort together once it goes on:
    # the abort reaches a request whose grammar has just been sent to compile.
    with leak_server.scheduler_stopped():
        with leak_server.client() as c, pytest.raises(httpx.ReadTimeout):
            c.post("/generate", json=body, timeout=0.3)
        leak_server.wait_aborts_sent([body["rid"]])
    wait_clean(client)


# ---------------------------------------------------------------- the abort storm


STORM_TOKENS = 800


async def _storm(server: ServerHandle) -> tuple[int, int]:
    """40 streams cut after 1-3 chunks and 20 requests whose clients time out, every other
    one with n = 2, over all three generation routes. Returns (streams cut, timeouts).

    The scheduler is stopped while the 60 requests arrive and until the 20 timeouts have
    been aborted, so each timeout is reached on any machine; then all 60 and the 20 aborts
    reach it at once, and the streams run until they are cut."""
    params = {**LONG, "max_new_tokens": STORM_TOKENS}
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:

        async def cut(k: int) -> bool:
            route = ROUTES[k % 3]
            body = body_for(route, k, 1 + k % 2, True, params)
            async with c.stream("POST", route, json=body) as r:
                assert r.status_code == 200, await r.aread()
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: {")
                    if seen == 1 + k % 3:
                        return True  # leaving the block closes the connection mid-stream
            return False

        async def timeout(k: int) -> bool:
            route = ROUTES[k % 3]
            body = {**body_for(route, 100 + k, 1 + k % 2, False, params), "rid": f"gone-{k}"}
            try:
                await c.post(route, json=body, timeout=1.0)
            except httpx.ReadTimeout:
                return True
            return False

        with server.scheduler_stopped():
            cuts = [asyncio.ensure_future(cut(k)) for k in range(40)]
            timeouts = await asyncio.gather(*map(timeout, range(20)))
            rids = [f"gone-{k}" for k in range(20)]
            await asyncio.to_thread(server.wait_aborts_sent, rids)
        return sum(await asyncio.gather(*cuts)), sum(timeouts)


def test_abort_storm_leaves_every_table_clean_within_10s(leak_server, client):
    reference = client.post("/generate", json={"text": "the reference", "sampling_params": GREEDY})
    wait_clean(client)
    before = generated(client)
    cut, timed_out = asyncio.run(_storm(leak_server))
    assert (cut, timed_out) == (40, 20)
    wait_clean(client, timeout=10)
    # Cut and timed out, the 60 requests stopped early: far below their 60 x 800 tokens.
    assert generated(client) - before < 60 * STORM_TOKENS // 4
    assert "radixserve_kv_held_tokens 0.0" in client.get("/metrics").text
    again = client.post("/generate", json={"text": "the reference", "sampling_params": GREEDY})
    assert again.json()["output_ids"] == reference.json()["output_ids"]
    wait_clean(client)
