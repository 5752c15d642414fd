"""The api server's side of the IPC: submits requests, routes outputs, watches the children.

One `RequestManager` lives in the api server's event loop:
- `submit(GenerateReq, owner)` registers a `Pending` (an asyncio queue of that request's
  events) and sends the request to the tokenizer; `receive_loop` puts every `TextDelta` /
  `RequestError` for it into its queue; `events(pending)` reads them back.
- A request is named by its tenant and rid together: the tokenizer and scheduler see the
  key `"{owner}/{rid}"` (`request_key`; a tenant name holds no "/"), so two tenants may use
  one rid at once, and the deltas are handed back under the client's own rid.
- `cancel(pending)`, `abort(rid, tenant)` and every send are synchronous and non-blocking,
  so they are safe in the `finally` of a cancelled handler (a client that went away).
- A request leaves `pending` when its n-th sample finishes or it is refused; a final
  'abort' output is what an aborted request's samples finish with.
- Back-pressure: `check_room` keeps the unfinished samples of `pending` within
  `max_samples` (what the scheduler can run + queue), answering 503 beyond. So the
  requests on their way through the tokenizer and scheduler inboxes are bounded too,
  although the outbox itself has no high-water mark.
- `watch_children` notices a dead child: it records `failure`, fails every pending request
  (HTTP 500) and calls `on_failure` (the launcher stops the server and exits non-zero).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import msgspec
import zmq
import zmq.asyncio

from radixserve.core.info import ModelInfo
from radixserve.core.limits import MAX_SAMPLES
from radixserve.core.request import TextDelta
from radixserve.keys import ADMIN_TENANT
from radixserve.message.codec import decode, encode
from radixserve.message.ipc import IpcPaths
from radixserve.message.messages import (
    AbortReq,
    AnyMessage,
    CacheDigestResp,
    CacheTreeResp,
    ControlReq,
    ControlResp,
    FlushCacheResp,
    GenerateReq,
    Message,
    RequestError,
    SchemaResp,
    ServerInfoResp,
    TextDeltas,
    TokenizerReady,
)
from radixserve.server.metrics import Metrics
from radixserve.server.protocol import ApiError

logger = logging.getLogger("radixserve.server")

CHILD_POLL_S = 0.5
CONTROL_TIMEOUT_S = 30.0
RETRY_AFTER_S = "1"  # Retry-After for 503 queue full
SEND_LINGER_MS = 1000


class ChildDied(RuntimeError):
    """A child process exited while the server needed it."""


def request_key(owner: str, rid: str) -> str:
    """The name of tenant `owner`'s request `rid` past the api server (unique in flight)."""
    return f"{owner}/{rid}"


@dataclass
class Pending:
    rid: str  # the client's
    n: int  # samples to expect
    owner: str = ADMIN_TENANT  # the tenant that sent it (radixserve/server/guard.py)
    created: float = field(default_factory=time.perf_counter)
    queue: asyncio.Queue[TextDelta | RequestError] = field(default_factory=asyncio.Queue)
    first_token_at: float | None = None
    last_chunk_at: dict[int, float] = field(default_factory=dict)  # sample index -> time
    finished: int = 0  # samples finished, as seen by the receiver
    head: TextDelta | RequestError | None = None  # an event peeked by `first_event`

    @property
    def key(self) -> str:
        return request_key(self.owner, self.rid)

    @property
    def done(self) -> bool:
        return self.finished >= self.n


