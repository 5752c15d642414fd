"""Forwarding one request to a worker, with failover.

An attempt goes to the worker `BackendPool.pick` names. If that worker fails before the
client saw anything (a refused or broken connection, or it is declared dead while the
request waits), the worker is taken out and the request is sent, unchanged, to another:
up to `max_attempts` workers, then 503. A worker's own answer (200, 400, 503, ...) is the
answer: it is passed through and never retried, so no request is answered twice.

A stream is answered only once its worker sent the first bytes of the body, so a stream
whose worker died before that is retried like any request. Once bytes went out, a dying
worker ends the stream with an `{"error": ...}` event and `data: [DONE]`.

Every attempt's upstream exchange runs as one task (a stream's task pumps the body into a
queue): a worker declared dead cancels exactly that task, and the router never waits on a
dead worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from radixserve.router.backend import Backend, Lease
from radixserve.router.pool import RETRY, BackendPool
from radixserve.server.protocol import ApiError

logger = logging.getLogger("radixserve.router")

T = TypeVar("T")
FORWARDED_HEADERS = ("authorization", "content-type")
ANSWER_HEADERS = ("content-type", "retry-after", "www-authenticate")
# on every answer forwarded to an admin caller: the worker that gave it
WORKER_HEADER = "X-Radixserve-Worker"
QUEUE_CHUNKS = 64  # a stream's chunks buffered between its worker and its client
MAX_ANSWER_BYTES = 64 << 20  # a non-streamed answer; past it the client gets a 502


class BackendDown(Exception):
    """The worker was declared dead while a request waited on it."""


@dataclass(frozen=True)
class Forward:
    """One client request as the router forwards it."""

    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    key: str | None  # the routing key (prompt); None: any worker will do
    session: str | None = None
    show_worker: bool = False  # the caller may learn the worker's URL (the admin key)

    def answer_headers(self, worker: Backend) -> dict[str, str]:
        return {WORKER_HEADER: worker.url} if self.show_worker else {}


async def until_down(worker: Backend, aw: Awaitable[T]) -> T:
    """`aw`'s result, or BackendDown as soon as `worker` is declared dead (`aw` cancelled)."""
    task = asyncio.ensure_future(aw)
    down = asyncio.ensure_future(worker.down.wait())
    try:
        await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        await asyncio.gather(task, return_exceptions=True)
        raise BackendDown(f"worker {worker.url} was taken out while the request waited")
    return task.result()


