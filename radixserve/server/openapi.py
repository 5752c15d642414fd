"""JSON schemas of the request bodies, for the OpenAPI document at /openapi.json.

The routes parse their bodies by hand (protocol.py, native.py, openai_protocol.py: strict,
400 naming the field); these schemas describe the same fields, types and ranges so clients
and fuzzers (schemathesis in tests/test_server_fuzz.py) see what is accepted. A body valid
here may still be refused for what a schema cannot say (prompt + max_new_tokens past the
context, a token id past the vocabulary, a regex that does not compile).
"""

from __future__ import annotations

from typing import Any

from radixserve.core.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_N,
    MAX_PATTERN_CHARS,
    MAX_PROMPTS,
    MAX_RID_CHARS,
    MAX_STOP_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TEMPLATE_KWARGS,
    MAX_TOP_LOGPROBS,
    REPETITION_PENALTY_RANGE,
)
from radixserve.server.protocol import ACCEPTED_IF_EMPTY

INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}


def _nullable(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """`schema` or null (null means the default everywhere), with a description."""
    return {"anyOf": [schema, {"type": "null"}], "description": description}


def _int(lo: int, description: str, hi: int | None = None) -> dict[str, Any]:
    return _nullable(
        {**INT64, "minimum": lo, **({} if hi is None else {"maximum": hi})}, description
    )


def _num(lo: float, hi: float, description: str) -> dict[str, Any]:
    return _nullable({"type": "number", "minimum": lo, "maximum": hi}, description)


def _bool(description: str) -> dict[str, Any]:
    return _nullable({"type": "boolean"}, description)


def _str(description: str, max_length: int, min_length: int = 0) -> dict[str, Any]:
    schema = {"type": "string", "minLength": min_length, "maxLength": max_length}
    return _nullable(schema, description)


def _empty(description: str) -> dict[str, Any]:
    """A field accepted only when empty (SGLang / OpenAI clients send it)."""
    return {"enum": [None, False, "", [], {}], "description": description}


# maxLength counts characters: the byte caps (MAX_STOP_BYTES, in total too) are checked on parse
STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_BYTES}
STOP = _nullable(
    {"anyOf": [STOP_STRING, {"type": "array", "items": STOP_STRING, "maxItems": MAX_STOP_STRINGS}]},
    "stop strings (excluded from the output)",
)
STOP_TOKEN_IDS = _nullable(
    {"type": "array", "items": {**INT64, "minimum": 0}, "maxItems": MAX_STOP_TOKEN_IDS},
    "token ids that stop a sample (each < the vocabulary size)",
)
RID = _str("request id, unique among requests in flight", MAX_RID_CHARS, 1)
CACHE_SALT = _str(
    "cached K/V is shared only among requests of the same cache_salt (and tenant under "
    "--cache-isolation tenant)",
    MAX_CACHE_SALT_CHARS,
    1,
)
PENALTY = (-2.0, 2.0)
EMPTY_EXTRAS = {name: _empty("not supported: accepted only empty") for name in ACCEPTED_IF_EMPTY}

