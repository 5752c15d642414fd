"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Choices are numbered prompt-major (`index = prompt * n + sample`). Usage counts each
prompt once and every sample's completion tokens. Streams send one chunk per output delta
that carries text (or finishes a choice), then, with `stream_options.include_usage`, a
last chunk with `choices: []` and the usage, then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixserve.core.request import TextLogprob
from radixserve.core.result import SampleResult
from radixserve.server import openapi
from radixserve.server.flow import sse, start_stream, submit_all, unless_disconnected
from radixserve.server.manager import Pending, RequestManager
from radixserve.server.openai_protocol import OpenAIBatch, parse_chat, parse_completion
from radixserve.server.protocol import ApiError, read_json

router = APIRouter()

# Renders one choice: (result, choice index, logprob entries new in this chunk) -> dict.
ChoiceFn = Callable[[SampleResult, int, list[TextLogprob], list[list[TextLogprob]]], dict]


def _served_name(request: Request) -> str:
    info = request.app.state.manager.model_info
    return info.served_model_name if info else "unknown"


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    info = request.app.state.manager.model_info
    card = {
        "id": _served_name(request),
        "object": "model",
        "created": int(request.app.state.started),
        "owned_by": "radixserve",
        "root": info.model_path if info else None,
        "max_model_len": info.context_len if info else None,
    }
    return JSONResponse({"object": "list", "data": [card]})


# ---------------------------------------------------------------- choice rendering


def _finish(r: SampleResult) -> str | None:
    return r.finish_reason.type if r.finish_reason else None


def _completion_logprobs(
    entries: list[TextLogprob], tops: list[list[TextLogprob]], offset: int
) -> dict[str, Any]:
    texts = [t or "" for _, _, t in entries]
    offsets, at = [], offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {
        "tokens": texts,
        "token_logprobs": [lp for lp, _, _ in entries],
        "top_logprobs": [{t or "": lp for lp, _, t in top} for top in tops] if tops else None,
        "text_offset": offsets,
    }


def _chat_logprobs(entries: list[TextLogprob], tops: list[list[TextLogprob]]) -> dict[str, Any]:
    def item(lp: float | None, t: str | None) -> dict[str, Any]:
        text = t or ""
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for k, (lp, _, t) in enumerate(entries):
        top = tops[k] if k < len(tops) else []
        content.append({**item(lp, t), "top_logprobs": [item(tlp, tt) for tlp, _, tt in top]})
    return {"content": content}


def _usage(pendings_results: list[list[SampleResult]]) -> dict[str, int]:
    prompt = sum(rs[0].prompt_tokens for rs in pendings_results if rs)
    completion = sum(r.completion_tokens for rs in pendings_results for r in rs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


# ---------------------------------------------------------------- shared driver


async def _run(
    request: Request,
    batch: OpenAIBatch,
    kind: str,
    choice: ChoiceFn,
    chunk_choice: Callable[[SampleResult, int, str, list, list, bool], dict],
) -> Response:
    manager: RequestManager = request.app.state.manager
    pendings = submit_all(manager, batch.reqs)
    head = {
        "id": batch.reqs[0].rid,
        "object": kind,
        "created": int(time.time()),
        "model": batch.model or _served_name(request),
    }
    results = [[SampleResult(p.rid, i) for i in range(p.n)] for p in pendings]
    try:
        if batch.stream:
            body = _stream_body(manager, pendings, results, batch, head, chunk_choice)
            return await start_stream(request, manager, pendings, body)
        work = _collect(manager, pendings, results)
        done = await unless_disconnected(request, manager, pendings, work)
    except ApiError as e:  # refusals from the pipeline use SGLang's field names
        e.message = e.message.replace("max_new_tokens", "max_tokens")
        raise
    if isinstance(done, Response):
        return done
    choices = [
        choice(r, k * p.n + r.index, r.output_logprobs, r.output_top_logprobs)
        for k, (p, rs) in enumerate(zip(pendings, results))
        for r in rs
    ]
    return JSONResponse({**head, "choices": choices, "usage": _usage(results)})


async def _collect(
    manager: RequestManager, pendings: list[Pending], results: list[list[SampleResult]]
) -> None:
    async for k, d in manager.merged(pendings):
        results[k][d.index].apply(d)


def _stream_body(
    manager: RequestManager,
    pendings: list[Pending],
    results: list[list[SampleResult]],
    batch: OpenAIBatch,
    head: dict[str, Any],
    chunk_choice: Callable[[SampleResult, int, str, list, list, bool], dict],
) -> Callable[[], AsyncIterator[str]]:
    chunk_head = {**head, "object": head["object"] + ".chunk"} if "chat" in head["object"] else head
    usage_null = {"usage": None} if batch.include_usage else {}

    async def body() -> AsyncIterator[str]:
        started: set[tuple[int, int]] = set()
        async for k, d in manager.merged(pendings):
            r = results[k][d.index]
            first = (k, d.index) not in started
            started.add((k, d.index))
            r.apply(d)
            if not d.text and d.finish_reason is None and not first:
                continue
            c = chunk_choice(
                r,
                k * pendings[k].n + d.index,
                d.text,
                d.output_logprobs,
                d.output_top_logprobs,
                first,
            )
            yield sse({**chunk_head, "choices": [c], **usage_null})
        if batch.include_usage:
            yield sse({**chunk_head, "choices": [], "usage": _usage(results)})

    return body


# ---------------------------------------------------------------- routes


@router.post("/v1/completions", openapi_extra=openapi.body(openapi.COMPLETION))
async def completions(request: Request) -> Response:
    batch = parse_completion(await read_json(request))

    def choice(r: SampleResult, index: int, lps: list, tops: list) -> dict:
        logprobs = _completion_logprobs(lps, tops, 0) if batch.logprobs else None
        return {"index": index, "text": r.text, "logprobs": logprobs, "finish_reason": _finish(r)}

    def chunk(r: SampleResult, index: int, text: str, lps: list, tops: list, first: bool) -> dict:
        offset = len(r.text) - len(text)
        logprobs = _completion_logprobs(lps, tops, offset) if batch.logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish(r)}

    return await _run(request, batch, "text_completion", choice, chunk)


@router.post("/v1/chat/completions", openapi_extra=openapi.body(openapi.CHAT))
async def chat_completions(request: Request) -> Response:
    batch = parse_chat(await read_json(request))

    def choice(r: SampleResult, index: int, lps: list, tops: list) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": r.text},
            "logprobs": _chat_logprobs(lps, tops) if batch.logprobs else None,
            "finish_reason": _finish(r),
        }

    def chunk(r: SampleResult, index: int, text: str, lps: list, tops: list, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {
            "index": index,
            "delta": delta,
            "logprobs": _chat_logprobs(lps, tops) if batch.logprobs else None,
            "finish_reason": _finish(r),
        }

    return await _run(request, batch, "chat.completion", choice, chunk)
