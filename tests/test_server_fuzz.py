"""Fuzzing the HTTP edge. Property tests (hypothesis) of the parsers on arbitrary input:
they refuse only with a 4xx ApiError / InvalidRequest, and whatever they accept can be
encoded into every reply and IPC message. Then schemathesis against the real server's
OpenAPI document (/generate and /v1/*), valid and invalid bodies: no 5xx, the server alive
and idle afterwards, a reference greedy output unchanged. Example counts: a few per
test by default, many in CI (the Hypothesis profiles of tests/conftest.py, FUZZ_EXAMPLES)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable
from typing import Any

import pytest
import schemathesis
from conftest import wait_idle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from radixserve.core.params import InvalidRequest, SamplingParams
from radixserve.message.codec import encode
from radixserve.server import openapi
from radixserve.server.openai_protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    parse_chat,
    parse_completion,
)
from radixserve.server.protocol import ACCEPTED_IF_EMPTY, ApiError, parse_body
from radixserve.server.sglang_api import GENERATE_FIELDS, parse_generate

# Each example is a real request to the shared server: 600 take about 45 s on 2 cores.
IN_CI = os.environ.get("CI") == "true"
FUZZ_EXAMPLES = {
    GenerationMode.POSITIVE: 300 if IN_CI else 60,
    GenerationMode.NEGATIVE: 300 if IN_CI else 150,
}
REFERENCE = {"text": "Fuzz reference prompt", "sampling_params": {"temperature": 0}}

# JSON values a hostile client can send: 64-bit edges and beyond, NaN/inf, any text
# (lone surrogates included), nesting.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**400])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _fields(*names: Iterable[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects whose keys are mostly the given field names (and sometimes anything)."""
    keys = st.sampled_from(sorted({n for group in names for n in group})) | st.text(max_size=6)
    return st.dictionaries(keys, JSON, max_size=6)


SAMPLING_NAMES = [f.name for f in dataclasses.fields(SamplingParams)]


def _assert_carriable(value: Any) -> None:
    """What the server accepted can go into a UTF-8 JSON reply."""
    json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")


def _accepted_or_4xx(parse: Any, raw: bytes) -> None:
    try:
        body = parse_body(raw)
        batch = parse(body)
    except ApiError as e:
        assert 400 <= e.status < 500, (e.status, e.message)
        e.message.encode("utf-8")  # the error itself is encodable
        return
    _assert_carriable(body)
    for req in batch.reqs:
        encode(req)  # msgspec: 64-bit ints, encodable strings
        assert req.sampling.n >= 1


# ---------------------------------------------------------------- property tests (no server)


@given(st.binary(max_size=64) | JSON.map(lambda v: json.dumps(v).encode()))
def test_parse_body_refuses_only_with_400(raw: bytes) -> None:
    try:
        body = parse_body(raw)
    except ApiError as e:
        assert e.status == 400
        return
    assert isinstance(body, dict)
    _assert_carriable(body)


@given(_fields(SAMPLING_NAMES))
def test_sampling_params_refuse_only_with_invalid_request(d: dict[str, Any]) -> None:
    try:
        params = SamplingParams.from_dict(d)
    except InvalidRequest as e:
        assert str(e)
        return
    assert SamplingParams.from_dict(params.to_dict()) == params
    assert all(math.isfinite(getattr(params, n)) for n in ("temperature", "top_p", "min_p"))


@given(_fields(GENERATE_FIELDS, SAMPLING_NAMES, ["text", "input_ids"]))
def test_generate_parser(body: dict[str, Any]) -> None:
    _accepted_or_4xx(parse_generate, json.dumps(body).encode())


@given(_fields(COMPLETION_FIELDS, ["prompt"]))
def test_completion_parser(body: dict[str, Any]) -> None:
    _accepted_or_4xx(parse_completion, json.dumps(body).encode())


@given(
    _fields(CHAT_FIELDS),
    st.lists(_fields(["role", "content", "name"]) | st.just({"role": "user", "content": "x"})),
)
def test_chat_parser(body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
    _accepted_or_4xx(parse_chat, json.dumps({**body, "messages": messages}).encode())


def test_openapi_describes_every_field() -> None:
    sampling = set(openapi.SAMPLING_PARAMS["properties"])  # type: ignore[call-overload]
    assert sampling == set(SAMPLING_NAMES)
    for schema, fields in [
        (openapi.GENERATE, GENERATE_FIELDS),
        (openapi.COMPLETION, COMPLETION_FIELDS),
        (openapi.CHAT, CHAT_FIELDS),
    ]:
        assert set(schema["properties"]) == set(fields) | ACCEPTED_IF_EMPTY  # type: ignore[call-overload]


# ---------------------------------------------------------------- schemathesis (real server)


def _bound_lengths(node: Any) -> None:
    """Keep generated requests short for the CI budget: at most 8 new tokens each."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("max_new_tokens", "max_tokens", "max_completion_tokens"):
                for option in value["anyOf"]:
                    if option.get("type") == "integer":
                        option["maximum"] = 8
            else:
                _bound_lengths(value)
    elif isinstance(node, list):
        for value in node:
            _bound_lengths(value)


def _without_pml(document: dict[str, Any]) -> None:
    """Valid bodies only: a `pml` prompt needs a registered schema, which random text never
    names (always a 400; test_server_modules covers it), so drop that branch of each body."""
    for path in document["paths"].values():
        content = path.get("post", {}).get("requestBody", {}).get("content", {})
        for media in content.values():
            body = media["schema"]
            body["properties"].pop("pml", None)
            body["properties"].pop("module_reuse", None)
            if "oneOf" in body:
                body["oneOf"] = [b for b in body["oneOf"] if b["required"] != ["pml"]]


@pytest.mark.parametrize(
    "mode",
    # the positive phase: ~7 s, ~40 s under CI's larger profile
    [
        pytest.param(m, marks=pytest.mark.slow)
        for m in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ],
)
def test_schemathesis_finds_no_5xx(server, mode: GenerationMode) -> None:
    with server.client() as client:
        document = client.get("/openapi.json").json()
        reference = client.post("/generate", json=REFERENCE).json()["output_ids"]
        _bound_lengths(document)
        if mode == GenerationMode.POSITIVE:
            _without_pml(document)
        schema = schemathesis.openapi.from_dict(document).include(
            path_regex=r"^/(generate|v1/completions|v1/chat/completions)$"
        )
        answers: dict[int, int] = {}

        @settings(max_examples=FUZZ_EXAMPLES[mode], suppress_health_check=list(HealthCheck))
        @given(case=schema.as_strategy(generation_mode=mode))
        def call(case: Any) -> None:
            r = case.call(base_url=server.url, headers=server.headers, timeout=60)
            answers[r.status_code] = answers.get(r.status_code, 0) + 1
            where = f"{case.method} {case.path} {case.body!r:.300}"
            assert r.status_code < 500, f"{where} -> {r.status_code} {r.text[:300]}"
            assert "server_error" not in r.text, f"{where} -> an error inside the stream"

        call()
        if mode == GenerationMode.POSITIVE:  # the schema describes what the server serves
            # but not every rule: the rest are 400s (fields of one role only, token ids
            # outside the vocabulary; about 4 in 5 of 300 cases, fewer of the first ones)
            assert answers.get(200, 0) >= sum(answers.values()) // 10, answers
        assert client.get("/health").status_code == 200
        wait_idle(client)
        assert client.post("/generate", json=REFERENCE).json()["output_ids"] == reference
