"""OpenAI request bodies -> our GenerateReqs (strict: unknown fields and bad values are 400s
that name the field as the client spelled it, e.g. `max_tokens`, not `max_new_tokens`)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.limits import (
    MAX_MESSAGES,
    MAX_PROMPTS,
    MAX_TEMPLATE_KWARGS,
    MAX_TEMPLATE_VALUE_CHARS,
    MAX_TOP_LOGPROBS,
)
from radixserve.core.params import CONSTRAINT_FIELDS, SamplingParams
from radixserve.core.request import CacheSalt
from radixserve.message.messages import GenerateReq
from radixserve.server.openai_tools import Tools, parse_tools
from radixserve.server.protocol import ApiError, bad, check_fields, get, get_int

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
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf": "ebnf",
    "logit_bias": "logit_bias",
}
COMMON_FIELDS = frozenset(SAMPLING_FIELDS) | {
    "model",
    "stream",
    "stream_options",
    "user",
    "rid",
    "cache_salt",  # vLLM's: requests share cached K/V only with the same salt
    "return_token_ids",  # vLLM's: each choice (each stream chunk's) carries its token ids
}
COMPLETION_FIELDS = COMMON_FIELDS | {
    "prompt",
    "logprobs",
    "echo",
    "best_of",
    "suffix",
    "response_format",
}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages",
    "pml",  # instead of messages: a PML <prompt> importing a registered schema's modules
    "module_reuse",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "response_format",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "chat_template_kwargs",  # vLLM / SGLang: extra variables of the chat template
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass
class OpenAIBatch:
    reqs: list[GenerateReq]  # choice index = prompt * n + sample
    model: str | None
    stream: bool
    include_usage: bool
    logprobs: bool
    # our field name -> the client's, for errors found later in the pipeline (a schema that
    # does not compile: `json_schema` came from `response_format`)
    renames: dict[str, str] = field(default_factory=dict)
    echo: list[str | None] | None = None  # completions with echo: each prompt's text (None:
    # token ids, whose text comes from the prompt logprobs)
    tools: Tools | None = None  # chat with tools and a tool_choice other than none
    token_ids: bool = False  # return_token_ids

    def rename(self, message: str) -> str:
        """`message` with our field names spelled the client's way."""
        for ours, theirs in {**self.renames, **_RENAMES}.items():
            message = message.replace(ours, theirs)
        return message


_RENAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def _sampling(
    body: dict[str, Any], defaults: dict[str, Any], renames: dict[str, str]
) -> SamplingParams:
    """The request's parameters, parsed once here; 400 naming the field as the client did
    (`renames`: fields the route filled in from others, e.g. json_schema <- response_format)."""
    sampling = dict(defaults)
    for ours_name, theirs in SAMPLING_FIELDS.items():
        if body.get(ours_name) is not None:
            sampling[theirs] = body[ours_name]
    try:
        return SamplingParams.from_dict(sampling)
    except ValueError as e:
        # Speak the client's language: SamplingParams names fields the SGLang way.
        msg = str(e)
        for ours, theirs in {**renames, **_RENAMES}.items():
            msg = msg.replace(ours, theirs)
        param = next((k for k in body if re.match(rf"{re.escape(k)}\b", msg)), None)
        raise bad(msg, param) from e


def _response_format(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """`response_format` as the SGLang constraint it asks for: ({"json_schema": text} or {},
    renames for later errors). json_object is any JSON object; json_schema's `strict` is
    accepted either way: the schema is always enforced."""
    fmt = get(body, "response_format", "dict")
    if fmt is None:
        return {}, {}
    kind = fmt.get("type")
    if kind == "text":
        check_fields(fmt, {"type"})
        return {}, {}
    if kind == "json_object":
        check_fields(fmt, {"type"})
        return {"json_schema": '{"type": "object"}'}, {"json_schema": "response_format"}
    if kind != "json_schema":
        raise bad(
            "response_format.type must be one of 'text', 'json_object', 'json_schema', "
            f"got {kind!r}",
            "response_format",
        )
    check_fields(fmt, {"type", "json_schema"})
    spec = get(fmt, "json_schema", "dict")
    where = "response_format.json_schema"
    if spec is None:
        raise bad(f"{where} is required with type 'json_schema'", "response_format")
    check_fields(spec, {"name", "schema", "strict", "description"})
    for name, kind_ in (("name", "str"), ("description", "str"), ("strict", "bool")):
        _get_in(spec, name, kind_, f"{where}.{name}")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, (dict, bool)):
        raise bad(f"{where}.schema must be a JSON schema object", "response_format")
    return {"json_schema": json.dumps(schema)}, {"json_schema": f"{where}.schema"}


