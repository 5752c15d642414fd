"""Tool calling without a model: definitions and tool_choice checked at the edge (400 naming
the field), the constraint a forced choice puts on the output, tool calls read back from each
common format, streamed deltas, and chat rendering with and without a template tool format."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from radixserve.server.openai_protocol import parse_chat
from radixserve.server.openai_tools import Tools, ToolStream, parse_tools
from radixserve.server.protocol import ApiError
from radixserve.tokenizer.chat import TOOL_PROMPT, render_chat

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
NAMES = ["get_weather", "get_time"]


def tools(choice: Any = "auto", parallel: bool = True) -> Tools:
    body = {"tools": [WEATHER, TIME], "tool_choice": choice, "parallel_tool_calls": parallel}
    parsed = parse_tools(body)
    assert parsed is not None
    return parsed


def calls_of(parsed: tuple[str | None, list[dict[str, Any]]]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed[1]]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',  # Llama 3.1
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',  # Mistral
        '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]',  # string args
    ],
    ids=["hermes", "llama31", "mistral", "string-arguments"],
)
def test_auto_reads_each_format(text: str) -> None:
    content, calls = tools().parse(text)
    assert content is None
    assert calls_of((content, calls)) == [("get_weather", {"city": "Paris"})]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_auto_keeps_text_and_several_calls() -> None:
    text = (
        "Let me check.\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    )
    content, calls = tools().parse(text)
    assert content == "Let me check."
    assert calls_of((content, calls)) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls_of(tools(parallel=False).parse(text)) == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny today.",
        '{"name": "unknown_tool", "arguments": {}}',  # not one of the tools
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # not an object
        '{"city": "Paris"}',
    ],
)
def test_auto_leaves_plain_text_as_content(text: str) -> None:
    assert tools().parse(text) == (text, [])


def test_named_and_required_constraints() -> None:
    named = tools({"type": "function", "function": {"name": "get_weather"}})
    extra, renames = named.constraint()
    assert json.loads(extra["json_schema"]) == WEATHER["function"]["parameters"]
    assert renames == {"json_schema": "tools[0].function.parameters"}
    assert calls_of(named.parse('{"city": "Rome"}')) == [("get_weather", {"city": "Rome"})]

    required = tools("required", parallel=False)
    schema = json.loads(required.constraint()[0]["json_schema"])
    good = [{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]
    jsonschema.validate(good, schema)
    for wrong in (
        [],
        [{"name": "get_weather", "arguments": {"days": 2}}],  # city is required
        [{"name": "nope", "arguments": {}}],
        good + good,  # parallel_tool_calls false: one call
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert calls_of(required.parse(json.dumps(good))) == [
        ("get_weather", {"city": "Rome", "days": 2})
    ]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": [{"type": "function"}]}, r"tools\[0\].function must be an object"),
        ({"tools": [{"type": "code", "function": {}}]}, r'tools\[0\] must be \{"type": "function"'),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            r"tools\[0\].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            r"tools\[0\].function.parameters must be a JSON schema object",
        ),
        ({"tools": [WEATHER, WEATHER]}, "function names must be unique"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice must be"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            r"tool_choice.function.name must name one of the tools \['get_weather'\]",
        ),
        ({"tool_choice": "required"}, "tool_choice requires tools"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls must be"),
    ],
)
def test_bad_tools_are_400_naming_the_field(body: dict[str, Any], message: str) -> None:
    with pytest.raises(ApiError, match=message) as info:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], **body})
    assert info.value.status == 400 and info.value.param in (
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    )


def test_forced_choice_excludes_other_constraints() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    with pytest.raises(ApiError, match="cannot be combined") as info:
        parse_chat(body)
    assert info.value.param == "tool_choice"
    del body["response_format"]
    batch = parse_chat(body)
    assert batch.reqs[0].sampling.json_schema is not None and batch.reqs[0].tools == [WEATHER]
    body["tool_choice"] = "none"  # no tools rendered, no constraint, nothing parsed
    batch = parse_chat(body)
    assert batch.tools is None and batch.reqs[0].tools is None


def _stream(t: Tools, pieces: list[str]) -> tuple[str, list[dict[str, Any]], list[dict]]:
    s = ToolStream(t)
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    return content, calls, deltas


def test_stream_passes_text_and_holds_calls() -> None:
    pieces = [
        "Sure",
        ", checking",
        " <to",
        "ol_call>",
        '{"name": "get_time", ',
        '"arguments": {}}',
        "</tool_call>",
    ]
    content, calls, deltas = _stream(tools(), pieces)
    assert deltas[0] == {"content": "Sure"} and deltas[1] == {"content": ", checking"}
    assert content.strip() == "Sure, checking"
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_time")]
    # Text that only looked like a marker's start is released.
    content, calls, _ = _stream(tools(), ["a <b> c", " [x]"])
    assert content == "a <b> c [x]" and calls == []


def test_stream_named_arguments_as_they_come() -> None:
    named = tools({"type": "function", "function": {"name": "get_weather"}})
    _, calls, deltas = _stream(named, ['{"city"', ': "Oslo"}'])
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "name" not in calls[1]["function"]
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Oslo"}


# ---------------------------------------------------------------- rendering

CONVERSATION = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "call_1"},
]


def test_plain_template_renders_tools_in_a_system_prompt(tokenizer: Any) -> None:
    text = tokenizer.decode(render_chat(tokenizer, CONVERSATION, [WEATHER]))
    first_line = TOOL_PROMPT.splitlines()[0]
    assert text.count(first_line) == 1 and json.dumps(WEATHER["function"]) in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tokenizer.decode(render_chat(tokenizer, CONVERSATION[:1]))
    assert first_line not in plain


def test_template_with_a_tool_format_gets_tools(tokenizer: Any) -> None:
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}\n{% endfor %}"
    )
    text = tok.decode(render_chat(tok, CONVERSATION, [WEATHER]))
    assert text.startswith("TOOL get_weather\n")
    assert "CALL get_weather Oslo" in text  # arguments handed over as an object
    assert "tool: sunny, 21 C" in text and TOOL_PROMPT.splitlines()[0] not in text
