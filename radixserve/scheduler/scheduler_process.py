"""The scheduler process: hosts the Scheduler (and with it the model worker and KV pool).

It drives the one `StepLoop` (`loop.py`) with the ZeroMQ inbox and outbox:
receive -> schedule + forward (`StepLoop.step`) -> send outputs.

    while not stopping:
        messages = all pending (block up to 1 s only when the scheduler has no work)
        dispatch each message             # add / abort / flush / info / shutdown
        if has_work: step()               # one batch; its outputs go to the tokenizer
        elif it just went idle: check_integrity()

Requests arrive as the typed `TokenizedRequest` (parameters parsed once, at the api server);
they are accepted or refused at once: a refusal is a `RequestError` (400 for a request
that can never run, 503 when the waiting queue is full) and the request holds nothing.
"""

from __future__ import annotations

import gc
import logging
import time

import zmq

from radixserve.config import EngineConfig
from radixserve.core.digest import join
from radixserve.core.request import TokenDelta
from radixserve.distributed.parallel import init_tp
from radixserve.kvcache.digest import DigestMemo, cache_digest
from radixserve.message.ipc import Inbox, IpcPaths, Outbox
from radixserve.message.messages import (
    AbortReq,
    AnyMessage,
    CacheDigestReq,
    CacheDigestResp,
    CacheTreeReq,
    CacheTreeResp,
    FlushCacheReq,
    FlushCacheResp,
    RequestError,
    ScheduleReq,
    SchedulerReady,
    SchemaReq,
    SchemaResp,
    ServerInfoReq,
    ServerInfoResp,
    Shutdown,
    TokenDeltas,
)
from radixserve.procutil import PARENT_POLL_MS, ParentWatch
from radixserve.scheduler.loop import StepLoop
from radixserve.scheduler.parts import load_parts
from radixserve.scheduler.scheduler import Scheduler

logger = logging.getLogger("radixserve.scheduler.scheduler_process")


