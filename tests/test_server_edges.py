"""Edges of the HTTP API on the real server: every bad request is a 400 naming its field,
auth, body limit, client disconnects abort, and a storm of bad / aborted / disconnected
requests next to good ones leaks no KV and does not change the good outputs."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from conftest import API_KEY, ServerHandle, wait_idle

GREEDY = {"temperature": 0, "max_new_tokens": 8}
LONG = {"temperature": 0, "max_new_tokens": 600, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def server_info(client: httpx.Client) -> dict:
    r = client.get("/get_server_info")
    assert r.status_code == 200, r.text
    return r.json()


def assert_kv_fully_free(client: httpx.Client) -> None:
    wait_idle(client)
    r = client.post("/flush_cache", json={})
    assert r.status_code == 200, r.text
    s = server_info(client)["scheduler"]
    assert s["kv_used_tokens"] == 0, s
    assert s["kv_free_tokens"] == s["kv_capacity_tokens"] == 1024


def error_of(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status
    return err["message"]


# ---------------------------------------------------------------- 400s naming the field

BAD_GENERATE = [
    ({"text": "x", "bogus": 1}, "bogus"),
    ({"text": "x", "sampling_params": {"temprature": 0.5}}, "temprature"),
    ({"text": 5}, "text"),
    ({"text": "x", "input_ids": [1]}, "text"),
    ({}, "text"),
    ({"text": ""}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids"),
    ({"text": "x", "stream": "yes"}, "stream"),
    ({"text": "x", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"temperature": -0.1}}, "temperature"),
    ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "x", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": 3}, "sampling_params"),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
    ({"text": "x", "top_logprobs_num": -1}, "top_logprobs_num"),
    ({"text": "x", "lora_path": "adapter"}, "lora_path"),
    ({"input_ids": [10**9]}, "input_ids"),
    ({"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100}}, "max_new_tokens"),
]


@pytest.mark.parametrize(("body", "field"), BAD_GENERATE)
def test_bad_generate_is_400_naming_the_field(client, body, field):
    assert field in error_of(client.post("/generate", json=body))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"text": "x", "stream": True, "bogus": 1}, "bogus"),
        (
            {"input_ids": [1] * 1000, "stream": True, "sampling_params": {"max_new_tokens": 100}},
            "max_new_tokens",
        ),
    ],
)
def test_bad_streaming_request_is_a_plain_400(client, body, field):
    assert field in error_of(client.post("/generate", json=body))


def test_invalid_json_and_non_object_body(client):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert "invalid JSON" in error_of(r)
    assert "JSON object" in error_of(client.post("/generate", json=[1, 2]))


def test_bench_serving_payload_is_accepted(client):
    """SGLang's bench_serving sends these extra fields, empty."""
    body = {
        "text": "bench",
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True},
        "stream": False,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
        "image_data": None,
    }
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 3