class Proxy:
    def __init__(self, pool: BackendPool, client: httpx.AsyncClient) -> None:
        self.pool = pool
        self.client = client

    def _attempts(self, fwd: Forward) -> Iterator[Backend]:
        tried: set[str] = set()
        for attempt in range(self.pool.config.max_attempts):
            if attempt:
                self.pool.retries += 1
            worker = self.pool.pick(fwd.key, fwd.session, tried)
            tried.add(worker.url)
            yield worker
        raise ApiError(503, f"no worker answered after {len(tried)} attempts", headers=RETRY)

    def _request(self, worker: Backend, fwd: Forward) -> httpx.Request:
        headers = {k: v for k, v in fwd.headers.items() if k.lower() in FORWARDED_HEADERS}
        return self.client.build_request(
            fwd.method, worker.url + fwd.path, content=fwd.body, headers=headers
        )

    async def forward(self, fwd: Forward) -> Response:
        """The first answer a worker gives (non-streamed). A transport error moves this
        request to the next worker; whether the worker is down is the health checks'
        call (one request's broken connection says little about the others')."""
        for worker in self._attempts(fwd):
            with Lease(worker):
                try:
                    status, headers, body = await until_down(worker, self._read(worker, fwd))
                except (httpx.TransportError, BackendDown) as e:
                    logger.info("request to %s failed, trying another worker: %r", worker.url, e)
                    continue
            return _answer(status, headers, body, fwd.answer_headers(worker))
        raise AssertionError("unreachable: _attempts raises when it runs out")

    async def _read(self, worker: Backend, fwd: Forward) -> tuple[int, httpx.Headers, bytes]:
        """The worker's answer, its body cut off with a 502 past MAX_ANSWER_BYTES."""
        resp = await self.client.send(self._request(worker, fwd), stream=True)
        try:
            parts, size = [], 0
            async for chunk in resp.aiter_raw():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:  # the client learns no worker URL (admin only)
                    logger.warning("%s answered over %d bytes", worker.url, MAX_ANSWER_BYTES)
                    raise ApiError(502, f"the worker answered over {MAX_ANSWER_BYTES} bytes")
                parts.append(chunk)
            return resp.status_code, resp.headers, b"".join(parts)
        finally:
            await resp.aclose()

    async def stream(self, fwd: Forward) -> Response:
        """A streamed answer, relayed chunk by chunk once its first chunk arrived."""
        for worker in self._attempts(fwd):
            lease = Lease(worker)
            queue: asyncio.Queue[tuple[str, Any, Any]] = asyncio.Queue(QUEUE_CHUNKS)
            pump = asyncio.create_task(self._pump(worker, fwd, queue))
            handed_off = False
            try:
                kind, status, headers = await until_down(worker, queue.get())
                if kind == "head" and status != 200:  # the worker's refusal: pass it on
                    refusal = await _drain(worker, queue)
                    return _answer(status, headers, refusal, fwd.answer_headers(worker))
                if kind == "head":
                    kind, first, _ = await until_down(worker, queue.get())
                    if kind == "data":
                        handed_off = True
                        relay = self._relay(worker, queue, pump, lease, first)
                        # the relay's own `finally` cleans up; the task covers a relay that
                        # never starts (the client left before the first chunk was written)
                        cleanup = BackgroundTask(_stop_later, pump, lease)
                        return StreamingResponse(
                            relay,
                            media_type="text/event-stream",
                            headers=fwd.answer_headers(worker),
                            background=cleanup,
                        )
                    status = first  # the error (or end) that came before any data
                logger.info("stream on %s failed before its first chunk: %r", worker.url, status)
            except BackendDown as e:
                logger.info("stream on %s: %r", worker.url, e)
            finally:
                if not handed_off:
                    _stop(pump, lease)
        raise AssertionError("unreachable: _attempts raises when it runs out")

    async def _pump(self, worker: Backend, fwd: Forward, queue: asyncio.Queue) -> None:
        """Upstream side of a stream, as triples: ("head", status, headers), then
        ("data", bytes, None)..., then ("end", None, None) or ("error", exception, None)."""
        try:
            resp = await self.client.send(self._request(worker, fwd), stream=True)
            try:
                await queue.put(("head", resp.status_code, resp.headers))
                async for chunk in resp.aiter_raw():
                    await queue.put(("data", chunk, None))
            finally:
                await resp.aclose()
        except httpx.HTTPError as e:
            await queue.put(("error", e, None))
            return
        await queue.put(("end", None, None))

    async def _relay(
        self, worker: Backend, queue: asyncio.Queue, pump: asyncio.Task, lease: Lease, first: bytes
    ) -> AsyncIterator[bytes]:
        sent = first
        try:
            yield first
            while True:
                kind, value, _ = await until_down(worker, queue.get())
                if kind == "end":
                    return
                if kind == "error":
                    raise BackendDown(repr(value))
                sent = value
                yield value
        except BackendDown as e:  # the client learns no worker URL (admin only)
            logger.warning("stream on %s failed mid-stream: %s", worker.url, e)
            yield _error_event(sent, "the worker failed mid-stream")
        finally:
            _stop(pump, lease)


async def _drain(worker: Backend, queue: asyncio.Queue) -> bytes:
    """The rest of a refusal's body."""
    parts: list[bytes] = []
    while True:
        kind, value, _ = await until_down(worker, queue.get())
        if kind != "data":
            return b"".join(parts)
        parts.append(value)


def _stop(pump: asyncio.Task, lease: Lease) -> None:
    pump.cancel()
    lease.release()


async def _stop_later(pump: asyncio.Task, lease: Lease) -> None:
    """`_stop` as a coroutine: BackgroundTask runs a plain function on a worker thread,
    and a task must be cancelled from its own event loop."""
    _stop(pump, lease)


def _answer(status: int, headers: httpx.Headers, content: bytes, own: dict[str, str]) -> Response:
    """The worker's answer with its `headers` that clients need, and the router's `own`."""
    kept = {k: v for k, v in headers.items() if k.lower() in ANSWER_HEADERS}
    return Response(content, status_code=status, headers={**kept, **own})


def _error_event(sent: bytes, message: str) -> bytes:
    """An SSE error event and [DONE], on a fresh event boundary after `sent`'s last bytes."""
    err = ApiError(502, message).body()
    gap = b"" if sent.endswith(b"\n\n") else b"\n\n"
    return gap + f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
