"""Strict request parsing at the HTTP edge: every refusal is an `ApiError` naming the field.

Type rules (the same as `SamplingParams.from_dict`): bool is not an int, an int is accepted
where a float is expected, null means "the default". Unknown fields are refused, except a
few SGLang fields that its clients send with empty values (`ACCEPTED_IF_EMPTY`): those are
accepted when empty and refused as unsupported otherwise.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from radixserve.core.limits import (
    MAX_CACHE_SALT_CHARS,
    MAX_JSON_DEPTH,
    MAX_JSON_ITEMS,
    MAX_RID_CHARS,
)

MAX_BODY_BYTES = 8 * 2**20  # larger bodies get 413 (a 128k-token prompt is ~1 MiB of JSON)
INT64 = (-(2**63), 2**63 - 1)  # every integer of a request fits here (msgspec, torch, seeds)

# SGLang request fields we do not implement but its clients send empty (bench_serving sends
# "lora_path": null, "image_data": null, ...). Accepted when null/false/""/[]/{}.
ACCEPTED_IF_EMPTY = frozenset(
    {
        "lora_path",
        "image_data",
        "video_data",
        "audio_data",
        "modalities",
        "return_hidden_states",
        "return_routed_experts",
        "custom_logit_processor",
        "data_parallel_rank",
        "session_params",
        "stream_options",
        "bootstrap_host",
        "bootstrap_port",
        "bootstrap_room",
    }
)


class ApiError(Exception):
    """An HTTP error response: status, a message saying what to fix, the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        message = _printable(message)  # it may quote client text: keep it encodable
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {
                "message": self.message,
                "type": kind,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


async def api_error_handler(request: Request, exc: Exception) -> Response:
    """The exception handler of ApiError, for the server's and the router's apps."""
    assert isinstance(exc, ApiError), type(exc)
    return exc.response()


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


async def read_json(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request body as a JSON object; 413 past `limit` bytes, 400 if not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():  # also bounds chunked bodies with no length header
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return {}
    return parse_body(raw)


def parse_body(raw: bytes | str) -> dict[str, Any]:
    """A JSON object whose every value is safe to carry (see `check_values`); 400 otherwise."""
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_constant=float)
    except RecursionError as e:
        raise bad(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"invalid JSON body: {e}") from e
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    check_values(body)
    return body


class _HugeInt(int):
    """An integer literal too long for 64 bits, kept unconverted so `check_values` can name
    its field (Python refuses to convert > 4300 digits, and anything past 20 is too big)."""

    digits: int


def _parse_int(text: str) -> int:
    if len(text) <= 20:
        return int(text)
    huge = _HugeInt(0)
    huge.digits = len(text.lstrip("-"))
    return huge


def check_values(body: dict[str, Any]) -> None:
    """400 naming the first offending value (as `a.b[2].c`) anywhere in `body`: nesting past
    MAX_JSON_DEPTH, a list or object past MAX_JSON_ITEMS entries, an integer outside 64 bits,
    a float that is not finite (NaN, Infinity, 1e400), or a string or key with a lone UTF-16
    surrogate (it cannot be encoded into any reply or message)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        where = path or "the request body"
        if isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise bad(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels", _field(path))
            if len(value) > MAX_JSON_ITEMS:
                raise bad(f"{where} has more than {MAX_JSON_ITEMS} entries", _field(path))
            if isinstance(value, dict):
                for k, v in value.items():
                    key = _printable(k)
                    _check_text(k, f"{path}.{key}" if path else key, "key")
                    stack.append((v, f"{path}.{key}" if path else key, depth + 1))
            else:
                stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where, "string")
        elif isinstance(value, _HugeInt):
            raise bad(
                f"{where} must fit in 64 bits, got a {value.digits}-digit integer", _field(path)
            )
        elif (
            isinstance(value, int)
            and not isinstance(value, bool)
            and not INT64[0] <= value <= INT64[1]
        ):
            raise bad(f"{where} must fit in 64 bits, got {value}", _field(path))
        elif isinstance(value, float) and not math.isfinite(value):
            raise bad(f"{where} must be a finite number, got {value}", _field(path))


def _check_text(text: str, where: str, what: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad(
                f"{where}: the {what} holds a lone UTF-16 surrogate at {e.start}", _field(where)
            ) from e


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _field(path: str) -> str | None:
    """The top-level field of a path (`sampling_params[1].seed` -> `sampling_params`)."""
    return re.split(r"[.\[]", path, maxsplit=1)[0] or None


def check_fields(body: Mapping[str, Any], allowed: frozenset[str] | set[str]) -> None:
    for name in body:
        if name in allowed:
            continue
        if name in ACCEPTED_IF_EMPTY:
            if body[name] in (None, False, "", [], {}):
                continue
            raise bad(f"{name} is not supported by this server", name)
        raise bad(f"unknown field {name!r}", name)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(float(v))  # type: ignore[arg-type]


_CHECKS: dict[str, tuple[Any, str]] = {
    "str": (lambda v: isinstance(v, str), "a string"),
    "int": (_is_int, "an integer"),
    "number": (_is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "rid": (
        lambda v: isinstance(v, str) and 0 < len(v) <= MAX_RID_CHARS,
        f"a non-empty string of at most {MAX_RID_CHARS} characters",
    ),
    "cache_salt": (
        lambda v: isinstance(v, str) and 0 < len(v) <= MAX_CACHE_SALT_CHARS,
        f"a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
    ),
    "dict": (lambda v: isinstance(v, dict), "an object"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "int_list": (lambda v: isinstance(v, list) and all(map(_is_int, v)), "a list of integers"),
    "str_list": (
        lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "a list of strings",
    ),
}


def get(body: Mapping[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """`body[name]` checked against `kind` (a key of _CHECKS); null or absent -> default."""
    value = body.get(name)
    if value is None:
        return default
    check, expected = _CHECKS[kind]
    if not check(value):
        raise bad(f"{name} must be {expected}, got {_show(value)}", name)
    return value


def get_int(body: Mapping[str, Any], name: str, default: int, lo: int, hi: int | None) -> int:
    value: int = get(body, name, "int", default)
    if value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"{name} must be {allowed}, got {value}", name)
    return value


def _show(value: object) -> str:
    s = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return s if len(s) <= 60 else s[:57] + "..."
