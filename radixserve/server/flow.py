"""Request flow shared by the native and OpenAI routes: submit, wait, stream, abort.

Invariant: every request a handler submitted is either finished or aborted when the handler
ends, whatever way it ends (success, refusal of a sibling, client disconnect, cancellation).
`cancel` of a finished request is a no-op, so handlers simply abort all of theirs in `finally`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from radixserve.message.messages import GenerateReq
from radixserve.server.guard import cache_salt, tenant
from radixserve.server.manager import Pending, RequestManager
from radixserve.server.protocol import ApiError

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED = 499  # nginx's status for "client closed request"; never actually delivered


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def submit_all(manager: RequestManager, reqs: list[GenerateReq], request: Request) -> list[Pending]:
    """Submit requests for the caller of `request` (their owner: its tenant; their salt: its
    tenant's too under --cache-isolation tenant), all or none: 503 when the server has no
    room for their samples; if one is refused, abort those already sent and re-raise."""
    manager.check_room(sum(req.sampling.n for req in reqs))
    owner = tenant(request)
    pendings: list[Pending] = []
    try:
        for req in reqs:
            req.salt = cache_salt(request, req.salt.salt)
            pendings.append(manager.submit(req, owner))
    except BaseException:
        abort_all(manager, pendings)
        raise
    return pendings


def abort_all(manager: RequestManager, pendings: list[Pending]) -> None:
    for p in pendings:
        manager.cancel(p)


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body must already be read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(
    request: Request, manager: RequestManager, pendings: list[Pending], work: Awaitable[T]
) -> T | Response:
    """Run `work`; if the client goes away first, abort `pendings` and give up.

    Whatever happens, requests not finished when this returns are aborted.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return Response(status_code=CLIENT_CLOSED)
    finally:
        task.cancel()
        watcher.cancel()
        abort_all(manager, pendings)


async def start_stream(
    request: Request,
    manager: RequestManager,
    pendings: list[Pending],
    body: Callable[[], AsyncIterator[str]],
) -> Response:
    """An SSE response over `body()`, started only once every request produced its first
    event, so that a refusal is still a plain HTTP error. The stream ends with [DONE]; an
    error after the start becomes an `{"error": ...}` event. Disconnects abort."""

    async def first_events() -> None:
        await asyncio.gather(*(manager.first_event(p) for p in pendings))

    try:
        started = await unless_disconnected(request, manager, [], first_events())
    except BaseException:
        abort_all(manager, pendings)
        raise
    if isinstance(started, Response):
        abort_all(manager, pendings)
        return started

    async def framed() -> AsyncIterator[str]:
        try:
            async for chunk in body():
                yield chunk
        except ApiError as e:
            yield sse(e.body())
        finally:  # also reached when Starlette cancels us because the client left
            abort_all(manager, pendings)
        yield SSE_DONE

    return StreamingResponse(framed(), media_type="text/event-stream")
