"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Choices are numbered prompt-major (`index = prompt * n + sample`). Usage counts each
prompt once and every sample's completion tokens. Streams send one chunk per output delta
that carries text (or finishes a choice), then, with `stream_options.include_usage`, a
last chunk with `choices: []` and the usage, then `data: [DONE]`. With `return_token_ids`,
each choice carries its output token ids as `token_ids` (in a stream, those since the
choice's last chunk).
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
from radixserve.server.openai_tools import ToolStream
from radixserve.server.protocol import ApiError, read_json

router = APIRouter()

# Renders one choice: (result, prompt, choice index) -> dict.
ChoiceFn = Callable[[SampleResult, int, int], dict]
# Renders one stream chunk's choice: (result so far, prompt, choice index, the chunk's text and
# logprob entries, whether it is the choice's first chunk) -> dict.
ChunkFn = Callable[[SampleResult, int, int, str, list, list, bool], dict]


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
        "top_logprobs": [None if top is None else {t or "": lp for lp, _, t in top} for top in tops]
        if tops
        else None,
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


def _usage(pendings_results: list[list[SampleResult]]) -> dict[str, Any]:
    """Token counts; `prompt_tokens_details.cached_tokens`: the prompt tokens found in the
    part of the prefix cache the request shares (its salt's)."""
    prompt = sum(rs[0].prompt_tokens for rs in pendings_results if rs)
    cached = sum(rs[0].cached_tokens for rs in pendings_results if rs)
    completion = sum(r.completion_tokens for rs in pendings_results for r in rs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ---------------------------------------------------------------- shared driver


async def _run(
    request: Request,
    batch: OpenAIBatch,
    kind: str,
    choice: ChoiceFn,
    chunk_choice: ChunkFn,
) -> Response:
    manager: RequestManager = request.app.state.manager
    pendings = submit_all(manager, batch.reqs, request)
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
        e.message = batch.rename(e.message)
        raise
    if isinstance(done, Response):
        return done
    choices = [
        choice(r, k, k * p.n + r.index)
        for k, (p, rs) in enumerate(zip(pendings, results))
        for r in rs
    ]
    if batch.token_ids:
        for c, r in zip(choices, (r for rs in results for r in rs)):
            c["token_ids"] = r.output_ids
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
    chunk_choice: ChunkFn,
) -> Callable[[], AsyncIterator[str]]:
    chunk_head = {**head, "object": head["object"] + ".chunk"} if "chat" in head["object"] else head
    usage_null = {"usage": None} if batch.include_usage else {}

    async def body() -> AsyncIterator[str]:
        sent_ids: dict[tuple[int, int], int] = {}  # ids each started choice's chunks carried
        async for k, d in manager.merged(pendings):
            r = results[k][d.index]
            first = (k, d.index) not in sent_ids
            sent = sent_ids.setdefault((k, d.index), 0)
            r.apply(d)
            if not d.text and d.finish_reason is None and not first:
                continue
            c = chunk_choice(
                r,
                k,
                k * pendings[k].n + d.index,
                d.text,
                d.output_logprobs,
                d.output_top_logprobs,
                first,
            )
            if batch.token_ids:
                c["token_ids"] = r.output_ids[sent:]
                sent_ids[(k, d.index)] = len(r.output_ids)
            yield sse({**chunk_head, "choices": [c], **usage_null})
        if batch.include_usage:
            yield sse({**chunk_head, "choices": [], "usage": _usage(results)})

    return body


# ---------------------------------------------------------------- routes


@router.post("/v1/completions", openapi_extra=openapi.body(openapi.COMPLETION))
async def completions(request: Request) -> Response:
    batch = parse_completion(await read_json(request))

    def echoed(r: SampleResult, k: int) -> tuple[str, list, list]:
        """With echo: the prompt's text and its logprob entries (which are asked only with
        logprobs or for a token-id prompt, whose text they carry)."""
        if batch.echo is None:
            return "", [], []
        prompt = batch.echo[k]
        if prompt is None:
            prompt = "".join(t or "" for _, _, t in r.input_logprobs)
        tops = [top or None for top in r.input_top_logprobs] if r.input_top_logprobs else []
        return prompt, r.input_logprobs, tops

    def choice(r: SampleResult, k: int, index: int) -> dict:
        prompt, lps, tops = echoed(r, k)
        logprobs = None
        if batch.logprobs:
            tops = tops + r.output_top_logprobs if r.output_top_logprobs else []
            logprobs = _completion_logprobs(lps + r.output_logprobs, tops, 0)
        text = prompt + r.text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish(r)}

    def chunk(
        r: SampleResult, k: int, index: int, text: str, lps: list, tops: list, first: bool
    ) -> dict:
        prompt, prompt_lps, prompt_tops = echoed(r, k)
        offset = len(prompt) + len(r.text) - len(text)
        if first and batch.echo is not None:
            text, lps, offset = prompt + text, prompt_lps + lps, 0
            tops = prompt_tops + tops if tops else []
        logprobs = _completion_logprobs(lps, tops, offset) if batch.logprobs else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": _finish(r)}

    return await _run(request, batch, "text_completion", choice, chunk)


@router.post("/v1/chat/completions", openapi_extra=openapi.body(openapi.CHAT))
async def chat_completions(request: Request) -> Response:
    batch = parse_chat(await read_json(request))
    tools = batch.tools
    streams: dict[int, ToolStream] = {}  # choice index -> its tool-call stream

    def choice(r: SampleResult, k: int, index: int) -> dict:
        lps, tops = r.output_logprobs, r.output_top_logprobs
        message: dict[str, Any] = {"role": "assistant", "content": r.text}
        finish = _finish(r)
        if tools is not None and finish != "error":
            content, calls = tools.parse(r.text)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(lps, tops) if batch.logprobs else None,
            "finish_reason": finish,
        }

    def chunk(
        r: SampleResult, k: int, index: int, text: str, lps: list, tops: list, first: bool
    ) -> dict:
        delta: dict[str, Any] = {"content": text}
        finish = _finish(r)
        if tools is not None:
            stream = streams.setdefault(index, ToolStream(tools))
            delta = stream.feed(text) if text else {}
            if finish is not None:
                last = stream.finish()
                delta = {
                    **delta,
                    **last,
                    "content": delta.get("content", "") + last.get("content", ""),
                }
                if not delta["content"]:
                    del delta["content"]
                finish = "tool_calls" if stream.calls and finish == "stop" else finish
        return {
            "index": index,
            "delta": {"role": "assistant", **delta} if first else delta,
            "logprobs": _chat_logprobs(lps, tops) if batch.logprobs else None,
            "finish_reason": finish,
        }

    return await _run(request, batch, "chat.completion", choice, chunk)
