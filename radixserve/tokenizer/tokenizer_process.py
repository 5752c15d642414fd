"""The tokenizer process: text <-> token ids between the api server and the scheduler.

Loop: block on the inbox (1 s at a time, to notice a dead launcher) -> dispatch by message
type. Requests flow api -> here -> scheduler; outputs flow scheduler -> here -> api. Per
request it keeps one `SampleAccumulator` (`accumulate.py`: detokenize, token texts) per
sample, created on the sample's first output and dropped when the last of its `n` samples
finishes (or the request is refused).

Start-up handshake: wait for `SchedulerReady` (the scheduler resolved/converted the model,
so the tokenizer path is known), load the tokenizer, send `TokenizerReady` to the api server.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass, field
from typing import Any

import zmq

from radixserve.core.info import ModelInfo
from radixserve.core.request import TextDelta, TokenDelta, TokenizedRequest
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
    GenerateReq,
    RequestError,
    ScheduleReq,
    SchedulerReady,
    SchemaReq,
    SchemaResp,
    ServerInfoReq,
    ServerInfoResp,
    Shutdown,
    TextDeltas,
    TokenDeltas,
    TokenizerReady,
)
from radixserve.models.loader import import_tokenizer_modules, load_tokenizer
from radixserve.procutil import PARENT_POLL_MS, ParentWatch
from radixserve.prompt.layout import Layout
from radixserve.prompt.registry import SchemaRegistry
from radixserve.tokenizer.accumulate import SampleAccumulator
from radixserve.tokenizer.chat import render_chat

logger = logging.getLogger("radixserve.tokenizer")


@dataclass
class _ReqState:
    request: TokenizedRequest
    want_texts: bool  # return_text_in_logprobs
    samples: dict[int, SampleAccumulator] = field(default_factory=dict)
    finished: int = 0
    # Detokenizing failed: the scheduler was told to abort; this error goes to the api
    # server once every sample has ended, so the rid is released after the scheduler's.
    error: str | None = None


class TokenizerWorker:
    """Everything the tokenizer process does, minus the sockets' lifetime."""

    def __init__(self, tokenizer: Any, info: ModelInfo, to_sched: Outbox, to_api: Outbox) -> None:
        self.tok = tokenizer
        self.info = info
        self.to_sched = to_sched
        self.to_api = to_api
        self.reqs: dict[str, _ReqState] = {}
        self.schemas = SchemaRegistry(tokenizer)
        # Schema ops on their way to the scheduler: seq -> what to do here once it agrees.
        self.schema_ops: dict[int, Layout | str] = {}
        self.dispatch = {
            GenerateReq: self.on_generate,
            AbortReq: to_sched.send,
            FlushCacheReq: to_sched.send,
            ServerInfoReq: to_sched.send,
            CacheTreeReq: to_sched.send,
            CacheDigestReq: to_sched.send,
            TokenDeltas: self.on_samples,
            RequestError: self.on_error,
            FlushCacheResp: to_api.send,
            ServerInfoResp: self.on_info,
            CacheTreeResp: self.on_cache_tree,
            CacheDigestResp: to_api.send,
            SchemaReq: self.on_schema,
            SchemaResp: self.on_schema_resp,
        }

    def handle(self, msg: AnyMessage) -> None:
        handler = self.dispatch.get(type(msg))
        assert handler is not None, f"tokenizer process got unexpected {type(msg).__name__}"
        handler(msg)  # type: ignore[operator]

    # ---------------------------------------------------------------- requests

    def on_generate(self, req: GenerateReq) -> None:
        # The api server refuses a rid in flight, and this process lets a rid go only after
        # the scheduler has (its last outputs come through here), so a clash is a bug.
        assert req.rid not in self.reqs, f"rid {req.rid!r} is already in use"
        try:
            request = self._tokenized(req)
        except ValueError as e:
            self.to_api.send(RequestError(req.rid, 400, str(e)))
            return
        except Exception as e:  # a bug on this request's path: it alone fails
            logger.exception("request %s: tokenization failed", req.rid)
            self.to_api.send(RequestError(req.rid, 500, f"tokenization failed: {e!r}"))
            return
        self.reqs[req.rid] = _ReqState(request, req.return_logprob and req.return_text_in_logprobs)
        self.to_sched.send(ScheduleReq(request))

    def _tokenized(self, req: GenerateReq) -> TokenizedRequest:
        """The request with its token ids, and max_new_tokens filled in when the client gave
        none: what only this process knows. ValueError names the bad field."""
        use = None
        if req.messages is not None:
            ids = render_chat(self.tok, req.messages, req.tools, req.template_kwargs)
        elif req.pml is not None:
            ids, use = self.schemas.token_ids(req.pml, req.module_reuse)
        elif req.text is not None:
            ids = list(self.tok.encode(req.text))
        else:
            ids = list(req.input_ids or [])
        if not ids:
            raise ValueError("text: the prompt is empty")
        sampling = req.sampling
        request = TokenizedRequest(
            req.rid,
            ids,
            sampling,
            req.return_logprob,
            req.logprob_start_len,
            req.top_logprobs_num,
            use,
            req.salt,
        )
        if req.max_new_tokens_auto:
            span = request.num_positions
            own = len(ids) - request.module_tokens
            room = min(self.info.context_len - span, self.info.kv_capacity_tokens - own)
            if room < 1:
                raise ValueError(
                    f"messages: the prompt ({span} positions) leaves no room for output "
                    f"(context {self.info.context_len}, KV pool "
                    f"{self.info.kv_capacity_tokens} tokens)"
                )
            # replace checks min_new_tokens
            request.sampling = dataclasses.replace(sampling, max_new_tokens=room)
        return request

    def on_schema(self, req: SchemaReq) -> None:
        """Lay a schema out here (400 at once if it is malformed), then let the scheduler
        encode it; this registry follows the scheduler's answer (`on_schema_resp`)."""
        if req.op == "register":
            try:
                layout = self.schemas.compile(req.pml)
            except ValueError as e:
                self.to_api.send(SchemaResp(req.seq, 400, str(e)))
                return
            except Exception as e:  # a bug on this schema's path: it alone fails
                logger.exception("schema: layout failed")
                self.to_api.send(SchemaResp(req.seq, 500, f"schema layout failed: {e!r}"))
                return
            req.compiled = layout.compiled
            self.schemas.begin(layout)
            self.schema_ops[req.seq] = layout
        elif req.op == "delete":
            self.schema_ops[req.seq] = req.name
        self.to_sched.send(req)

    def on_schema_resp(self, resp: SchemaResp) -> None:
        op = self.schema_ops.pop(resp.seq, None)
        if isinstance(op, Layout):
            (self.schemas.add if resp.status == 200 else self.schemas.cancel)(op)
        elif resp.status == 200 and isinstance(op, str):
            self.schemas.remove(op)
        self.to_api.send(resp)

    def on_info(self, resp: ServerInfoResp) -> None:
        resp.tokenizer_requests = len(self.reqs)
        self.to_api.send(resp)

    def on_cache_tree(self, resp: CacheTreeResp) -> None:
        for node in resp.view.nodes:
            node.text = self.tok.decode(node.preview_ids)
        self.to_api.send(resp)

    def on_error(self, err: RequestError) -> None:
        self.reqs.pop(err.rid, None)
        self.to_api.send(err)

    # ---------------------------------------------------------------- outputs

    def on_samples(self, batch: TokenDeltas) -> None:
        out = []
        for o in batch.outputs:
            state = self.reqs.get(o.rid)
            if state is None:  # refused by the scheduler: never had outputs
                continue
            if state.error is None:
                try:
                    out.append(self._detokenize(state, o))
                except Exception as e:  # this request alone fails
                    logger.exception("request %s: detokenization failed", o.rid)
                    state.error = f"detokenization failed: {e!r}"
                    self.to_sched.send(AbortReq(o.rid))
            if o.finish_reason is not None:
                state.finished += 1
                if state.finished == state.request.sampling.n:
                    self._release(o.rid, state)
        if out:
            self.to_api.send(TextDeltas(out))

    def _release(self, rid: str, state: _ReqState) -> None:
        """Every sample of `rid` ended (the scheduler let it go): forget it here too."""
        del self.reqs[rid]
        if state.error is not None:
            self.to_api.send(RequestError(rid, 500, state.error))

    def _detokenize(self, state: _ReqState, o: TokenDelta) -> TextDelta:
        acc = state.samples.get(o.index)
        if acc is None:
            acc = state.samples[o.index] = SampleAccumulator.for_sample(
                self.tok, state.request, o.index, state.want_texts
            )
        return acc.push(o)


