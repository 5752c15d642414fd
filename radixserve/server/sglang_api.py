"""SGLang-native routes: /generate, /health, /health_generate, /get_model_info,
/get_server_info, /flush_cache, /abort_request. Field-compatible with SGLang's
`GenerateReqInput` so its RuntimeEndpoint and bench clients work unchanged."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixserve.config import SECRET_FIELDS, EngineConfig
from radixserve.core.limits import MAX_PROMPTS, MAX_TOP_LOGPROBS
from radixserve.core.params import SamplingParams
from radixserve.core.request import CacheSalt
from radixserve.core.result import SampleResult, native_result
from radixserve.message.messages import (
    FlushCacheReq,
    FlushCacheResp,
    GenerateReq,
    ServerInfoReq,
    ServerInfoResp,
)
from radixserve.redact import redact_values
from radixserve.server import openapi
from radixserve.server.flow import (
    abort_all,
    sse,
    start_stream,
    submit_all,
    unless_disconnected,
)
from radixserve.server.guard import require_admin, stops
from radixserve.server.manager import Pending, RequestManager
from radixserve.server.protocol import ApiError, bad, check_fields, get, get_int, read_json

router = APIRouter()

GENERATE_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "stream",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "pml",
        "module_reuse",
        "cache_salt",  # vLLM's: requests share cached K/V only with the same salt
    }
)
HEALTH_GENERATE_TIMEOUT_S = 60.0


@dataclass
class NativeBatch:
    reqs: list[GenerateReq]
    single: bool  # one prompt and n == 1: the response is a dict, not a list
    stream: bool


def _manager(request: Request) -> RequestManager:
    return request.app.state.manager


# ---------------------------------------------------------------- parsing


def _prompts(body: dict[str, Any]) -> tuple[str, list[Any], bool]:
    """('text' | 'input_ids' | 'pml', one entry per prompt, whether a single prompt was
    given)."""
    given = [k for k in ("text", "input_ids", "pml") if body.get(k) is not None]
    prompts: list[Any]
    if len(given) != 1:
        raise bad("give exactly one of text, input_ids or pml", "text")
    if given[0] != "input_ids":
        key = given[0]
        if isinstance(body[key], str):
            prompts, single = [body[key]], True
        else:
            prompts, single = get(body, key, "str_list"), False
        if any(t == "" for t in prompts):
            raise bad(f"{key} must not be empty", key)
        return key, prompts, single
    ids = body["input_ids"]
    if isinstance(ids, list) and ids and all(isinstance(x, list) for x in ids):
        prompts, single = ids, False
    else:
        prompts, single = [ids], True
    for p in prompts:
        get({"input_ids": p}, "input_ids", "int_list")
        if not p:
            raise bad("input_ids must not be empty", "input_ids")
    return "input_ids", prompts, single


def _per_prompt(body: dict[str, Any], name: str, kind: str, default: Any, count: int) -> list[Any]:
    """A field given once for all prompts, or as a list with one entry per prompt."""
    value = body.get(name)
    if isinstance(value, list):
        if len(value) != count:
            raise bad(f"{name} has {len(value)} entries for {count} prompts", name)
        return [get({name: v}, name, kind, default) for v in value]
    return [get(body, name, kind, default)] * count


def _sampling(body: dict[str, Any], count: int) -> list[SamplingParams]:
    """The parameters of each prompt, parsed once here (400 naming the field)."""
    value = body.get("sampling_params")
    values = value if isinstance(value, list) else [value] * count
    if len(values) != count:
        raise bad(
            f"sampling_params has {len(values)} entries for {count} prompts", "sampling_params"
        )
    out = []
    for v in values:
        v = {} if v is None else v
        if not isinstance(v, dict):
            raise bad("sampling_params must be an object (or a list of them)", "sampling_params")
        try:
            out.append(SamplingParams.from_dict(v))
        except ValueError as e:
            raise bad(f"sampling_params: {e}", "sampling_params") from e
    return out


def parse_generate(body: dict[str, Any]) -> NativeBatch:
    """Validate a /generate body; ApiError(400) names the first bad field."""
    check_fields(body, GENERATE_FIELDS)
    key, prompts, single = _prompts(body)
    count = len(prompts)
    if count > MAX_PROMPTS:
        raise bad(f"{key} has {count} prompts, at most {MAX_PROMPTS} per request", key)
    sampling = _sampling(body, count)
    rids = _per_prompt(body, "rid", "rid", None, count)
    if len(set(r for r in rids if r is not None)) < sum(r is not None for r in rids):
        raise bad("rid values must be distinct", "rid")
    want_lp = _per_prompt(body, "return_logprob", "bool", False, count)
    start = _per_prompt(body, "logprob_start_len", "int", -1, count)
    top = _per_prompt(body, "top_logprobs_num", "int", 0, count)
    for s, k in zip(start, top):
        get_int({"logprob_start_len": s}, "logprob_start_len", -1, -1, None)
        get_int({"top_logprobs_num": k}, "top_logprobs_num", 0, 0, MAX_TOP_LOGPROBS)
    texts = get(body, "return_text_in_logprobs", "bool", False)
    module_reuse = get(body, "module_reuse", "bool", True)
    stream = get(body, "stream", "bool", False)
    salt = CacheSalt(salt=get(body, "cache_salt", "cache_salt", ""))  # the tenant's: at submit
    reqs = [
        GenerateReq(
            rid=rids[i] or uuid.uuid4().hex,
            sampling=sampling[i],
            return_logprob=want_lp[i],
            logprob_start_len=start[i] if want_lp[i] else -1,
            top_logprobs_num=top[i] if want_lp[i] else 0,
            return_text_in_logprobs=texts,
            stream=stream,
            module_reuse=module_reuse,
            salt=salt,
            **{key: prompts[i]},
        )
        for i in range(count)
    ]
    return NativeBatch(reqs, single and reqs[0].sampling.n == 1, stream)


# ---------------------------------------------------------------- /generate


@router.post("/generate", openapi_extra=openapi.body(openapi.GENERATE))
async def generate(request: Request) -> Response:
    batch = parse_generate(await read_json(request))
    manager = _manager(request)
    pendings = submit_all(manager, batch.reqs, request)
    if batch.stream:
        return await _stream(request, manager, batch, pendings)
    results = await unless_disconnected(request, manager, pendings, _collect(manager, pendings))
    if isinstance(results, Response):
        return results
    out = [
        native_result(r, p.created, req.return_logprob)
        for req, p, rs in zip(batch.reqs, pendings, results)
        for r in rs
    ]
    return JSONResponse(out[0] if batch.single else out)


async def _collect(manager: RequestManager, pendings: list[Pending]) -> list[list[SampleResult]]:
    results = [[SampleResult(p.rid, i) for i in range(p.n)] for p in pendings]
    async for k, d in manager.merged(pendings):
        results[k][d.index].apply(d)
    return results


async def _stream(
    request: Request, manager: RequestManager, batch: NativeBatch, pendings: list[Pending]
) -> Response:
    async def body() -> AsyncIterator[str]:
        results = [[SampleResult(p.rid, i) for i in range(p.n)] for p in pendings]
        offsets = [sum(p.n for p in pendings[:k]) for k in range(len(pendings))]
        async for k, d in manager.merged(pendings):
            r = results[k][d.index]
            r.apply(d)
            index = None if batch.single else offsets[k] + d.index
            want_lp = batch.reqs[k].return_logprob
            yield sse(native_result(r, pendings[k].created, want_lp, index, chunk=d))

    return await start_stream(request, manager, pendings, body)


# ---------------------------------------------------------------- management routes


@router.get("/health")
async def health(request: Request) -> Response:
    failure = _manager(request).check_children()
    if failure is not None:
        return JSONResponse({"status": "failed", "error": failure}, status_code=503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Healthy only if a one-token generation goes through the whole pipeline."""
    manager = _manager(request)
    req = GenerateReq(
        rid=f"health-{uuid.uuid4().hex}",
        sampling=SamplingParams(max_new_tokens=1, temperature=0),
        input_ids=[0],
    )
    pendings = submit_all(manager, [req], request)
    try:
        await asyncio.wait_for(_collect(manager, pendings), HEALTH_GENERATE_TIMEOUT_S)
    except (ApiError, asyncio.TimeoutError) as e:
        abort_all(manager, pendings)
        return JSONResponse({"status": "unhealthy", "error": str(e)}, status_code=503)
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    info = _manager(request).model_info
    assert info is not None, "routes are served only after the ready handshake"
    return JSONResponse(
        {
            "model_path": info.model_path,
            "tokenizer_path": info.tokenizer_path,
            "is_generation": True,
        }
    )


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    """Server arguments, model info, a fresh scheduler snapshot (KV use included) and the
    requests each process tracks (api_pending_requests, tokenizer_requests,
    scheduler.active_requests): all 0 and scheduler.kv_held_tokens 0 when idle."""
    manager = _manager(request)
    resp = await manager.call(ServerInfoReq)
    assert isinstance(resp, ServerInfoResp)
    config: EngineConfig = request.app.state.config
    args = redact_values(
        {k: v for k, v in dataclasses.asdict(config).items() if k not in SECRET_FIELDS}
    )
    stats = resp.stats
    scheduler = {
        **dataclasses.asdict(stats),
        "kv_free_tokens": stats.kv_capacity_tokens - stats.kv_used_tokens,
        "kv_usage": stats.kv_usage,
        "cache_hit_rate": stats.cache_hit_rate,
        "active_requests": resp.active_requests,
    }
    info = dataclasses.asdict(manager.model_info) if manager.model_info else None
    return JSONResponse(
        {
            **args,
            "model_info": info,
            "scheduler": scheduler,
            "api_pending_requests": len(manager.pending),
            "tokenizer_requests": resp.tokenizer_requests,
        }
    )


