"""A child process killed under load: /health fails from then on, every client gets an
answer, the launcher exits non-zero, no process of the server outlives it and its socket
folder is gone. After a crash the launcher joins the other children only briefly: the
Shutdown it sends cannot pass the dead child."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import child_pid, children_of, launch_server, poll_until, wait_gone
from test_server_lifecycle import ipc_dir

from radixserve.server import launcher

LONG = {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def _load(url: str, clients: int, answered: list[int | str]) -> list[threading.Thread]:
    """Long requests, streamed and not; each client appends its answer to `answered`: the
    status, "error" for an error event in a stream, or -1 if the connection dropped."""

    def run(k: int) -> None:
        body = {"text": f"load {k}", "sampling_params": {**LONG, "n": 1 + k % 2}}
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                if k % 2 == 0:
                    answered.append(c.post("/generate", json=body).status_code)
                    return
                with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
                    events = [x for x in r.iter_lines() if x.startswith("data: {")]
                failed = r.status_code == 200 and events and '"error"' in events[-1]
                answered.append("error" if failed else r.status_code)
        except httpx.TransportError:  # the server went away mid-answer: also an answer
            answered.append(-1)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    return threads


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=10).status_code == 200
    except httpx.TransportError:  # the server is gone: not healthy either
        return False


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["scheduler", "tokenizer"])
def test_killed_child_under_load(tiny_model_dir, tmp_path, victim):
    h = launch_server(tiny_model_dir, tmp_path, "--max-total-tokens", "2048")
    log = h.log_text()
    sockets = ipc_dir(log)
    answered: list[int | str] = []
    threads = _load(h.url, 6, answered)
    with httpx.Client(base_url=h.url) as c:
        poll_until(
            lambda: c.get("/get_server_info").json()["scheduler"]["num_running"] >= 4,
            60,
            "4 requests of the load running",
        )
    family = descendants(h.proc.pid)
    pid = child_pid(log, victim)
    os.kill(pid, signal.SIGKILL)
    poll_until(lambda: not Path(f"/proc/{pid}").exists(), 60, "the killed child reaped")
    assert not healthy(h.url)  # from then on /health fails
    assert h.proc.wait(30) != 0
    for t in threads:
        t.join(30)
    assert len(answered) == 6 and 200 not in answered, answered  # none hung, none "succeeded"
    wait_gone(family)
    assert not sockets.exists()
    assert f"{victim} process exited with code -9" in h.log_text()


FAULT_TOKEN = 4242
FAULTY_FORWARD = f"""
from radixserve.worker import model_worker

forward = model_worker.ModelWorker.forward


def faulty(self, batch, rows):
    if {FAULT_TOKEN} in batch.input_ids.tolist():
        raise RuntimeError("injected fault")
    return forward(self, batch, rows)


model_worker.ModelWorker.forward = faulty
"""


@pytest.mark.slow  # a server of its own with a faulty forward (~17 s)
def test_a_step_that_raises_fails_its_request_and_the_server_goes_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The server's model forward raises for any batch holding FAULT_TOKEN (a sitecustomize
    on the children's path): that request is answered 500 naming the error, the scheduler
    checks its KV accounting as it goes idle, and the next request is served."""
    (tmp_path / "sitecustomize.py").write_text(FAULTY_FORWARD)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    h = launch_server(tiny_model_dir, tmp_path, env={"PYTHONPATH": path})
    try:
        params = {"temperature": 0, "max_new_tokens": 8}
        with httpx.Client(base_url=h.url, timeout=60) as c:
            r = c.post("/generate", json={"input_ids": [5, FAULT_TOKEN], "sampling_params": params})
            assert r.status_code == 500, r.text
            assert "internal error: RuntimeError: injected fault" in r.text
            for _ in range(2):  # the first one after the failure, and one more
                r = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": params})
                assert r.status_code == 200, r.text
                assert len(r.json()["output_ids"]) == 8
    finally:
        assert h.stop() == 0, h.log_text()[-4000:]
    assert "step failed: its requests end with an error" in h.log_text()


class FakeChild:
    """A child process as the launcher's `_stop_children` sees it."""

    def __init__(self, name: str, exitcode: int | None) -> None:
        self.name, self.exitcode = name, exitcode
        self.joins: list[float | None] = []  # the timeout of each join

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self.joins.append(timeout)  # a live child stays alive: it never got the Shutdown

    def terminate(self) -> None:
        self.exitcode = -signal.SIGTERM

    def kill(self) -> None:
        self.exitcode = -signal.SIGKILL


@pytest.mark.parametrize(
    ("tokenizer_exit", "wait"),
    [(None, launcher.CHILD_JOIN_S), (-signal.SIGKILL, launcher.CHILD_JOIN_AFTER_CRASH_S)],
)
def test_children_are_joined_briefly_after_a_crash(
    monkeypatch: pytest.MonkeyPatch, tokenizer_exit: int | None, wait: float
) -> None:
    monkeypatch.setattr(launcher, "time", SimpleNamespace(monotonic=lambda: 1000.0))  # frozen
    tokenizer = FakeChild("tokenizer", tokenizer_exit)
    scheduler = FakeChild("scheduler", None)
    launcher._stop_children({"tokenizer": tokenizer, "scheduler": scheduler})
    assert scheduler.joins[0] == wait, scheduler.joins
    assert scheduler.exitcode == -signal.SIGTERM  # then terminated
    assert launcher.CHILD_JOIN_AFTER_CRASH_S < launcher.CHILD_JOIN_S
