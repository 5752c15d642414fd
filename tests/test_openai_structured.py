"""Structured outputs, grammars, logit_bias, echo and tool calls through the `openai` client
against the real server on the tiny random model: whatever the model wants, the constraint
makes every output valid. Bad fields are 400s naming them."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import openai
import pytest
from conftest import API_KEY

# Bounded so that every document completes well within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "Tell me about a person."}]


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_json_schema_response_validates(oai: openai.OpenAI) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    r = oai.chat.completions.create(
        model="m", messages=USER, response_format=fmt, n=8, temperature=1.0, seed=1, max_tokens=64
    )  # type: ignore[call-overload]
    assert len(r.choices) == 8
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content or ""), PERSON)


def test_json_object_and_completions_route(oai: openai.OpenAI) -> None:
    r = oai.completions.create(
        model="m",
        prompt="JSON:",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    assert isinstance(json.loads(r.choices[0].text), dict)


@pytest.mark.parametrize(
    ("extra", "pattern"),
    [
        ({"regex": r"(yes|no), [0-9]{2}"}, r"(yes|no), [0-9]{2}"),
        (
            {"ebnf": 'root ::= animal " " count\nanimal ::= "cat" | "dog"\ncount ::= [1-3]'},
            r"(cat|dog) [1-3]",
        ),
    ],
    ids=["regex", "ebnf"],
)
def test_sglang_constraints_in_extra_body(oai: openai.OpenAI, extra: dict, pattern: str) -> None:
    r = oai.chat.completions.create(
        model="m", messages=USER, n=4, temperature=1.0, max_tokens=20, extra_body=extra
    )
    for c in r.choices:
        assert re.fullmatch(pattern, c.message.content or ""), c.message.content
        assert c.finish_reason == "stop"
    r2 = oai.completions.create(model="m", prompt="x", max_tokens=20, extra_body=extra)
    assert re.fullmatch(pattern, r2.choices[0].text)


def test_generate_ebnf(server: Any) -> None:
    grammar = 'root ::= "[" item ("," item)? "]"\nitem ::= "a" | "b"'
    with server.client() as c:
        r = c.post(
            "/generate",
            json={"text": "x", "sampling_params": {"ebnf": grammar, "max_new_tokens": 16, "n": 3}},
        )
    assert r.status_code == 200, r.text
    assert all(re.fullmatch(r"\[[ab](,[ab])?\]", o["text"]) for o in r.json()), r.json()


def _first_token(oai: openai.OpenAI, **kw: Any) -> str:
    r = oai.completions.create(
        model="m", prompt="The", max_tokens=1, temperature=0, logprobs=0, **kw
    )
    return r.choices[0].logprobs.tokens[0]  # type: ignore[union-attr,index]


def test_logit_bias(oai: openai.OpenAI, tokenizer: Any) -> None:
    favourite = _first_token(oai)
    ids = tokenizer.encode(favourite, add_special_tokens=False)
    assert len(ids) == 1, favourite  # the greedy token's text tokenizes back to itself
    banned = {str(ids[0]): -100}
    assert _first_token(oai, logit_bias=banned) != favourite
    r = oai.completions.create(
        model="m",
        prompt="The",
        max_tokens=50,
        temperature=1.0,
        logprobs=0,
        logit_bias=banned,
        extra_body={"ignore_eos": True},
    )
    tokens = r.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert len(tokens) == 50 and favourite not in tokens
    forced = oai.completions.create(
        model="m",
        prompt="The",
        max_tokens=5,
        temperature=1.0,
        logit_bias={"1000": 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == tokenizer.decode([1000] * 5)


def test_echo(oai: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    r = oai.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, echo=True)
    plain = oai.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0)
    assert r.choices[0].text == prompt + plain.choices[0].text
    r = oai.completions.create(
        model="m", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp is not None and r.usage is not None
    n = r.usage.prompt_tokens + r.usage.completion_tokens
    assert len(lp.tokens or []) == len(lp.token_logprobs or []) == n
    assert "".join(lp.tokens or []) == r.choices[0].text
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])  # type: ignore[index,operator]
    ids = oai.completions.create(model="m", prompt=[1, 2, 3], max_tokens=2, echo=True)
    assert ids.choices[0].text.startswith("".join(_decode_each(oai, [1, 2, 3])))


def _decode_each(oai: openai.OpenAI, ids: list[int]) -> list[str]:
    r = oai.completions.create(model="m", prompt=ids, max_tokens=1, echo=True, logprobs=0)
    return (r.choices[0].logprobs.tokens or [])[: len(ids)]  # type: ignore[union-attr]


def test_echo_stream(oai: openai.OpenAI) -> None:
    prompt = "Once upon a time"
    chunks = list(
        oai.completions.create(
            model="m", prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith(prompt)
    whole = oai.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_named_tool_choice(oai: openai.OpenAI) -> None:
    params = WEATHER["function"]["parameters"]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = oai.chat.completions.create(
        model="m",
        messages=USER,
        tools=[WEATHER],
        tool_choice=choice,
        n=3,
        temperature=1.0,
        max_tokens=64,
    )  # type: ignore[arg-type]
    for c in r.choices:
        (call,) = c.message.tool_calls or []
        assert call.function.name == "get_weather" and c.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), params)
    stream = oai.chat.completions.create(
        model="m",
        messages=USER,
        tools=[WEATHER],
        tool_choice=choice,
        temperature=0,
        max_tokens=64,
        stream=True,
    )  # type: ignore[arg-type]
    deltas = [c.choices[0].delta for c in stream if c.choices]
    parts = [t for d in deltas for t in d.tool_calls or []]
    assert parts[0].function.name == "get_weather" and parts[0].id  # type: ignore[union-attr]
    args = "".join(p.function.arguments or "" for p in parts)  # type: ignore[union-attr]
    jsonschema.validate(json.loads(args), params)
    assert len(parts) > 2  # streamed as the tokens come


def test_required_tool_choice_and_tool_messages(oai: openai.OpenAI) -> None:
    r = oai.chat.completions.create(
        model="m",
        messages=USER,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=64,
    )  # type: ignore[arg-type]
    (call,) = r.choices[0].message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    follow = oai.chat.completions.create(
        model="m", messages=history, tools=[WEATHER], max_tokens=4, temperature=0
    )  # type: ignore[arg-type]
    assert follow.usage is not None and follow.usage.prompt_tokens > r.usage.prompt_tokens  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "field", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format", "response_format.type must be"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
            "response_format",
            "response_format.json_schema.schema must be",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "nope"}},
                }
            },
            None,
            "response_format.json_schema.schema: cannot compile",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "schema": {"properties": {"x": {"$ref": "#"}}, "required": ["x"]}
                    },
                }
            },
            None,
            "json_schema.schema: no finite document matches it",
        ),
        ({"ebnf": "root ::= ("}, None, "ebnf: "),
        ({"regex": "a(", "response_format": {"type": "json_object"}}, "regex", "exclusive"),
        (
            {"logit_bias": {"5": 101}},
            "logit_bias",
            r"logit_bias: biases must be in \[-100.0, 100.0\]",
        ),
        ({"logit_bias": {"x": 1}}, "logit_bias", "logit_bias must be an object mapping token ids"),
        ({"logit_bias": {"99999999": 1}}, None, r"logit_bias: ids must be in \[0, "),
        (
            {"tools": [{"type": "function", "function": {"name": "?"}}]},
            "tools",
            "tools\\[0\\].function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice requires tools"),
    ],
)
def test_bad_fields_are_400(server: Any, body: dict, field: str | None, message: str) -> None:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert re.search(message, error["message"]), error
    if field is not None:
        assert error["param"] == field
    with server.client() as c:  # nothing leaked: the server holds nothing once idle
        info = c.get("/get_server_info").json()
    assert info["scheduler"]["kv_held_tokens"] == 0 and info["api_pending_requests"] == 0