class SchedulerProcess:
    def __init__(self, sched: Scheduler, inbox: Inbox, out: Outbox, watch: ParentWatch) -> None:
        self.sched = sched
        self.inbox = inbox
        self.out = out
        self.watch = watch
        self.loop = StepLoop(sched, self.send_outputs, self.refuse)  # no backlog: 503
        self.stopping = False
        self.digest_memo = DigestMemo()  # each node's hashes from the last /cache_digest
        self.dispatch = {
            ScheduleReq: self.on_request,
            AbortReq: self.on_abort,
            FlushCacheReq: self.on_flush,
            ServerInfoReq: self.on_info,
            CacheTreeReq: self.on_cache_tree,
            CacheDigestReq: self.on_cache_digest,
            SchemaReq: self.on_schema,
            Shutdown: self.on_shutdown,
        }

    def run(self) -> None:
        was_busy = False
        last_parent_check = time.monotonic()
        while not self.stopping:
            for msg in self.receive(block=not self.loop.has_work()):
                self.handle(msg)
            if self.stopping:
                break
            busy = self.loop.has_work()
            if busy:
                self.loop.step()
            elif was_busy:
                self.sched.check_integrity()  # every time it drains: free+cached+locked == pool
            was_busy = busy
            if time.monotonic() - last_parent_check > PARENT_POLL_MS / 1000:
                last_parent_check = time.monotonic()
                self.stopping = self.stopping or not self._parent_alive()

    def receive(self, block: bool) -> list[AnyMessage]:
        if not block:
            return self.inbox.recv_all_nowait()
        first = self.inbox.recv(PARENT_POLL_MS)
        if first is None:
            self.stopping = not self._parent_alive()
            return []
        return [first, *self.inbox.recv_all_nowait()]

    def handle(self, msg: AnyMessage) -> None:
        handler = self.dispatch.get(type(msg))
        assert handler is not None, f"scheduler process got unexpected {type(msg).__name__}"
        handler(msg)  # type: ignore[operator]

    def _parent_alive(self) -> bool:
        alive = self.watch.parent_alive()
        if not alive:
            logger.warning("launcher is gone: scheduler process exits")
        return alive

    # ---------------------------------------------------------------- handlers

    def on_request(self, msg: ScheduleReq) -> None:
        self.loop.add(msg.request)

    def on_abort(self, msg: AbortReq) -> None:
        self.loop.abort(msg.rid)

    def on_flush(self, msg: FlushCacheReq) -> None:
        self.out.send(FlushCacheResp(msg.seq, self.sched.flush_cache()))

    def on_info(self, msg: ServerInfoReq) -> None:
        self.out.send(ServerInfoResp(msg.seq, self.sched.stats(), len(self.loop.active)))

    def on_cache_tree(self, msg: CacheTreeReq) -> None:
        view = self.sched.cache_tree(msg.max_nodes, msg.max_depth, msg.tenant)
        self.out.send(CacheTreeResp(msg.seq, view))

    def on_cache_digest(self, msg: CacheDigestReq) -> None:
        hashes = cache_digest(self.sched.cache, msg.block, msg.max_blocks, self.digest_memo)
        self.out.send(CacheDigestResp(msg.seq, join(hashes), self.sched.cache.total_size))

    def on_schema(self, msg: SchemaReq) -> None:
        """Register / delete / list prompt-module schemas (400 with the reason). A register
        is answered once the schema is encoded, over the next steps (running requests go on
        meanwhile), or deleted first (400)."""
        try:
            if msg.op == "register":
                assert msg.compiled is not None, "register without a compiled schema"
                self.sched.register_schema(msg.compiled, lambda e: self.schema_done(msg.seq, e))
                return
            if msg.op == "delete":
                self.sched.remove_schema(msg.name)
        except ValueError as e:
            self.schema_done(msg.seq, str(e))
            return
        self.schema_done(msg.seq, None)

    def schema_done(self, seq: int, error: str | None) -> None:
        status = 200 if error is None else 400
        self.out.send(SchemaResp(seq, status, error or "", self.sched.schemas()))

    def on_shutdown(self, msg: Shutdown) -> None:
        self.stopping = True

    def send_outputs(self, outputs: list[TokenDelta]) -> None:
        self.out.send(TokenDeltas(outputs))

    def refuse(self, rid: str, status: int, message: str) -> None:
        self.out.send(RequestError(rid, status, message))


def run_scheduler_process(config: EngineConfig, ipc: IpcPaths, tp_init: str | None = None) -> None:
    """Main of the scheduler process (run under `procutil.child_main`).

    With tp_size > 1 it is TP rank 0: it joins the group at `tp_init` (the follower ranks
    are the launcher's children too), and on a clean exit tells the followers to stop. On a
    crash it sends nothing (a collective may be half done): the followers see the closed
    connection and exit.
    """
    watch = ParentWatch()
    ctx = zmq.Context()
    inbox = Inbox(ctx, ipc.scheduler)
    out = Outbox(ctx, ipc.tokenizer)
    try:
        if config.tp_size > 1:
            assert tp_init is not None, "tp_size > 1 needs the group's init method"
            init_tp(0, config.tp_size, tp_init, config.device)
        parts = load_parts(config)
        sched = Scheduler(config, parts)
        info = sched.model_info
        logger.info(
            "scheduler ready: model %s, dtype %s, KV capacity %d tokens, backend %s",
            info.model_path,
            info.dtype,
            info.kv_capacity_tokens,
            info.attention_backend,
        )
        # Start-up objects (model, torch, imports: ~200k) out of the collector's reach: a
        # full collection then walks only what serving made (a 10k-node radix tree: ~6 ms,
        # not the ~200 ms pause that stalled a step or a /cache_tree call).
        gc.freeze()
        out.send(SchedulerReady(info))
        SchedulerProcess(sched, inbox, out, watch).run()
        parts.worker.close()
    finally:
        inbox.close()
        out.close()
        ctx.term()
