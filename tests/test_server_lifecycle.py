"""Process life of the server: CLI, queue-full 503, clean SIGINT/SIGTERM shutdown (no orphans,
socket folder removed), a crashed child (health fails, launcher exits 1 with the traceback
logged), and a failed start-up."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from conftest import child_pid, children_of, launch_server, poll_until, wait_gone


def ipc_dir(log: str) -> Path:
    m = re.search(r"IPC sockets in (\S+)", log)
    assert m, log[-2000:]
    return Path(m.group(1))


def test_port_in_use_fails_fast(tmp_path, tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "radixserve", "serve", "--model", str(tiny_model_dir)]
            + ["--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr


@pytest.mark.slow  # a fresh interpreter for the CLI's help (~3 s)
def test_cli_help_lists_the_flags():
    out = subprocess.run(
        [sys.executable, "-m", "radixserve", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for flag in (
        "--model", "--host", "--port", "--dtype", "--max-total-tokens", "--chunked-prefill-size",
        "--max-running-requests", "--max-queued-requests", "--schedule-policy",
        "--disable-radix-cache", "--attention-backend", "--tp-size", "--api-key", "--log-level",
    ):  # fmt: skip
        assert flag in out.stdout, flag
    bad = subprocess.run(
        [sys.executable, "-m", "radixserve", "serve", "--schedule-policy", "random"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "schedule-policy" in bad.stderr


@pytest.fixture(scope="module")
def small_server(tiny_model_dir, tmp_path_factory):
    """One running slot and one queue slot, so the third concurrent request is refused."""
    h = launch_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("small-server"),
        "--max-total-tokens",
        "512",
        "--max-running-requests",
        "1",
        "--max-queued-requests",
        "1",
    )
    yield h
    h.stop(signal.SIGKILL)


def test_queue_full_is_503_with_retry_after(small_server):
    long = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    c = small_server.client()
    first_chunk = threading.Event()
    results: dict[str, object] = {}

    def running() -> None:
        body = {"text": "occupy the slot", "rid": "busy", "stream": True, "sampling_params": long}
        with c.stream("POST", "/generate", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first_chunk.set()
        results["running"] = r.status_code

    def queued() -> None:
        body = {
            "text": "wait in the queue",
            "sampling_params": {"temperature": 0, "max_new_tokens": 2},
        }
        results["queued"] = c.post("/generate", json=body).status_code

    threads = [threading.Thread(target=running)]
    threads[0].start()
    assert first_chunk.wait(60)
    threads.append(threading.Thread(target=queued))
    threads[1].start()
    poll_until(
        lambda: c.get("/get_server_info").json()["scheduler"]["num_queued"] == 1,
        30,
        "the second request queued",
    )
    r = c.post("/generate", json={"text": "one too many", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    assert "queue" in r.json()["error"]["message"]
    c.post("/abort_request", json={"rid": "busy"})
    for t in threads:
        t.join(60)
    assert results == {"running": 200, "queued": 200}
    retry = c.post(
        "/generate", json={"text": "one too many", "sampling_params": {"max_new_tokens": 2}}
    )
    assert retry.status_code == 200


def test_sigint_shuts_down_cleanly(small_server):
    log = small_server.log_text()
    sockets = ipc_dir(log)
    assert sockets.is_dir() and (sockets.stat().st_mode & 0o777) == 0o700
    kids = children_of(small_server.proc.pid)
    assert child_pid(log, "scheduler") in kids and child_pid(log, "tokenizer") in kids
    assert small_server.stop(signal.SIGINT, timeout=60) == 0
    wait_gone(kids)
    assert not sockets.exists()
    final = small_server.log_text()
    assert "scheduler exited with code 0" in final and "tokenizer exited with code 0" in final


@pytest.mark.slow  # a server start and its crash: ~7 s
def test_crashed_child_fails_health_and_launcher_exits_nonzero(tiny_model_dir, tmp_path):
    h = launch_server(tiny_model_dir, tmp_path, "--max-total-tokens", "256")
    log = h.log_text()
    sched, tok = child_pid(log, "scheduler"), child_pid(log, "tokenizer")
    sockets = ipc_dir(log)
    os.kill(sched, signal.SIGKILL)
    statuses: list[int | None] = []

    def exited() -> bool:  # recording /health's answers until the launcher exits
        try:
            statuses.append(httpx.get(h.url + "/health", timeout=2).status_code)
        except httpx.TransportError:
            statuses.append(None)
        return h.proc.poll() is not None

    poll_until(exited, 30, "the launcher exited")
    assert h.proc.wait(60) == 1
    first_failure = next(i for i, s in enumerate(statuses) if s != 200)
    assert 200 not in statuses[first_failure:], statuses  # never healthy again
    assert 503 in statuses, statuses  # /health reported the dead child before the exit
    wait_gone([tok])
    assert not sockets.exists()
    assert "scheduler process exited with code -9" in h.log_text()


@pytest.mark.slow  # a failing server start: ~4 s
def test_failed_startup_logs_child_traceback_and_exits_1(tmp_path):
    h = launch_server(tmp_path / "no-such-model", tmp_path, wait=False)
    assert h.proc.wait(180) == 1
    log = h.log_text()
    assert "scheduler process crashed" in log and "Traceback" in log
    assert "FileNotFoundError" in log and "start-up failed" in log
    assert not ipc_dir(log).exists()
