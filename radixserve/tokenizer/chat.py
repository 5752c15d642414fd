"""Chat prompts: OpenAI-style messages (and tools) -> token ids through the tokenizer's own
template.

Tools: a template that has a tool format (it reads `tools`; Qwen2.5, Llama 3.1, Hermes,
Mistral templates do) gets the definitions and the messages as they are, with each earlier
call's arguments as an object (what those templates expect). Any other template gets plain
messages: the definitions in a system prompt (TOOL_PROMPT, after the client's own system
message) that asks for Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>`,
earlier calls written that way in the assistant's content, and each tool result as a user
message `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_PROMPT = (
    "You can call functions. The available functions, one JSON definition a line:\n"
    "{definitions}\n"
    "To call a function, answer with one line per call:\n"
    '<tool_call>{{"name": <function name>, "arguments": <arguments as a JSON object>}}'
    "</tool_call>"
)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template rejected them)."""


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` followed by the assistant's generation prompt.

    Messages were validated by the api server (role, content: str, tool_calls, tool_call_id),
    and so were `template_kwargs`, the template's extra variables (`enable_thinking`, say).
    The template adds the special tokens itself, so the rendered text is encoded without
    adding more.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError("messages: this model's tokenizer has no chat template")
    extra: dict[str, Any] = dict(template_kwargs or {})
    if has_tool_format(template):
        messages = [_native(m) for m in messages]
        extra |= {"tools": tools} if tools else {}
    else:
        messages = _plain(messages, tools)
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **extra
        )
    except Exception as e:  # jinja raises its own types for template-level rejections
        raise ChatTemplateError(f"messages: the chat template rejected them: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=False))


def has_tool_format(template: Any) -> bool:
    """True when the chat template renders `tools` itself."""
    texts = template.values() if isinstance(template, dict) else [template]
    return any("tools" in str(t) for t in texts)


def _native(m: dict[str, Any]) -> dict[str, Any]:
    """A message for a tool-aware template: call arguments as objects."""
    if "tool_calls" not in m:
        return m
    calls = [
        {**c, "function": {**c["function"], "arguments": _object(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]
    return {**m, "tool_calls": calls}


def _plain(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict]:
    """Messages for a template without a tool format (see the module docstring)."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append(
                {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
            )
            continue
        content = m["content"]
        for c in m.get("tool_calls", []):
            call = {"name": c["function"]["name"], "arguments": _object(c["function"]["arguments"])}
            content += ("\n" if content else "") + f"<tool_call>{json.dumps(call)}</tool_call>"
        out.append({"role": m["role"], "content": content})
    if tools:
        lines = "\n".join(json.dumps(t["function"]) for t in tools)
        prompt = TOOL_PROMPT.format(definitions=lines)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:  # the client's own text: pass it on as it is
        return arguments
