"""Every message that crosses a process boundary, as msgspec Structs (the ONE vocabulary).

Processes and who sends what (each process owns one PULL inbox; see `ipc.py`):

    api server ──GenerateReq/AbortReq/ControlReq/Shutdown──> tokenizer
    tokenizer  ──ScheduleReq/AbortReq/ControlReq/Shutdown─> scheduler
    scheduler  ──SchedulerReady, TokenDeltas, RequestError, ControlResp──> tokenizer
    tokenizer  ──TokenizerReady, TextDeltas, RequestError, ControlResp──> api server

Rules:
- Only plain data crosses: str/int/float/bool/None, lists, dicts of those, and the plain
  dataclasses of `radixserve.core` (msgspec encodes them natively as objects and, on decode,
  checks each field's type and runs their `__post_init__`: a `SamplingParams` re-checks
  itself, which an instance that was valid when sent always passes).
  No pickle anywhere (a socket is an attack surface even when local).
- `rid` identifies a request end to end: past the api server it is the request's key
  `"{tenant}/{client rid}"` (`server.manager.request_key`), unique while it is in flight;
  the `n` samples of one request share it and are told apart by `index`.
- Control requests carry a `seq` chosen by the api server; the response echoes it.
- Structs are `array_like` (compact: field order is the wire format) and tagged by class
  name, so one decoder recognises every message.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.core.info import CacheTreeView, ModelInfo, SchedulerStats
from radixserve.core.modules import CompiledSchema
from radixserve.core.params import SamplingParams
from radixserve.core.request import SHARED, CacheSalt, TextDelta, TokenDelta, TokenizedRequest


class Message(msgspec.Struct, tag=True, array_like=True):
    """Base of every IPC message."""


# ---------------------------------------------------------------- start-up and shutdown


class SchedulerReady(Message):
    """Scheduler -> tokenizer: model loaded, KV pool sized; the tokenizer loads next."""

    model_info: ModelInfo


class TokenizerReady(Message):
    """Tokenizer -> api server: the whole pipeline is ready to serve."""

    model_info: ModelInfo


class Shutdown(Message):
    """Api server -> tokenizer -> scheduler: finish the loop and exit(0)."""


# ---------------------------------------------------------------- requests


class GenerateReq(Message):
    """Api server -> tokenizer: one prompt (exactly one of text / input_ids / messages /
    pml, a PML prompt importing modules; `module_reuse` False prefills its expanded text).

    `sampling` was parsed (and checked) once, by the api server; later processes only add
    what they alone know. `max_new_tokens_auto`: the client gave no limit, so the tokenizer
    sets max_new_tokens to what is left of the context. `salt`: the part of the prefix cache
    it shares (its tenant's under --cache-isolation tenant, and its own cache_salt).
    """

    rid: str
    sampling: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: OpenAI-style role/content dicts
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    max_new_tokens_auto: bool = False
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI tool definitions to render
    template_kwargs: dict[str, Any] | None = None  # chat: the template's extra variables
    pml: str | None = None
    module_reuse: bool = True
    salt: CacheSalt = SHARED


class ScheduleReq(Message):
    """Tokenizer -> scheduler: the request as the scheduler takes it."""

    request: TokenizedRequest


class AbortReq(Message):
    """Api server -> tokenizer -> scheduler: stop `rid` (all its samples) and free its KV.

    Unknown or finished rids are ignored. A running request answers with a final output
    whose finish_reason is "abort".
    """

    rid: str


class RequestError(Message):
    """Scheduler or tokenizer -> api server: `rid` was refused and holds no resources.

    `status` is the HTTP status to return (400 bad request, 503 queue full).
    """

    rid: str
    status: int
    message: str


# ---------------------------------------------------------------- outputs


class TokenDeltas(Message):
    """Scheduler -> tokenizer: one step's deltas (token ids, logprobs)."""

    outputs: list[TokenDelta]


class TextDeltas(Message):
    """Tokenizer -> api server: those deltas with their text (`tokenizer.accumulate`)."""

    chunks: list[TextDelta]


# ---------------------------------------------------------------- control


class FlushCacheReq(Message):
    seq: int


class ServerInfoReq(Message):
    seq: int


class FlushCacheResp(Message):
    seq: int
    ok: bool  # False while requests are running or queued


class ServerInfoResp(Message):
    seq: int
    stats: SchedulerStats
    active_requests: int  # requests the scheduler process has accepted and not finished
    tokenizer_requests: int = 0  # requests the tokenizer tracks (it fills this in on the way)


class CacheTreeReq(Message):
    """`tenant`: only the parts of that tenant's salts (kvcache/tree_view.py); None: all."""

    seq: int
    max_nodes: int
    max_depth: int
    tenant: str | None = None


class CacheTreeResp(Message):
    seq: int
    view: CacheTreeView  # the tokenizer fills in each node's text on the way


class CacheDigestReq(Message):
    """The shared part of the prefix cache as block hashes (kvcache/digest.py)."""

    seq: int
    block: int
    max_blocks: int


class CacheDigestResp(Message):
    seq: int
    hashes: bytes  # core/digest.py `join`: HASH_BYTES a block, shallow blocks first
    cached_tokens: int  # every part's cached tokens


class SchemaReq(Message):
    """Prompt-module schemas: op "register" (`pml`; the tokenizer lays it out into
    `compiled`), "delete" (`name`) or "list"."""

    seq: int
    op: str
    pml: str = ""
    name: str = ""
    compiled: CompiledSchema | None = None


class SchemaResp(Message):
    """`status` 200, or 400 with `message`; `schemas`: every registered schema after the
    op, as {"name", "modules": {name: tokens}, "positions"}."""

    seq: int
    status: int
    message: str = ""
    schemas: list[dict[str, Any]] = msgspec.field(default_factory=list)


ControlReq = FlushCacheReq | ServerInfoReq | CacheTreeReq | CacheDigestReq | SchemaReq
ControlResp = FlushCacheResp | ServerInfoResp | CacheTreeResp | CacheDigestResp | SchemaResp

AnyMessage = (
    SchedulerReady
    | TokenizerReady
    | Shutdown
    | GenerateReq
    | ScheduleReq
    | AbortReq
    | RequestError
    | TokenDeltas
    | TextDeltas
    | FlushCacheReq
    | ServerInfoReq
    | FlushCacheResp
    | ServerInfoResp
    | CacheTreeReq
    | CacheTreeResp
    | CacheDigestReq
    | CacheDigestResp
    | SchemaReq
    | SchemaResp
)