def test_openai_bad_fields(client):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({**base, "temperature": -1}, "temperature"),
        ({**base, "top_p": 2}, "top_p"),
        ({**base, "max_tokens": -3}, "max_tokens"),
        ({**base, "n": 0}, "n"),
        ({**base, "bogus": 1}, "bogus"),
        ({**base, "top_logprobs": 3}, "top_logprobs"),
        ({**base, "messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({**base, "max_tokens": 5000}, "max_tokens"),
    ]
    for body, field in cases:
        assert field in error_of(client.post("/v1/chat/completions", json=body)), body
    assert "prompt" in error_of(client.post("/v1/completions", json={"model": "m", "prompt": ""}))


# ---------------------------------------------------------------- auth and body size


def test_api_key_required_except_health(server):
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        assert anon.get("/health").status_code == 200
        for method, path in [
            ("POST", "/generate"),
            ("GET", "/get_model_info"),
            ("GET", "/get_server_info"),
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("GET", "/flush_cache"),
            ("GET", "/health_generate"),
        ]:
            r = anon.request(method, path, json={"text": "x"} if method == "POST" else None)
            assert r.status_code == 401, (path, r.status_code)
            assert "API key" in r.json()["error"]["message"]
        wrong = anon.get("/get_model_info", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = anon.get("/get_model_info", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200


def test_body_size_limit(client):
    big = b'{"text": "' + b"a" * (9 * 2**20) + b'"}'
    r = client.post("/generate", content=big, headers={"content-type": "application/json"})
    assert "exceeds the limit" in error_of(r, 413)


# ---------------------------------------------------------------- disconnects and the storm


def test_client_disconnect_mid_stream_aborts_and_frees_kv(client, server):
    before = server_info(client)["scheduler"]["generation_tokens_total"]
    body = {"text": "disconnect me", "rid": "gone", "stream": True, "sampling_params": LONG}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        with c.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            # The connection is closed after the first chunk, with the scheduler stopped
            # until the abort is sent: it must stop the request, not let it run its 600
            # tokens, however fast this machine decodes.
            with server.scheduler_stopped():
                r.close()
                server.wait_aborts_sent([body["rid"]])
    wait_idle(client, deadline_s=30)
    generated = server_info(client)["scheduler"]["generation_tokens_total"] - before
    assert generated < 300, generated
    assert_kv_fully_free(client)


STORM_PROMPTS = [
    "You are a helpful assistant. Answer briefly. Question: what is one plus one?",
    "You are a helpful assistant. Answer briefly. Question: name a color.",
    "Tell me a story about a dragon",
    "Résumé: 日本語のテキスト and emoji 🙂",
]


async def _storm(server: ServerHandle) -> tuple[list[list[int]], int]:
    """Run good requests next to bad, aborted and disconnected ones; return the good
    outputs (output_ids, in STORM_PROMPTS order) and the number of 400 answers.

    Everything is sent while the scheduler is stopped, until the clients that give up have
    timed out and their requests have been aborted (so those timeouts are reached on any
    machine); then the scheduler receives it all at once."""
    async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:

        async def good(prompt: str, stream: bool) -> list[int]:
            body = {"text": prompt, "sampling_params": GREEDY, "stream": stream}
            if not stream:
                r = await c.post("/generate", json=body)
                assert r.status_code == 200, r.text
                return r.json()["output_ids"]
            last = None
            async with c.stream("POST", "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        last = json.loads(line[6:])
            return last["output_ids"]

        async def bad(body: dict) -> int:
            return (await c.post("/generate", json=body)).status_code

        async def aborted(rid: str) -> str:
            body = {"text": f"abort {rid}", "rid": rid, "stream": True, "sampling_params": LONG}
            last = None
            async with c.stream("POST", "/generate", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        if last is None:
                            await c.post("/abort_request", json={"rid": rid})
                        last = json.loads(line[6:])
            return last["meta_info"]["finish_reason"]["type"]

        async def disconnected_stream(k: int) -> None:
            body = {"text": f"gone {k}", "stream": True, "sampling_params": LONG}
            async with c.stream("POST", "/generate", json=body) as r:
                async for _ in r.aiter_lines():
                    break  # leave after the first line: closes the connection

        async def disconnected_plain(k: int) -> None:
            body = {"text": f"impatient {k}", "rid": f"impatient-{k}", "sampling_params": LONG}
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/generate", json=body, timeout=1.0)

        bad_bodies = [body for body, _ in BAD_GENERATE[:8]] + [
            {"input_ids": [1] * 1000, "sampling_params": {"max_new_tokens": 100}}
        ]
        goods = [good(p, stream=k % 2 == 1) for k, p in enumerate(STORM_PROMPTS)]
        others = (
            [bad(b) for b in bad_bodies]
            + [aborted(f"storm-abort-{k}") for k in range(2)]
            + [disconnected_stream(k) for k in range(2)]
        )
        with server.scheduler_stopped():
            tasks = [asyncio.ensure_future(x) for x in (*goods, *others)]
            await asyncio.gather(*(disconnected_plain(k) for k in range(2)))
            rids = [f"impatient-{k}" for k in range(2)]
            await asyncio.to_thread(server.wait_aborts_sent, rids)
        results = await asyncio.gather(*tasks)
        statuses = results[len(goods) : len(goods) + len(bad_bodies)]
        aborts = results[len(goods) + len(bad_bodies) : len(goods) + len(bad_bodies) + 2]
        assert aborts == ["abort", "abort"]
        return list(results[: len(goods)]), sum(s == 400 for s in statuses)


def test_storm_leaks_nothing_and_good_outputs_match_alone(client, server):
    assert_kv_fully_free(client)
    alone = []
    for p in STORM_PROMPTS:  # each request alone, on an empty cache
        r = client.post("/generate", json={"text": p, "sampling_params": GREEDY})
        alone.append(r.json()["output_ids"])
        assert_kv_fully_free(client)
    before = server_info(client)["scheduler"]["generation_tokens_total"]
    outputs, n_400 = asyncio.run(_storm(server))
    assert n_400 == 9
    assert outputs == alone
    info = wait_idle(client)
    # Aborted and disconnected requests stopped early: far below their 6 x 600 tokens.
    generated = info["scheduler"]["generation_tokens_total"] - before
    assert generated < 6 * 600 // 2, generated
    assert_kv_fully_free(client)
    # And the server still works normally afterwards.
    r = client.post("/generate", json={"text": STORM_PROMPTS[0], "sampling_params": GREEDY})
    assert r.json()["output_ids"] == alone[0]