class RequestManager:
    def __init__(self, ipc: IpcPaths, metrics: Metrics, max_samples: int) -> None:
        self.metrics = metrics
        self.max_samples = max_samples  # samples in flight at once (running + queued)
        self._actx = zmq.asyncio.Context()
        self._inbox = self._actx.socket(zmq.PULL)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.bind(ipc.api)
        # Sync socket with no high-water mark: send() never blocks nor awaits.
        self._sctx = zmq.Context()
        self._outbox = self._sctx.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.setsockopt(zmq.SNDHWM, 0)
        self._outbox.connect(ipc.tokenizer)
        self.procs: dict[str, BaseProcess] = {}
        self.pending: dict[str, Pending] = {}  # request_key -> its Pending
        self.model_info: ModelInfo | None = None
        self.failure: str | None = None
        self._control: dict[int, asyncio.Future[ControlResp]] = {}
        self._seq = itertools.count()
        self._dispatch: dict[type, Callable[..., None]] = {
            TextDeltas: self._on_chunks,
            RequestError: self._on_error,
            FlushCacheResp: self._on_control,
            ServerInfoResp: self._on_control,
            CacheTreeResp: self._on_control,
            CacheDigestResp: self._on_control,
            SchemaResp: self._on_control,
        }

    # ---------------------------------------------------------------- start-up

    async def wait_ready(self, timeout_s: float) -> ModelInfo:
        """Wait for TokenizerReady; ChildDied if a child exits first, TimeoutError after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._raise_if_child_died()
            if await self._inbox.poll(200):
                msg = decode(await self._inbox.recv())
                assert isinstance(msg, TokenizerReady), f"expected TokenizerReady, got {msg!r}"
                self.model_info = msg.model_info
                return msg.model_info
        raise TimeoutError(f"the server was not ready after {timeout_s:.0f} s")

    def check_children(self) -> str | None:
        """None while every child lives, else what failed (also right after a crash, before
        `watch_children` has noticed it)."""
        try:
            self._raise_if_child_died()
        except ChildDied as e:
            return self.failure or str(e)
        return self.failure

    def _raise_if_child_died(self) -> None:
        for name, proc in self.procs.items():
            if proc.exitcode is not None:
                raise ChildDied(f"{name} process exited with code {proc.exitcode}")

    # ---------------------------------------------------------------- background tasks

    async def receive_loop(self) -> None:
        while True:
            msg: AnyMessage = decode(await self._inbox.recv())
            handler = self._dispatch.get(type(msg))
            if handler is None:
                logger.error("api server got unexpected %s", type(msg).__name__)
                continue
            handler(msg)

    async def watch_children(self, on_failure: Callable[[], None]) -> None:
        while self.failure is None:
            await asyncio.sleep(CHILD_POLL_S)
            try:
                self._raise_if_child_died()
            except ChildDied as e:
                self.failure = str(e)
                logger.error("%s: shutting the server down (see its traceback above)", e)
                self.fail_all(500, f"the server failed: {e}")
                on_failure()

    # ---------------------------------------------------------------- requests

    def send(self, msg: Message) -> None:
        self._outbox.send(encode(msg))

    @property
    def samples_in_flight(self) -> int:
        return sum(p.n - p.finished for p in self.pending.values())

    def check_room(self, samples: int) -> None:
        """Before submitting a request of `samples` samples: ApiError 400 if it can never
        be served at once, 503 (Retry-After) while the server holds too many already."""
        most = min(self.max_samples, MAX_SAMPLES)
        if samples > most:
            raise ApiError(400, f"n: the request asks for {samples} samples, at most {most}", "n")
        if self.samples_in_flight + samples > self.max_samples:
            raise ApiError(
                503,
                f"the server is at capacity ({self.max_samples} samples running or queued); "
                "retry later",
                headers={"Retry-After": RETRY_AFTER_S},
            )

    def submit(self, req: GenerateReq, owner: str = ADMIN_TENANT) -> Pending:
        """Register and send one request of tenant `owner`, under its `request_key` (`req`
        itself keeps the client's rid). ApiError 400 if `owner` has its rid in flight: the
        one check of it (the tokenizer and scheduler let a key go before this does)."""
        if self.failure is not None:
            raise ApiError(503, f"the server failed: {self.failure}")
        pending = Pending(req.rid, req.sampling.n, owner)
        if pending.key in self.pending:
            raise ApiError(400, f"rid {req.rid!r} is already in use", "rid")
        try:
            data = encode(msgspec.structs.replace(req, rid=pending.key))
        except (OverflowError, ValueError) as e:  # msgspec: ints beyond 64 bits, lone surrogates
            raise ApiError(400, f"the request cannot be encoded: {e}") from e
        self.pending[pending.key] = pending
        try:
            self._outbox.send(data)
        except BaseException:
            del self.pending[pending.key]  # never sent: its rid must not stay "in use"
            raise
        return pending

    def cancel(self, pending: Pending) -> None:
        """Ask the scheduler to stop `pending`; a no-op once it finished."""
        if self.pending.get(pending.key) is pending:
            logger.info("aborting rid %r of tenant %r", pending.rid, pending.owner)
            self.send(AbortReq(pending.key))

    def abort(self, rid: str, tenant: str | None = None) -> None:
        """Stop the client rid `rid` of `tenant` (None, the admin key: of every tenant).
        A rid the tenant has not in flight, another tenant's included, is a no-op."""
        if tenant is None:
            found = [p for p in self.pending.values() if p.rid == rid]
        else:
            own = self.pending.get(request_key(tenant, rid))
            found = [] if own is None else [own]
        for p in found:
            self.cancel(p)

    async def first_event(self, pending: Pending) -> None:
        """Wait for `pending`'s first event without consuming it; ApiError if refused.

        Streaming handlers call this before sending headers, so that a refusal is still an
        HTTP status (400/503) rather than an error inside a 200 stream.
        """
        if pending.head is None:
            pending.head = await pending.queue.get()
        _raise_if_error(pending.head)

    async def events(self, pending: Pending) -> AsyncIterator[TextDelta]:
        """Every delta of `pending` until its n samples finished; ApiError if refused."""
        finished = 0
        while finished < pending.n:
            if pending.head is not None:
                item, pending.head = pending.head, None
            else:
                item = await pending.queue.get()
            _raise_if_error(item)
            assert isinstance(item, TextDelta)
            finished += item.finish_reason is not None
            yield item

    async def merged(self, pendings: list[Pending]) -> AsyncIterator[tuple[int, TextDelta]]:
        """(position in `pendings`, delta) of all requests, in arrival order.

        The first ApiError of any request is raised; closing the iterator stops the pumps.
        """
        queue: asyncio.Queue[tuple[int, TextDelta | ApiError | None]] = asyncio.Queue()

        async def pump(i: int, p: Pending) -> None:
            try:
                async for d in self.events(p):
                    queue.put_nowait((i, d))
            except ApiError as e:
                queue.put_nowait((i, e))
            queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(pendings)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, ApiError):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def fail_all(self, status: int, message: str) -> None:
        for key in list(self.pending):
            self._on_error(RequestError(key, status, message))

    async def call(
        self, make: Callable[[int], ControlReq], timeout_s: float = CONTROL_TIMEOUT_S
    ) -> ControlResp:
        """Send a control request built with a fresh seq; await its response."""
        if self.failure is not None:
            raise ApiError(503, f"the server failed: {self.failure}")
        seq = next(self._seq)
        fut: asyncio.Future[ControlResp] = asyncio.get_running_loop().create_future()
        self._control[seq] = fut
        self.send(make(seq))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError as e:
            raise ApiError(503, "the scheduler did not answer in time") from e
        finally:
            self._control.pop(seq, None)

    # ---------------------------------------------------------------- handlers

    def _on_chunks(self, batch: TextDeltas) -> None:
        now = time.perf_counter()
        for d in batch.chunks:
            p = self.pending.get(d.rid)
            if p is None:
                continue  # already failed or given up on
            key, d.rid = d.rid, p.rid  # the client's rid from here on
            self._record(p, d, now)
            p.queue.put_nowait(d)
            if d.finish_reason is not None:
                p.finished += 1
                if p.done:
                    del self.pending[key]
                    self.metrics.e2e.observe(now - p.created)

    def _record(self, p: Pending, d: TextDelta, now: float) -> None:
        history = self.metrics.history
        if d.token_ids:
            history.tokens(len(d.token_ids))
            if p.first_token_at is None:
                p.first_token_at = now
                self.metrics.ttft.observe(now - p.created)
                history.ttft(now - p.created)
            last = p.last_chunk_at.get(d.index)
            if last is not None:
                history.itl((now - last) / len(d.token_ids))
            p.last_chunk_at[d.index] = now
        if d.finish_reason is not None:
            history.finished(d.prompt_tokens, d.cached_tokens)
            self.metrics.tenants.finished(p.owner, d)

    def _on_error(self, err: RequestError) -> None:
        p = self.pending.pop(err.rid, None)
        if p is not None:
            p.queue.put_nowait(err)

    def _on_control(self, resp: ControlResp) -> None:
        fut = self._control.get(resp.seq)
        if fut is not None and not fut.done():
            fut.set_result(resp)

    def close(self) -> None:
        """Close the sockets (the launcher calls this after the server stopped)."""
        self._inbox.close(linger=0)
        self._outbox.close(linger=SEND_LINGER_MS)  # let a last Shutdown reach the tokenizer
        self._actx.term()
        self._sctx.term()


def _raise_if_error(item: TextDelta | RequestError | None) -> None:
    """ApiError for a refusal, or for a sample the scheduler failed (finish "error")."""
    if isinstance(item, RequestError):
        headers = {"Retry-After": RETRY_AFTER_S} if item.status == 503 else None
        raise ApiError(item.status, item.message, headers=headers)
    reason = item.finish_reason if item is not None else None
    if reason is not None and reason.type == "error":
        raise ApiError(reason.status or 500, str(reason.matched))
