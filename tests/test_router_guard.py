"""The router's own checks, before anything reaches a worker (a real router process in front
of a stub worker: a plain HTTP server on loopback that records what it is sent): abort_all
however the JSON spells it needs the admin key, a body nested too deep is a 400, and only
the admin key learns which workers there are (/metrics, the X-Radixserve-Worker header, the
fan-out's answers by worker URL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from conftest import ServerHandle, free_port, wait_healthy

from radixserve.keys import ADMIN_API_KEY_ENV, API_KEY_ENV

INFERENCE = "inference-key-for-tenants"
ADMIN = "admin-key-for-the-operator"
WORKER = "x-radixserve-worker"
METRICS = b"radixserve_num_running_reqs 0\nradixserve_num_queued_reqs 0\n"
SSE = b'data: {"text": "ok"}\n\ndata: [DONE]\n\n'


class StubWorker(ThreadingHTTPServer):
    """/health 200, /metrics, and 200 to every POST, whose (path, body) it keeps in `posts`;
    a body asking for a stream gets one SSE event, and then, if its text is "break", the
    connection drops mid-stream."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, bytes]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._send(METRICS if self.path == "/metrics" else b"", "text/plain")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                stub.posts.append((self.path, body))
                if b'"text": "break"' in body:
                    self._break()
                elif b'"stream": true' in body:
                    self._send(SSE, "text/event-stream")
                else:
                    self._send(b'{"text": "ok"}', "application/json")

            def _send(self, body: bytes, media: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", media)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _break(self) -> None:
                """One chunk of a chunked stream, then the connection closes."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                event = SSE.split(b"\n\n")[0] + b"\n\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def stub() -> Iterator[StubWorker]:
    worker = StubWorker()
    threading.Thread(target=worker.serve_forever, daemon=True).start()
    yield worker
    worker.shutdown()


@pytest.fixture(scope="module")
def router(stub: StubWorker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve", "router", "--port", str(port),
           "--health-interval-s", "0.5", "--worker-urls", stub.url]  # fmt: skip
    env = {**os.environ, API_KEY_ENV: INFERENCE, ADMIN_API_KEY_ENV: ADMIN}
    log = tmp_path_factory.mktemp("router-guard") / "router.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, log, ADMIN)
    wait_healthy(handle, timeout=60)
    yield handle
    assert handle.stop() == 0, handle.log_text()[-3000:]


def post(router: ServerHandle, path: str, body: bytes, key: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(router.url + path, content=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    "body",
    [
        b'{"abort_all": true}',
        b'{"abort\\u005fall": true}',
        b'{"abort_all": false, "abort_all": true}',
    ],
)
def test_abort_all_needs_the_admin_key_however_it_is_spelled(
    router: ServerHandle, stub: StubWorker, body: bytes
) -> None:
    assert json.loads(body) == {"abort_all": True}  # as every worker reads it
    refused = post(router, "/abort_request", body, INFERENCE)
    assert refused.status_code == 403, refused.text
    assert "abort_all needs the admin API key" in refused.text
    assert ("/abort_request", body) not in stub.posts
    assert post(router, "/abort_request", body, ADMIN).status_code == 200
    assert stub.posts[-1] == ("/abort_request", body)


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/abort_request"])
def test_a_body_nested_too_deep_is_a_400(router: ServerHandle, stub: StubWorker, path: str) -> None:
    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    sent = len(stub.posts)
    r = post(router, path, deep, ADMIN)
    assert r.status_code == 400, r.text
    assert "nested deeper than" in r.json()["error"]["message"]
    assert len(stub.posts) == sent


def test_only_the_admin_key_learns_the_workers(router: ServerHandle, stub: StubWorker) -> None:
    body = b'{"text": "hi"}'
    stream = b'{"text": "hi", "stream": true}'
    for key, named in ((INFERENCE, False), (ADMIN, True)):
        for sent in (body, stream):
            r = post(router, "/generate", sent, key)
            assert r.status_code == 200, r.text
            assert r.headers.get(WORKER) == (stub.url if named else None)
        metrics = httpx.get(
            router.url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30
        )
        assert metrics.status_code == (200 if named else 403)
        assert (stub.url in metrics.text) == named
        abort = post(router, "/abort_request", b'{"rid": "r1"}', key)
        assert abort.status_code == 200, abort.text
        assert (stub.url in abort.text) == named
        if not named:
            assert abort.json() == {"text": "ok"}  # the stub worker's answer, as it gave it


def test_a_broken_stream_does_not_name_its_worker(router: ServerHandle, stub: StubWorker) -> None:
    """The error event of a stream whose worker failed mid-way names no URL (the router's
    log does)."""
    r = post(router, "/generate", b'{"text": "break", "stream": true}', INFERENCE)
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[0] == '{"text": "ok"}' and events[-1] == "[DONE]", r.text
    assert "the worker failed mid-stream" in events[-2]
    port = stub.url.rsplit(":", 1)[1]
    assert port not in r.text
    assert f"stream on {stub.url} failed mid-stream" in router.log_text()
