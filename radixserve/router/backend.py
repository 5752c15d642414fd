"""One backend server as the router sees it: its URL, whether it is routable, and its load."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import httpx


@dataclass(eq=False)
class Backend:
    url: str
    healthy: bool = False  # routable; set by a passing health check, cleared on failure
    in_flight: int = 0  # requests this router has open on it
    reported_load: int = 0  # running + queued samples in its /metrics at the last refresh
    failures: int = 0  # consecutive failed health checks
    sent: int = 0  # requests routed to it since it was added
    # set when the worker is declared dead: every request open on it stops waiting at once
    down: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def load(self) -> int:
        """In-flight requests: our own count, or the worker's if other clients add to it."""
        return max(self.in_flight, self.reported_load)


class Lease:
    """One request in flight on a worker, from acquiring to `release` (idempotent)."""

    def __init__(self, worker: Backend) -> None:
        self.worker = worker
        self.open = True
        worker.in_flight += 1
        worker.sent += 1

    def release(self) -> None:
        if self.open:
            self.open = False
            self.worker.in_flight -= 1

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class BackendTransport(httpx.AsyncHTTPTransport):
    """httpx's transport to the workers. A worker that dies while a connection to it is
    being opened can close the socket before httpcore reads its peer, and anyio then raises
    AttributeError (the socket is None) where a closed connection's error belongs; that
    error is raised as the `httpx.ConnectError` it is, so the request is retried."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except AttributeError as e:
            why = f"the connection closed as it opened: {e!r}"
            raise httpx.ConnectError(why, request=request) from e