def run_tokenizer_process(ipc: IpcPaths) -> None:
    """Main of the tokenizer process (run under `procutil.child_main`)."""
    watch = ParentWatch()
    ctx = zmq.Context()
    inbox = Inbox(ctx, ipc.tokenizer)
    to_sched, to_api = Outbox(ctx, ipc.scheduler), Outbox(ctx, ipc.api)
    try:
        import_tokenizer_modules()  # while the scheduler loads the model
        ready = _wait_for_scheduler(inbox, watch)
        if ready is None:  # shut down (or orphaned) during start-up: pass it on
            to_sched.send(Shutdown())
            return
        tokenizer = load_tokenizer(ready.model_info.tokenizer_path)
        worker = TokenizerWorker(tokenizer, ready.model_info, to_sched, to_api)
        gc.freeze()  # as in the scheduler process: collections skip the start-up objects
        to_api.send(TokenizerReady(ready.model_info))
        logger.info("tokenizer ready (%s)", ready.model_info.tokenizer_path)
        _serve(inbox, worker, watch)
    finally:
        for s in (inbox, to_sched, to_api):
            s.close()
        ctx.term()


def _wait_for_scheduler(inbox: Inbox, watch: ParentWatch) -> SchedulerReady | None:
    while watch.parent_alive():
        msg = inbox.recv(PARENT_POLL_MS)
        if isinstance(msg, Shutdown):
            return None
        if msg is not None:
            assert isinstance(msg, SchedulerReady), f"expected SchedulerReady, got {msg!r}"
            return msg
    return None


def _serve(inbox: Inbox, worker: TokenizerWorker, watch: ParentWatch) -> None:
    while True:
        msg = inbox.recv(PARENT_POLL_MS)
        if msg is None:
            if not watch.parent_alive():
                logger.warning("launcher is gone: tokenizer process exits")
                return
            continue
        if isinstance(msg, Shutdown):
            worker.to_sched.send(msg)
            return
        worker.handle(msg)