@router.post("/flush_cache")
async def flush_cache(request: Request) -> Response:
    """Empty the radix cache (POST only: a state change a page could not trigger with a
    link). 400 while requests are running or queued (nothing is done)."""
    check_fields(await read_json(request), {"empty_cache"})  # SGLang clients send it
    resp = await _manager(request).call(FlushCacheReq)
    assert isinstance(resp, FlushCacheResp)
    if not resp.ok:
        raise ApiError(400, "cache not flushed: requests are running or queued; retry when idle")
    return JSONResponse({"success": True, "message": "Cache flushed."})


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """Stop the caller's request `rid` (the admin key: that rid of every tenant), or with
    `abort_all` (admin key) every request. 200 whether or not such a request is in flight:
    a tenant's abort of a rid only another tenant has in flight is an unknown rid to it."""
    body = await read_json(request)
    check_fields(body, {"rid", "abort_all"})
    manager = _manager(request)
    if get(body, "abort_all", "bool", False):
        require_admin(request, "abort_all")
        abort_all(manager, list(manager.pending.values()))
        return JSONResponse({"success": True})
    rid = get(body, "rid", "str")
    if rid is None:
        raise bad("rid is required (or abort_all: true)", "rid")
    manager.abort(rid, stops(request))
    return JSONResponse({"success": True})
