"""The router's health checks against workers that answer badly (real HTTP servers on
loopback standing in for broken workers): whatever one worker answers, the loop goes on,
the others stay checked, and a malformed or huge /metrics never counts as load."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from radixserve.router.config import RouterConfig
from radixserve.router.policy import make_policy
from radixserve.router.pool import BackendPool

GOOD = b"radixserve_num_running_reqs 3\nradixserve_num_queued_reqs 2\n"
GARBAGE = (
    b"radixserve_num_running_reqs abc\nradixserve_num_queued_reqs inf\n"
    b"radixserve_num_running_reqs -5\nradixserve_num_queued_reqs 1e300\n\xff\xfe\n"
)


class StubWorker(ThreadingHTTPServer):
    """A loopback HTTP server whose shutdown also ends the answers still being written."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.closing = threading.Event()

    def shutdown(self) -> None:
        self.closing.set()
        super().shutdown()


def serve(metrics: bytes, trickle_s: float = 0.0) -> StubWorker:
    """/health 200; /metrics answers `metrics`, one byte per `trickle_s` if given (each
    read is quick, the whole never ends in time): the pace is the slow worker's behaviour,
    the same on any machine, and the answer stops when the server shuts down."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = metrics if self.path == "/metrics" else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not trickle_s:
                self.wfile.write(body)
                return
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                if server.closing.wait(trickle_s):
                    return

        def log_message(self, *args: object) -> None:
            pass

    server = StubWorker(Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def workers() -> Iterator[dict[str, str]]:
    kinds = {
        "good": serve(GOOD),
        "garbage": serve(GARBAGE),
        "huge": serve(b"radixserve_num_running_reqs 1\n" + b"x" * (8 << 20) + b"\n" + GOOD),
        "trickle": serve(GOOD, trickle_s=0.2),
    }
    yield {k: f"http://127.0.0.1:{s.server_address[1]}" for k, s in kinds.items()}
    for s in kinds.values():
        s.shutdown()


@pytest.mark.slow  # every kind of reply from fake workers (~4 s)
def test_health_checks_survive_any_worker_reply(workers: dict[str, str]) -> None:
    async def run() -> dict[str, tuple[bool, int]]:
        config = RouterConfig(worker_urls=tuple(workers.values()), health_timeout_s=1.0)
        async with httpx.AsyncClient() as client:
            pool = BackendPool(config, make_policy(config), client)
            for _ in range(2):  # health_failures: the trickling one goes out on the second
                await pool.check_all()
            return {k: (pool.workers[u].healthy, pool.workers[u].reported_load)
                    for k, u in workers.items()}  # fmt: skip

    got = asyncio.run(run())
    assert got["good"] == (True, 5)
    assert got["garbage"] == (True, 0)  # up (its /health is fine), no load from garbage
    assert got["huge"] == (True, 1)  # only the first MiB read: the good lines past it ignored
    assert got["trickle"][0] is False  # each check cut at 2 x the health timeout