def _get_in(obj: dict[str, Any], name: str, kind: str, where: str) -> Any:
    """`get` for a nested field: the error names its whole path."""
    try:
        return get(obj, name, kind)
    except ApiError as e:
        raise bad(e.message.replace(name, where, 1), where.split(".")[0].split("[")[0]) from e


def _constraints(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The SGLang constraint fields the request set through response_format, refusing two."""
    extra, renames = _response_format(body)
    for name in CONSTRAINT_FIELDS:
        if extra and body.get(name) is not None:
            raise bad(f"response_format and {name} are exclusive: set one of them", name)
    return extra, renames


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
    _unsupported_if_set(body, ("suffix",))
    model = get(body, "model", "str")
    get(body, "user", "str")
    echo = get(body, "echo", "bool", False)
    extra, renames = _constraints(body)
    defaults = {"max_new_tokens": COMPLETIONS_DEFAULT_MAX_TOKENS, **extra}
    sampling = _sampling(body, defaults, renames)
    n = sampling.n
    best_of = get(body, "best_of", "int", n)
    if best_of != n:
        raise bad(f"best_of must equal n ({n}); other values are not supported", "best_of")
    top = body.get("logprobs")
    top = None if top is None else get_int(body, "logprobs", 0, 0, MAX_TOP_LOGPROBS)
    stream, include_usage = _stream_flags(body)
    base_rid = get(body, "rid", "rid") or f"cmpl-{uuid.uuid4().hex}"
    prompts = _prompts(body)
    salt = _salt(body)
    if len(prompts) > MAX_PROMPTS:
        raise bad(f"prompt has {len(prompts)} prompts, at most {MAX_PROMPTS} per request", "prompt")
    reqs = []
    for i, (key, prompt) in enumerate(prompts):
        # echo: the prompt's logprobs (asked for) or its text (token ids) come from the
        # prompt logprobs, from position 0
        prompt_lps = echo and (top is not None or key == "input_ids")
        reqs.append(
            GenerateReq(
                rid=base_rid if len(prompts) == 1 else f"{base_rid}-{i}",
                sampling=sampling,
                return_logprob=top is not None or prompt_lps,
                logprob_start_len=0 if prompt_lps else -1,
                top_logprobs_num=top or 0,
                return_text_in_logprobs=top is not None or prompt_lps,
                stream=stream,
                salt=salt,
                **{key: prompt},
            )
        )
    echoed = [p if key == "text" else None for key, p in prompts] if echo else None
    token_ids = get(body, "return_token_ids", "bool", False)
    return OpenAIBatch(
        reqs, model, stream, include_usage, top is not None, renames, echoed, token_ids=token_ids
    )


def _salt(body: dict[str, Any]) -> CacheSalt:
    """The request's own `cache_salt` (its tenant's is added where it is submitted)."""
    return CacheSalt(salt=get(body, "cache_salt", "cache_salt", ""))


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object with role and content", "messages")
    check_fields(m, {"role", "content", "name", "tool_calls", "tool_call_id"})
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
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad(f"{where}.tool_call_id must be a string", "messages")
        out["tool_call_id"] = call_id
    elif m.get("tool_call_id") is not None:
        raise bad(f"{where}.tool_call_id is only for role 'tool'", "messages")
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise bad(f"{where}.tool_calls is only for role 'assistant'", "messages")
        out["tool_calls"] = [
            _past_call(c, f"{where}.tool_calls[{j}]")
            for j, c in enumerate(get(m, "tool_calls", "list"))
        ]
    return out


def _past_call(call: Any, where: str) -> dict[str, Any]:
    """An assistant's earlier tool call, as the client sends it back."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad(
            f"{where} must be {{'id', 'type': 'function', 'function': {{name, arguments}}}}",
            "messages",
        )
    check_fields(call, {"id", "type", "function"})
    check_fields(fn, {"name", "arguments"})
    args = fn.get("arguments", "{}")
    if not isinstance(args, str):
        raise bad(f"{where}.function.arguments must be a JSON string", "messages")
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        raise bad(f"{where}.id must be a string", "messages")
    return {"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list (or give pml instead)", "messages")
    if len(raw) > MAX_MESSAGES:
        raise bad(
            f"messages has {len(raw)} entries, at most {MAX_MESSAGES} are allowed", "messages"
        )
    return [_message(m, i) for i, m in enumerate(raw)]


