"""A hostile client against the real server: ~200 malformed or extreme requests across
/generate, /v1/completions and /v1/chat/completions (integers past 64 bits, 5000-digit
literals, NaN / Infinity / 1e400, 100k-deep JSON, lone UTF-16 surrogates in every kind of
string, oversized lists, tiny temperatures and penalties, patterns that explode or nest)
must each get a 4xx naming the problem, or be served (200) when they are merely extreme;
never a 5xx, a dropped connection or a hang. Afterwards the server is alive, holds nothing,
and a reference greedy prompt gives the same output as before. A request that fails in the
middle of a step fails alone while a concurrent greedy request completes unchanged."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from conftest import poll_until, wait_idle

REFERENCE = {
    "text": "The reference prompt for adversarial runs",
    "sampling_params": {"temperature": 0, "max_new_tokens": 12},
}
LONE = "\ud800"  # a lone UTF-16 surrogate: json.dumps writes it as the escape "\ud800"
HUGE = 2**64
DIGITS_5000 = "9" * 5000

ROUTES = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
    },
}


def _set(body: dict, path: tuple, value: object) -> dict:
    """A deep copy of `body` with `value` at `path` (keys / list indices)."""
    out = json.loads(json.dumps(body))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


def _sampling(route: str, name: str) -> tuple:
    """Where a sampling parameter goes in a body of `route` (OpenAI names it at the top)."""
    if route == "/generate":
        return ("sampling_params", "max_new_tokens" if name == "max_tokens" else name)
    return ("max_tokens",) if name == "max_new_tokens" else (name,)


def malformed() -> list[tuple[str, bytes, str]]:
    """(route, raw body, what it is) of each request that must be a 4xx."""
    cases: list[tuple[str, object, str]] = []
    ints = ["max_new_tokens", "top_k", "seed", "n", "min_new_tokens"]
    floats = ["temperature", "top_p", "min_p", "frequency_penalty", "repetition_penalty"]
    for route, base in ROUTES.items():
        for name in ints:
            path = _sampling(route, name)
            cases += [(route, _set(base, path, HUGE), f"{name} 2**64")]
            cases += [(route, _set(base, path, -(2**63) - 1), f"{name} below int64")]
            cases += [(route, _set(base, path, 10**400), f"{name} 10**400")]
            cases += [
                (
                    route,
                    json.dumps(_set(base, path, 0)).replace(
                        f'"{path[-1]}": 0', f'"{path[-1]}": {DIGITS_5000}'
                    ),
                    f"{name} 5000 digits",
                )
            ]
        for name in floats:
            path = _sampling(route, name)
            raw = json.dumps(_set(base, path, 0.5))
            for literal in ("1e400", "-1e400", "NaN", "Infinity"):
                cases += [
                    (
                        route,
                        raw.replace(f'"{path[-1]}": 0.5', f'"{path[-1]}": {literal}'),
                        f"{name} {literal}",
                    )
                ]
            cases += [(route, _set(base, path, 10**400), f"{name} 10**400 as an int")]
        cases += [
            (
                route,
                _set(base, _sampling(route, "repetition_penalty"), 1e-40),
                "repetition_penalty 1e-40",
            )
        ]
        cases += [
            (route, _set(base, _sampling(route, "stop_token_ids"), [HUGE]), "stop_token_ids 2**64")
        ]
        cases += [
            (
                route,
                _set(base, _sampling(route, "stop_token_ids"), [1] * 5000),
                "5000 stop_token_ids",
            )
        ]
        cases += [(route, _set(base, _sampling(route, "stop"), ["x"] * 1000), "1000 stop strings")]
        cases += [(route, _set(base, _sampling(route, "stop"), [LONE]), "surrogate stop")]
        cases += [(route, _set(base, ("rid",), LONE), "surrogate rid")]
        cases += [(route, _set(base, ("rid",), "r" * 5000), "5000-character rid")]
        cases += [(route, _set(base, (LONE,), 1), "surrogate unknown key")]
        cases += [(route, _set(base, ("bogus" + LONE,), LONE), "surrogate unknown key+value")]
        deep = '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"
        cases += [(route, deep, "100k-deep JSON"), (route, "[" * 100_000, "100k unclosed")]
        cases += [(route, _set(base, ("x",), [[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]), "20-deep")]
        cases += [
            (route, "{" + '"a":1,' * 3 + "}", "invalid JSON"),
            (route, "[1]", "not an object"),
        ]
        cases += [(route, b'{"text": "\xff\xfe"}', "invalid UTF-8")]
    gen, cmpl, chat = ROUTES.values()
    cases += [
        ("/generate", _set(gen, ("text",), LONE), "surrogate text"),
        ("/generate", _set(gen, ("text",), ["a", LONE]), "surrogate in a batch"),
        ("/generate", {"input_ids": [1, HUGE]}, "input_ids 2**64"),
        ("/generate", {"input_ids": [[1], [2, -(2**70)]]}, "batched input_ids -2**70"),
        (
            "/generate",
            {"input_ids": [1, 2], "logprob_start_len": HUGE, "return_logprob": True},
            "logprob_start_len 2**64",
        ),
        (
            "/generate",
            {"text": "hi", "top_logprobs_num": HUGE, "return_logprob": True},
            "top_logprobs_num 2**64",
        ),
        ("/generate", {"text": ["x"] * 5000}, "5000 prompts"),
        ("/generate", {"text": "hi", "stream": True, "rid": LONE}, "stream with a surrogate rid"),
        ("/generate", _set(gen, ("sampling_params", "regex"), "\\\\{100000}"), "regex \\\\{1e5}"),
        ("/generate", _set(gen, ("sampling_params", "regex"), "(a{1000}){1000}"), "nested repeat"),
        ("/generate", _set(gen, ("sampling_params", "regex"), "(" * 3000 + ")" * 3000), "deep re"),
        ("/generate", _set(gen, ("sampling_params", "json_schema"), "[" * 100_000), "schema [*1e5"),
        ("/generate", _set(gen, ("sampling_params", "json_schema"), "[" * 60_000), "schema [*6e4"),
        ("/v1/completions", _set(cmpl, ("prompt",), LONE), "surrogate prompt"),
        ("/v1/completions", _set(cmpl, ("prompt",), [1, HUGE]), "prompt ids 2**64"),
        ("/v1/completions", _set(cmpl, ("logprobs",), HUGE), "logprobs 2**64"),
        ("/v1/completions", _set(cmpl, ("model",), LONE), "surrogate model"),
        ("/v1/completions", _set(cmpl, ("user",), LONE), "surrogate user"),
        ("/v1/chat/completions", _set(chat, ("messages", 0, "content"), LONE), "surrogate msg"),
        (
            "/v1/chat/completions",
            _set(chat, ("messages", 0, "content"), [{"type": "text", "text": LONE}]),
            "surrogate part",
        ),
        (
            "/v1/chat/completions",
            _set(chat, ("messages",), [{"role": "user", "content": "x"}] * 5000),
            "5000 messages",
        ),
        ("/v1/chat/completions", _set(chat, ("model",), LONE), "surrogate model"),
        (
            "/v1/chat/completions",
            _set(chat, ("stream",), True) | {"model": LONE},
            "stream, bad model",
        ),
        (
            "/v1/chat/completions",
            _set(chat, ("top_logprobs",), HUGE) | {"logprobs": True},
            "top_logprobs 2**64",
        ),
        (
            "/v1/chat/completions",
            _set(chat, ("max_completion_tokens",), HUGE),
            "max_completion 2**64",
        ),
    ]
    return [(route, _raw(body), what) for route, body, what in cases]


def _raw(body: object) -> bytes:
    if isinstance(body, bytes):
        return body
    return (body if isinstance(body, str) else json.dumps(body)).encode("utf-8")


EXTREME_BUT_VALID = [  # served (200): nothing is wrong with them, only unusual
    ("/generate", {"text": "hi", "sampling_params": {"temperature": 1e-40, "max_new_tokens": 4}}),
    (
        "/generate",
        {
            "text": "hi",
            "sampling_params": {
                "temperature": 1e-7,
                "top_p": 1e-9,
                "max_new_tokens": 4,
                "seed": 2**63 - 1,
            },
        },
    ),
    (
        "/generate",
        {
            "text": "hi",
            "sampling_params": {
                "repetition_penalty": 0.01,
                "temperature": 100.0,
                "max_new_tokens": 4,
            },
        },
    ),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e-40, "max_tokens": 3, "seed": -(2**63)}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "é 🙂 日本"}],
            "temperature": 1e-30,
            "max_tokens": 3,
            "stream": True,
        },
    ),
]


async def _send_all(url: str, headers: dict, requests: list[tuple[str, bytes]]) -> list:
    """Every request, 8 at a time; each result is (status, body text) or the exception."""
    limits = asyncio.Semaphore(8)
    hdrs = {**headers, "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, headers=hdrs, timeout=60) as c:

        async def one(route: str, raw: bytes) -> tuple[int, str] | BaseException:
            async with limits:
                try:
                    r = await c.post(route, content=raw)
                    return r.status_code, r.text
                except httpx.HTTPError as e:
                    return e

        return await asyncio.gather(*(one(route, raw) for route, raw in requests))


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def test_malformed_requests_are_4xx_and_change_nothing(client, server):
    before = client.post("/generate", json=REFERENCE).json()["output_ids"]
    bad = malformed()
    assert len(bad) >= 200, len(bad)
    good = [(route, _raw(body)) for route, body in EXTREME_BUT_VALID]
    results = asyncio.run(_send_all(server.url, server.headers, [(r, b) for r, b, _ in bad] + good))
    failures = []
    for (route, _, what), res in zip(bad, results):
        if isinstance(res, BaseException):
            failures.append(f"{route} {what}: {res!r}")
        elif not 400 <= res[0] < 500 or "error" not in json.loads(res[1]):
            failures.append(f"{route} {what}: {res[0]} {res[1][:200]}")
    for (route, _), res in zip(good, results[len(bad) :]):
        if isinstance(res, BaseException) or res[0] != 200 or '"error"' in res[1]:
            failures.append(f"{route} extreme but valid: {res!r:.300}")
    assert not failures, "\n".join(failures)
    assert client.get("/health").status_code == 200
    wait_idle(client)
    assert client.post("/generate", json=REFERENCE).json()["output_ids"] == before


def test_errors_name_the_field(client):
    """A few of the above, checked for what the message says."""
    cases = [
        ({"text": "hi", "sampling_params": {"seed": HUGE}}, "sampling_params.seed"),
        ({"input_ids": [1, HUGE]}, "input_ids[1]"),
        ({"text": LONE}, "surrogate"),
        ({"text": "hi", "sampling_params": {"repetition_penalty": 1e-40}}, "repetition_penalty"),
        ({"text": "hi", "sampling_params": {"regex": "(a{1000}){1000}"}}, "regex"),
    ]
    raw = b'{"text": "hi", "sampling_params": {"max_new_tokens": ' + DIGITS_5000.encode() + b"}}"
    for body, field in [*cases, (raw, "5000-digit")]:
        r = client.post(
            "/generate", content=_raw(body), headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)


def test_a_request_failing_mid_step_fails_alone(client, tokenizer):
    """The regex allows only the token "x" first, and min_new_tokens bans "x" (a stop
    token): after its prefill, that request's row has no allowed token. It fails with a
    400 saying so, in the same steps as a long greedy request, which completes with its
    reference output; the server holds nothing afterwards."""
    x = tokenizer.convert_tokens_to_ids("x")
    bad = {
        "text": "isolate me",
        "sampling_params": {
            "regex": "x",
            "min_new_tokens": 1,
            "stop_token_ids": [x],
            "max_new_tokens": 4,
        },
    }
    greedy = {
        "text": "A long greedy neighbour",
        "sampling_params": {"temperature": 0, "max_new_tokens": 900, "ignore_eos": True},
    }
    reference = client.post("/generate", json=greedy).json()["output_ids"]
    got: dict[str, object] = {}

    def run_greedy() -> None:
        got["greedy"] = client.post("/generate", json=greedy).json()["output_ids"]

    def running() -> int:
        return client.get("/get_server_info").json()["scheduler"]["num_running"]

    neighbour = threading.Thread(target=run_greedy)
    neighbour.start()
    # the neighbour is decoding before the bad requests arrive
    poll_until(lambda: running() >= 1 or not neighbour.is_alive(), 60, "the neighbour running")
    assert neighbour.is_alive(), got
    for stream in (False, True):
        r = client.post("/generate", json={**bad, "stream": stream})
        assert r.status_code == 400, r.text
        assert "no token is allowed" in r.json()["error"]["message"]
    # ... and still decoding after them: the requests really overlapped
    assert neighbour.is_alive() and running() >= 1 and "greedy" not in got
    neighbour.join()
    assert got["greedy"] == reference
    wait_idle(client)