# Sampling fields common to SamplingParams (native names) and the OpenAI bodies.
SHARED_SAMPLING: dict[str, Any] = {
    "temperature": _num(0.0, MAX_TEMPERATURE, "0 or below 1e-6: greedy"),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "nucleus mass"),
    "top_k": _int(-1, "-1 or 0: off"),
    "min_p": _num(0.0, 1.0, "drop tokens below min_p x the top probability"),
    "frequency_penalty": _num(*PENALTY, "OpenAI frequency penalty"),
    "presence_penalty": _num(*PENALTY, "OpenAI presence penalty"),
    "repetition_penalty": _num(*REPETITION_PENALTY_RANGE, "HF repetition penalty (1: off)"),
    "stop": STOP,
    "stop_token_ids": STOP_TOKEN_IDS,
    "ignore_eos": _bool("eos does not stop"),
    "skip_special_tokens": _bool("leave special tokens out of the text"),
    "spaces_between_special_tokens": _bool("put spaces between special tokens"),
    "n": _int(1, "samples per prompt", MAX_N),
    "seed": _nullable(INT64, "a seeded sample is reproducible"),
    "regex": _str("constrain the output to this regex", MAX_PATTERN_CHARS),
    "json_schema": _str("constrain the output to this JSON schema (text)", MAX_PATTERN_CHARS),
    "ebnf": _str("constrain the output to this GBNF grammar (root ::= ...)", MAX_PATTERN_CHARS),
    "logit_bias": _nullable(
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]{1,18}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "maxProperties": MAX_LOGIT_BIAS,
        },
        "token id -> bias added to its logit",
    ),
}
SAMPLING_PARAMS = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        **SHARED_SAMPLING,
        "max_new_tokens": _int(0, "most tokens to generate (0: prefill only)"),
        "min_new_tokens": _int(0, "eos and stop_token_ids are masked until this many"),
        "stop_regex": _empty("not supported yet: accepted only empty"),
    },
}


def _one_or_list(item: dict[str, Any], description: str) -> dict[str, Any]:
    """One value for every prompt, or a list with one per prompt."""
    return {"anyOf": [item, {"type": "array", "items": item}], "description": description}


