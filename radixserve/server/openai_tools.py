"""OpenAI tool calling: the request's `tools` / `tool_choice` checked at the edge, the
constraint a forced choice puts on the output, and the tool calls parsed out of the text.

    tool_choice   what the model may write                          how it is read back
    none          text (tools are not rendered)                     content
    auto          text, or calls in any format of _parse_auto       content and/or calls
    required      a JSON array of {"name", "arguments"} (schema:    calls
                  each item one of the tools' names + parameters;
                  one item when parallel_tool_calls is false)
    {function}    that function's arguments (its parameters schema) one call

Formats read under `auto` (what the common chat templates teach a model to write):
Hermes / Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (any number, text
around them is content), Llama 3.1 JSON `{"name": ..., "parameters": {...}}` (the whole
output, or a JSON list of them), Mistral `[TOOL_CALLS] [{"name": ..., "arguments": ...}]`.
A call naming no known tool, or whose arguments are not a JSON object, stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.protocol import bad, check_fields

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function-name rule (and dots)
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_MARKERS = ("<tool_call>", "[TOOL_CALLS]")


@dataclass
class Tools:
    """A chat request's tools (tool_choice not none)."""

    definitions: list[dict[str, Any]]  # {"type": "function", "function": {...}}, checked
    choice: str  # "auto" | "required" | "named"
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.definitions]

    def schema(self, name: str) -> dict[str, Any]:
        i = self.names.index(name)
        return self.definitions[i]["function"].get("parameters") or {"type": "object"}

    def constraint(self) -> tuple[dict[str, Any], dict[str, str]]:
        """({"json_schema": text} or {}, renames for its errors) for this choice."""
        if self.choice == "named":
            assert self.name is not None
            where = f"tools[{self.names.index(self.name)}].function.parameters"
            return {"json_schema": json.dumps(self.schema(self.name))}, {"json_schema": where}
        if self.choice == "required":
            items = [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "arguments": self.schema(n)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for n in self.names
            ]
            one = items[0] if len(items) == 1 else {"anyOf": items}
            schema = {"type": "array", "items": one, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return {"json_schema": json.dumps(schema)}, {"json_schema": "tools"}
        return {}, {}

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished output (see the module docstring)."""
        if self.choice == "named":
            assert self.name is not None
            return None, [_call(self.name, text)]
        if self.choice == "required":
            calls = _json_calls(text, self.names)
            content, calls = (None, calls) if calls is not None else (text, [])
        else:
            content, calls = _parse_auto(text, self.names)
        return content, calls if self.parallel else calls[:1]


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """The request's tools, None when it has none or tool_choice is none; 400 naming the
    field for a bad definition or choice."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice requires tools", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad(f"tools must be a list of at most {MAX_TOOLS} function definitions", "tools")
    definitions = [_definition(t, i) for i, t in enumerate(raw)]
    names = [d["function"]["name"] for d in definitions]
    if len(set(names)) != len(names):
        raise bad(f"tools: function names must be unique, got {names}", "tools")
    if choice is None or choice in ("auto", "required"):
        return Tools(definitions, choice or "auto", parallel=parallel)
    if choice == "none":
        return None
    if isinstance(choice, dict):
        check_fields(choice, {"type", "function"})
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") == "function" and name in names:
            return Tools(definitions, "named", name, parallel)
        raise bad(f"tool_choice.function.name must name one of the tools {names}", "tool_choice")
    raise bad(
        "tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _definition(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
    check_fields(tool, {"type", "function"})
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function must be an object", "tools")
    check_fields(fn, {"name", "description", "parameters", "strict"})
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad(f"{where}.function.name must be 1-64 letters, digits, _ . or -", "tools")
    if not isinstance(fn.get("description", ""), str):
        raise bad(f"{where}.function.description must be a string", "tools")
    if not isinstance(fn.get("strict", False), bool):
        raise bad(f"{where}.function.strict must be a boolean", "tools")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad(f"{where}.function.parameters must be a JSON schema object", "tools")
    return {"type": "function", "function": {k: v for k, v in fn.items() if k != "strict"}}


# ---------------------------------------------------------------- reading calls back


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _as_call(obj: Any, names: list[str]) -> dict[str, Any] | None:
    """A call from {"name", "arguments" | "parameters"} naming a known tool, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return _call(obj["name"], json.dumps(args)) if isinstance(args, dict) else None


def _json_calls(text: str, names: list[str]) -> list[dict[str, Any]] | None:
    """Calls from a JSON object or list of them (the whole text), None if it is not one."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = doc if isinstance(doc, list) else [doc]
    calls = [_as_call(x, names) for x in items]
    return None if not calls or None in calls else calls  # type: ignore[return-value]


def _parse_auto(text: str, names: list[str]) -> tuple[str | None, list[dict[str, Any]]]:
    stripped = text.strip()
    if stripped.startswith("[TOOL_CALLS]"):
        stripped = stripped.removeprefix("[TOOL_CALLS]").strip()
    calls = _json_calls(stripped, names)
    if calls is not None:
        return None, calls
    found: list[dict[str, Any]] = []
    content = text
    for m in _HERMES.finditer(text):
        call = _as_call(_loads(m.group(1)), names)
        if call is not None:
            found.append(call)
            content = content.replace(m.group(0), "", 1)
    return (content.strip() or None) if found else text, found


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


@dataclass
class ToolStream:
    """One streamed choice's deltas: text passes through as content until a tool call may
    have begun; from there it is held and parsed when the choice finishes. A named function's
    arguments stream as they come."""

    tools: Tools
    sent: str = ""  # content already streamed
    held: str = ""  # text not streamed yet (a call, or what may begin one)
    calls: list[dict[str, Any]] = field(default_factory=list)
    holding: bool = False  # a call has begun: hold the rest

    def feed(self, text: str) -> dict[str, Any]:
        """The delta (content and/or tool_calls) for `text`, new output of the choice."""
        if self.tools.choice == "named":
            return self._named(text)
        self.held += text
        if self.tools.choice == "required" or self.holding:
            return {}
        if not self.sent and self.held.lstrip()[:1] in ("{", "["):  # a JSON call may follow
            self.holding = True
            return {}
        cut = _call_start(self.held)
        if cut < len(self.held) and any(self.held.startswith(m, cut) for m in _MARKERS):
            self.holding = True
        out, self.held = self.held[:cut], self.held[cut:]
        self.sent += out
        return {"content": out} if out else {}

    def finish(self) -> dict[str, Any]:
        """The last delta: held text parsed into content and tool calls."""
        if self.tools.choice == "named" or not self.held:
            return {}
        if self.tools.choice == "required" or self.holding:
            content, self.calls = self.tools.parse(self.held)
        else:
            content = self.held
        delta: dict[str, Any] = {"content": content} if content else {}
        if self.calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(self.calls)]
        return delta

    def _named(self, text: str) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": text}
        entry: dict[str, Any] = {"index": 0, "function": fn}
        if not self.calls:  # the first delta names the call
            assert self.tools.name is not None
            self.calls = [_call(self.tools.name, "")]
            entry = {"index": 0, **{**self.calls[0], "function": {**fn, "name": self.tools.name}}}
        return {"tool_calls": [entry]}


def _call_start(text: str) -> int:
    """Where a tool-call marker begins in `text`, or a tail that may begin one; len(text)
    when neither."""
    for i in range(len(text)):
        if text[i] in "<[" and any(m.startswith(text[i : i + len(m)]) for m in _MARKERS):
            return i
    return len(text)
