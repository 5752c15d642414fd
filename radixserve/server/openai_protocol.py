"""OpenAI request bodies -> our GenerateReqs (strict: unknown fields and bad values are 400s
that name the field as the client spelled it, e.g. `max_tokens`, not `max_new_tokens`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from radixserve.core.limits import MAX_MESSAGES, MAX_PROMPTS, MAX_TOP_LOGPROBS
from radixserve.core.params import SamplingParams
from radixserve.message.messages import GenerateReq
from radixserve.server.protocol import bad, check_fields, get, get_int

# OpenAI name -> SamplingParams name, for fields passed straight through.
SAMPLING_FIELDS = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "n": "n",
    "stop": "stop",
    "seed": "seed",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    # SGLang / vLLM extensions of the OpenAI API
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
}
COMMON_FIELDS = frozenset(SAMPLING_FIELDS) | {"model", "stream", "stream_options", "user", "rid"}
COMPLETION_FIELDS = COMMON_FIELDS | {
    "prompt",
    "logprobs",
    "echo",
    "best_of",
    "logit_bias",
    "suffix",
}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "logit_bias",
}
CHAT_ROLES = ("system", "developer", "user", "assistant")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass
class OpenAIBatch:
    reqs: list[GenerateReq]  # choice index = prompt * n + sample
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: bool


def _sampling(body: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    """The request's parameters, parsed once here; 400 naming the field as the client did."""
    sampling = dict(defaults)
    for ours_name, theirs in SAMPLING_FIELDS.items():
        if body.get(ours_name) is not None:
            sampling[theirs] = body[ours_name]
    try:
        return SamplingParams.from_dict(sampling)
    except ValueError as e:
        # Speak the client's language: SamplingParams names fields the SGLang way.
        msg = str(e).replace("max_new_tokens", "max_tokens").replace("min_new_tokens", "min_tokens")
        param = next((k for k in SAMPLING_FIELDS if msg.startswith(k + " ")), None)
        raise bad(msg, param) from e


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = get(body, "stream", "bool", False)
    options = get(body, "stream_options", "dict", {})
    check_fields(options, {"include_usage", "continuous_usage_stats"})
    include_usage = get(options, "include_usage", "bool", False)
    return stream, include_usage


def _unsupported_if_set(body: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        if body.get(name) not in (None, False, "", [], {}):
            raise bad(f"{name} is not supported by this server", name)


def _prompts(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """[('text' | 'input_ids', prompt)] for each prompt of a completions request."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        items = [("text", prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        items = [("text", p) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        items = [("input_ids", get({"prompt": p}, "prompt", "int_list")) for p in prompt]
    elif isinstance(prompt, list) and prompt:
        items = [("input_ids", get(body, "prompt", "int_list"))]
    else:
        raise bad(
            "prompt must be a non-empty string, list of strings or list of token ids", "prompt"
        )
    if any(not p for _, p in items):
        raise bad("prompt must not be empty", "prompt")
    return items


def parse_completion(body: dict[str, Any]) -> OpenAIBatch:
    check_fields(body, COMPLETION_FIELDS)
    _unsupported_if_set(body, ("echo", "logit_bias", "suffix"))
    model = get(body, "model", "str")
    get(body, "user", "str")
    sampling = _sampling(body, {"max_new_tokens": COMPLETIONS_DEFAULT_MAX_TOKENS})
    n = sampling.n
    best_of = get(body, "best_of", "int", n)
    if best_of != n:
        raise bad(f"best_of must equal n ({n}); other values are not supported", "best_of")
    top = body.get("logprobs")
    top = None if top is None else get_int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
    stream, include_usage = _stream_flags(body)
    base_rid = get(body, "rid", "rid") or f"cmpl-{uuid.uuid4().hex}"
    prompts = _prompts(body)
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"prompt has {len(prompts)} prompts, at most {MAX_PROMPTS} per request", "prompt")
    reqs = [
        GenerateReq(
            rid=base_rid if len(prompts) == 1 else f"{base_rid}-{i}",
            sampling=sampling,
            return_logprob=top is not None,
            top_logprobs_num=top or 0,
            return_text_in_logprobs=top is not None,
            stream=stream,
            **{key: prompt},
        )
        for i, (key, prompt) in enumerate(prompts)
    ]
    return OpenAIBatch(reqs, model, stream, include_usage, top is not None)


def _message(m: Any, i: int) -> dict[str, str]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object with role and content", "messages")
    check_fields(m, {"role", "content", "name"})
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise bad(f"{where}.role must be one of {list(CHAT_ROLES)}, got {role!r}", "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"{where}.content: only text parts are supported", "messages")
            texts.append(get(part, "text", "str", ""))
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad(f"{where}.content must be a string or a list of text parts", "messages")
    return {"role": "system" if role == "developer" else role, "content": content}


def _response_format(body: dict[str, Any]) -> None:
    fmt = get(body, "response_format", "dict")
    if fmt is not None and fmt.get("type") != "text":
        raise bad("response_format: only {'type': 'text'} is supported", "response_format")


def parse_chat(body: dict[str, Any]) -> OpenAIBatch:
    check_fields(body, CHAT_FIELDS)
    _unsupported_if_set(body, ("tools", "logit_bias"))
    _response_format(body)
    model = get(body, "model", "str")
    get(body, "user", "str")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    if len(raw) > MAX_MESSAGES:
        raise bad(
            f"messages has {len(raw)} entries, at most {MAX_MESSAGES} are allowed", "messages"
        )
    messages = [_message(m, i) for i, m in enumerate(raw)]
    limit = get(body, "max_completion_tokens", "int")
    if limit is not None and body.get("max_tokens") is None:
        body = {**body, "max_tokens": limit}
    sampling = _sampling(body, {})
    auto_limit = body.get("max_tokens") is None  # the tokenizer fills in the room left
    logprobs = get(body, "logprobs", "bool", False)
    top = get_int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad("top_logprobs requires logprobs: true", "top_logprobs")
    stream, include_usage = _stream_flags(body)
    req = GenerateReq(
        rid=get(body, "rid", "rid") or f"chatcmpl-{uuid.uuid4().hex}",
        sampling=sampling,
        messages=messages,
        return_logprob=logprobs,
        top_logprobs_num=top,
        return_text_in_logprobs=logprobs,
        stream=stream,
        max_new_tokens_auto=auto_limit,
    )
    return OpenAIBatch([req], model, stream, include_usage, logprobs)