TOKEN_IDS = {"type": "array", "items": {**INT64, "minimum": 0}, "minItems": 1}
NONEMPTY = {"type": "string", "minLength": 1}
TEXT_OR_BATCH = [
    NONEMPTY,
    {"type": "array", "items": NONEMPTY, "minItems": 1, "maxItems": MAX_PROMPTS},
]
GENERATE = {
    "type": "object",
    "additionalProperties": False,
    "oneOf": [{"required": ["text"]}, {"required": ["input_ids"]}, {"required": ["pml"]}],
    "properties": {
        **EMPTY_EXTRAS,
        "text": {
            "anyOf": TEXT_OR_BATCH,
            "description": "the prompt, or a batch of prompts",
        },
        "input_ids": {
            "anyOf": [
                TOKEN_IDS,
                {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": MAX_PROMPTS},
            ],
            "description": "the prompt as token ids, or a batch of them",
        },
        "sampling_params": _one_or_list(SAMPLING_PARAMS, "sampling parameters"),
        "rid": _one_or_list(RID, "request id(s)"),
        "stream": _bool("server-sent events, one per output delta"),
        "return_logprob": _one_or_list(_bool("return logprobs"), "return logprobs"),
        "logprob_start_len": _one_or_list(_int(-1, ""), "prompt logprobs from here (-1: none)"),
        "top_logprobs_num": _one_or_list(
            _int(0, "", MAX_TOP_LOGPROBS), "top logprobs per token (with return_logprob)"
        ),
        "return_text_in_logprobs": _bool("logprob entries carry the token text"),
        "pml": {
            "anyOf": TEXT_OR_BATCH,
            "description": "a PML <prompt> importing modules of a registered schema, or a batch",
        },
        "module_reuse": _bool("pml: reuse the modules' K/V (false: prefill the expanded text)"),
        "cache_salt": CACHE_SALT,
    },
}

STREAM_OPTIONS = _nullable(
    {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "include_usage": _bool("a last chunk with the usage"),
            "continuous_usage_stats": _bool("accepted, no effect"),
        },
    },
    "streaming options",
)
OPENAI_COMMON: dict[str, Any] = {
    **EMPTY_EXTRAS,
    **SHARED_SAMPLING,
    "max_tokens": _int(0, "most tokens to generate"),
    "min_tokens": _int(0, "eos and stop_token_ids are masked until this many"),
    "model": _str("echoed back; the server serves one model", MAX_RID_CHARS),
    "stream": _bool("server-sent events"),
    "stream_options": STREAM_OPTIONS,
    "user": _str("accepted, unused", MAX_RID_CHARS),
    "rid": RID,
    "cache_salt": CACHE_SALT,
    "return_token_ids": _bool("each choice carries its token ids (a stream's chunk: its own)"),
    "response_format": _nullable(
        {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"},
                        "schema": {"type": "object"},
                        "strict": {"type": "boolean"},
                    },
                },
            },
        },
        "structured output: any JSON object, or JSON following a schema",
    ),
}
COMPLETION = {
    "type": "object",
    "additionalProperties": False,
    "required": ["prompt"],
    "properties": {
        **OPENAI_COMMON,
        "prompt": {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
                TOKEN_IDS,
                {"type": "array", "items": TOKEN_IDS, "minItems": 1},
            ],
            "maxItems": MAX_PROMPTS,
            "description": "prompt(s) as text or token ids",
        },
        "logprobs": _int(0, "top logprobs per token (null: no logprobs)", MAX_TOP_LOGPROBS),
        "best_of": _int(1, "must equal n", MAX_N),
        "echo": _bool("the prompt before the completion (and its logprobs with logprobs)"),
        "suffix": _empty("not supported: accepted only empty"),
    },
}
CONTENT_PART = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
TOOL_CALL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
TOOL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object", "description": "a JSON schema"},
                "strict": {"type": "boolean"},
            },
        },
    },
}
MESSAGE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["role", "content"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": CONTENT_PART},
                {"type": "null"},
            ]
        },
        "name": {"type": "string", "maxLength": MAX_RID_CHARS},
        "tool_call_id": {"type": "string", "description": "role tool: the call answered"},
        "tool_calls": {"type": "array", "items": TOOL_CALL, "description": "role assistant"},
    },
}
CHAT = {
    "type": "object",
    "additionalProperties": False,
    "oneOf": [{"required": ["messages"]}, {"required": ["pml"], "not": {"required": ["tools"]}}],
    "properties": {
        **OPENAI_COMMON,
        "pml": {
            **NONEMPTY,
            "description": "instead of messages: a PML <prompt> importing a registered schema's "
            "modules (its role tags use the chat template)",
        },
        "module_reuse": _bool("pml: reuse the modules' K/V (false: prefill the expanded text)"),
        "messages": {
            "type": "array",
            "items": MESSAGE,
            "minItems": 1,
            "maxItems": MAX_MESSAGES,
            "description": "the conversation, rendered with the model's chat template",
        },
        "max_completion_tokens": _int(0, "most tokens to generate (as max_tokens)"),
        "logprobs": _bool("return logprobs of the output tokens"),
        "top_logprobs": _int(0, "top logprobs per token (needs logprobs)", MAX_TOP_LOGPROBS),
        "tools": _nullable(
            {"type": "array", "items": TOOL, "maxItems": 128}, "functions the model may call"
        ),
        "tool_choice": {
            "anyOf": [
                {"enum": ["none", "auto", "required"]},
                {
                    "type": "object",
                    "required": ["type", "function"],
                    "properties": {
                        "type": {"const": "function"},
                        "function": {"type": "object", "properties": {"name": {"type": "string"}}},
                    },
                },
            ],
            "description": "none, auto (default with tools), required, or a named function",
        },
        "parallel_tool_calls": _bool("more than one call per answer (default true)"),
        "chat_template_kwargs": _nullable(
            {
                "type": "object",
                "maxProperties": MAX_TEMPLATE_KWARGS,
                "additionalProperties": {"type": ["string", "number", "boolean", "null"]},
            },
            "the chat template's own variables (enable_thinking, say)",
        ),
    },
}


def body(schema: dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` of a route whose JSON body follows `schema`."""
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
        "responses": {
            "400": {"description": "invalid request: error.message names the field"},
            "503": {"description": "the server is at capacity: retry after Retry-After"},
        },
    }
