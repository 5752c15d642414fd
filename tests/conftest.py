"""Shared fixtures. Server tests run the REAL server (`python -m radixserve serve`) as a
subprocess on a free loopback port, with a tiny random Llama (hidden 64, 2 layers) that
uses the embedded SmolLM2 tokenizer (so chat templates and multi-byte text are real)."""

from __future__ import annotations

import json
import os

# Tests run several torch processes at once (pytest, server children) on few cores: idle
# OpenMP threads must sleep, not spin, or each process steals the others' cores. Set before
# anything imports torch; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from hypothesis import settings

from radixserve.models.synthetic import build_tiny_model
from radixserve.native_build import build_in_background

# Property tests: a few examples each on a developer's machine, many in CI (.ci/run sets
# CI=true; Hypothesis's own "ci" profile adds derandomize, no database, print_blob). No
# deadline in either: a test checks behaviour, not how fast this machine runs an example.
settings.register_profile("default", max_examples=20, deadline=None)
settings.register_profile("ci", settings.get_profile("ci"), max_examples=300)
settings.load_profile("ci" if os.environ.get("CI") == "true" else "default")

API_KEY = "test-key"
STARTUP_TIMEOUT_S = 180.0
POLL_INTERVAL_S = 0.05
T = TypeVar("T")


def poll_until(predicate: Callable[[], T], deadline_s: float, what: str | Callable[[], str]) -> T:
    """Call `predicate` until it returns a truthy value, and return that value; fail the test
    once `deadline_s` seconds have passed, saying what never happened (`what`, or what it
    returns: a message built from the state seen last)."""
    deadline = time.monotonic() + deadline_s
    while not (result := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"not within {deadline_s} s: {what if isinstance(what, str) else what()}")
        time.sleep(POLL_INTERVAL_S)
    return result


def wait_gone(pids: list[int], deadline_s: float = 10) -> None:
    """Until every process of `pids` has exited (the launcher joins its children; the
    multiprocessing resource tracker exits when the launcher's pipe closes)."""
    poll_until(
        lambda: not any(pid_alive(p) for p in pids),
        deadline_s,
        lambda: f"processes gone: {[p for p in pids if pid_alive(p)]} still alive",
    )


def idle_info(client: httpx.Client) -> dict | None:
    """/get_server_info when nothing is in flight anywhere (api server, scheduler), else None."""
    r = client.get("/get_server_info")
    assert r.status_code == 200, r.text
    info = r.json()
    s = info["scheduler"]
    busy = (s["num_running"], s["num_queued"], s["active_requests"], info["api_pending_requests"])
    return info if busy == (0, 0, 0, 0) else None


def wait_idle(client: httpx.Client, deadline_s: float = 60) -> dict:
    """Until nothing is in flight anywhere; returns that /get_server_info."""
    return poll_until(
        lambda: idle_info(client),
        deadline_s,
        lambda: f"server idle: {client.get('/get_server_info').json()}",
    )


@pytest.fixture(scope="session", autouse=True)
def native_kernels_built() -> None:
    """Compile every native CPU module once, before any test starts a server: a server child
    compiling them itself would spend much of its start-up timeout on it, and the children
    find them in the build cache. The four build side by side, as a worker's do."""
    from radixserve.kernels import native as attention
    from radixserve.models import native, quant
    from radixserve.sampling import sampler

    getters = (quant.ops, native.ops, attention.ops, sampler.native_ops)
    build_in_background(*getters)
    for getter in getters:
        getter()  # waits for its build


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid` (Linux /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry.name))
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def child_pid(log: str, name: str) -> int:
    """The pid of the server's child process `name` ("scheduler", "tokenizer"), from its log."""
    m = re.search(rf"radixserve-{name}\[(\d+)\]", log)
    assert m, log[-2000:]
    return int(m.group(1))


@dataclass
class ServerHandle:
    url: str
    proc: subprocess.Popen
    log: Path
    api_key: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kw)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    @contextmanager
    def scheduler_stopped(self) -> Iterator[None]:
        """The scheduler process stopped (SIGSTOP, every thread) for the block: no request
        makes progress, so a client's timeout is reached on any machine, while the api
        server and the tokenizer go on; what they send waits in the scheduler's socket and
        is received in order once it continues (SIGCONT). Nothing in the block may wait
        for the scheduler (/get_server_info, /metrics, an answer)."""
        pid = child_pid(self.log_text(), "scheduler")
        os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(pid, signal.SIGCONT)

    def abort_sent(self, rid: str) -> bool:
        """Whether the api server has sent the scheduler an abort of `rid` (its log line)."""
        return f"aborting rid {rid!r}" in self.log_text()

    def wait_aborts_sent(self, rids: list[str], timeout: float = 60) -> None:
        """Wait until the api server has sent the scheduler an abort for each of `rids`."""
        poll_until(
            lambda: all(self.abort_sent(r) for r in rids),
            timeout,
            lambda: f"aborts sent; none for {[r for r in rids if not self.abort_sent(r)]}",
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def launch_server(
    model_dir: Path | str | None,
    log_dir: Path,
    *args: str,
    api_key: str | None = None,
    wait: bool = True,
    dtype: str = "float32",
    env: dict[str, str] | None = None,
) -> ServerHandle:
    """Start `python -m radixserve serve` on a free port (model None: the embedded one);
    wait for /health unless told not to."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--dtype", dtype]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    cmd += list(args)
    if api_key:  # one key for both scopes (tests/test_server_security.py tests them apart)
        cmd += ["--api-key", api_key, "--admin-api-key", api_key]
    log = log_dir / f"server-{port}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, log, api_key)
    if wait:
        wait_healthy(handle)
    return handle


def wait_healthy(h: ServerHandle, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Until /health answers 200; raises at once if the server exits, kills it at the
    deadline."""

    def healthy() -> bool:
        if h.proc.poll() is not None:
            raise RuntimeError(f"server exited with {h.proc.returncode}:\n{h.log_text()[-4000:]}")
        try:
            return httpx.get(h.url + "/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        poll_until(healthy, timeout, lambda: f"server healthy:\n{h.log_text()[-4000:]}")
    except pytest.fail.Exception:
        h.stop(signal.SIGKILL)
        raise


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def abort_mid_stream(
    server: ServerHandle, owner: str, aborter: str, rid: str
) -> tuple[httpx.Response, str]:
    """Stream a long /generate of `rid` with key `owner`; after its first chunk, key
    `aborter` aborts `rid`: (the abort's response, how the request finished)."""
    body = {"text": "Count:", "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}  # fmt: skip
    abort, last = None, None
    with httpx.Client(base_url=server.url, timeout=120) as c:
        with c.stream("POST", "/generate", json=body, headers=bearer(owner)) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if abort is None:
                    abort = c.post("/abort_request", json={"rid": rid}, headers=bearer(aborter))
                last = json.loads(line[6:])
    assert abort is not None and last is not None
    return abort, last["meta_info"]["finish_reason"]["type"]


@pytest.fixture(scope="session")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    """One shared server: tiny model, 1024-token KV pool, API key required."""
    h = launch_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("server-logs"),
        "--max-total-tokens",
        "1024",
        "--log-level",
        "info",
        api_key=API_KEY,
    )
    yield h
    code = h.stop()
    assert code == 0, f"server exited with {code}:\n{h.log_text()[-4000:]}"


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