# Names the renderer sets itself (or transformers' apply_chat_template takes as arguments).
TEMPLATE_OWN_NAMES = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt", "tokenize",
     "chat_template", "continue_final_message", "return_dict", "return_tensors", "padding",
     "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"}
)  # fmt: skip
TEMPLATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """`chat_template_kwargs`: variables for the model's chat template (Qwen3's and
    SmolLM3's `enable_thinking`, say), each a name and a JSON scalar."""
    kwargs = get(body, "chat_template_kwargs", "dict")
    if kwargs is None:
        return None
    name = "chat_template_kwargs"
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise bad(f"{name} has {len(kwargs)} entries, at most {MAX_TEMPLATE_KWARGS}", name)
    for key, value in kwargs.items():
        if not TEMPLATE_NAME.fullmatch(key) or key in TEMPLATE_OWN_NAMES:
            raise bad(f"{name}: {key[:64]!r} is not a template variable a request can set", name)
        if not isinstance(value, (str, bool, int, float)) and value is not None:
            raise bad(f"{name}.{key} must be a string, number, boolean or null", name)
        if isinstance(value, str) and len(value) > MAX_TEMPLATE_VALUE_CHARS:
            raise bad(f"{name}.{key} is longer than {MAX_TEMPLATE_VALUE_CHARS} characters", name)
    return dict(kwargs)


def parse_chat(body: dict[str, Any]) -> OpenAIBatch:
    check_fields(body, CHAT_FIELDS)
    extra, renames = _constraints(body)
    tools = parse_tools(body)
    if tools is not None and tools.choice != "auto":
        if extra or any(body.get(name) is not None for name in CONSTRAINT_FIELDS):
            raise bad(
                f"tool_choice {tools.choice!r} constrains the output itself: "
                "it cannot be combined with response_format, regex, json_schema or ebnf",
                "tool_choice",
            )
        extra, renames = tools.constraint()
    model = get(body, "model", "str")
    get(body, "user", "str")
    pml = get(body, "pml", "str")
    module_reuse = get(body, "module_reuse", "bool", True)
    if pml is not None and (body.get("messages") is not None or body.get("tools") is not None):
        raise bad("pml: give either messages (and tools) or pml, a PML <prompt>", "pml")
    messages = None if pml is not None else parse_messages(body)
    template_kwargs = _template_kwargs(body)
    if pml is not None and template_kwargs is not None:
        raise bad("chat_template_kwargs: a pml prompt is not rendered by the chat template", "pml")
    limit = get(body, "max_completion_tokens", "int")
    if limit is not None and body.get("max_tokens") is None:
        body = {**body, "max_tokens": limit}
    sampling = _sampling(body, extra, renames)
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
        pml=pml,
        module_reuse=module_reuse,
        return_logprob=logprobs,
        top_logprobs_num=top,
        return_text_in_logprobs=logprobs,
        stream=stream,
        max_new_tokens_auto=auto_limit,
        tools=None if tools is None else tools.definitions,
        template_kwargs=template_kwargs,
        salt=_salt(body),
    )
    token_ids = get(body, "return_token_ids", "bool", False)
    return OpenAIBatch(
        [req], model, stream, include_usage, logprobs, renames, tools=tools, token_ids=token_ids
    )
