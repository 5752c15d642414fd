"""SGLang-native HTTP API of the real server (tiny random Llama, greedy decoding), checked
field by field: /generate (text, input_ids, batch, n, stream, logprobs, stop strings, stop
tokens), abort, model/server info, flush, health, metrics."""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest
from conftest import poll_until

META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "e2e_latency",
}
LOGPROB_KEYS = {
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
    "output_token_logprobs_length",
}
GREEDY = {"temperature": 0, "max_new_tokens": 6}


def gen(client: httpx.Client, **body) -> dict | list:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def iter_sse(response: httpx.Response):
    """Parsed `data:` events of an SSE response as they arrive; [DONE] as the string."""
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        yield payload if payload == "[DONE]" else json.loads(payload)


def sse(response: httpx.Response) -> list:
    return list(iter_sse(response))


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def test_generate_single_text_fields(client, tokenizer):
    prompt = "The capital of France is"
    out = gen(client, text=prompt, sampling_params=GREEDY)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) == META_KEYS
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["finish_reason"] == {"type": "length", "matched": None}
    assert meta["prompt_tokens"] == len(tokenizer.encode(prompt))
    assert meta["completion_tokens"] == 6 == len(out["output_ids"])
    assert 0 <= meta["cached_tokens"] < meta["prompt_tokens"]
    assert meta["e2e_latency"] > 0
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    # Greedy is deterministic, and the prompt is now cached (all but its last token).
    again = gen(client, text=prompt, sampling_params=GREEDY)
    assert again["output_ids"] == out["output_ids"]
    assert again["meta_info"]["cached_tokens"] == meta["prompt_tokens"] - 1


def test_input_ids_and_rid(client, tokenizer):
    ids = tokenizer.encode("Once upon a time")
    by_text = gen(client, text="Once upon a time", sampling_params=GREEDY)
    by_ids = gen(client, input_ids=ids, sampling_params=GREEDY, rid="my-rid-1")
    assert by_ids["meta_info"]["id"] == "my-rid-1"
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["text"] == by_text["text"]


def test_batch_with_n_is_prompt_major(client):
    prompts = ["alpha beta", "gamma delta"]
    singles = [gen(client, text=p, sampling_params=GREEDY) for p in prompts]
    out = gen(client, text=prompts, rid=["b-0", "b-1"], sampling_params={**GREEDY, "n": 2})
    assert isinstance(out, list) and len(out) == 4
    assert [o["meta_info"]["id"] for o in out] == ["b-0", "b-0", "b-1", "b-1"]
    for k, o in enumerate(out):  # greedy: every sample of a prompt equals the prompt alone
        assert o["output_ids"] == singles[k // 2]["output_ids"]
    # Per-prompt sampling params (list form) apply to their own prompt only.
    per = gen(client, text=prompts, sampling_params=[{**GREEDY, "max_new_tokens": 2}, GREEDY])
    assert [len(o["output_ids"]) for o in per] == [2, 6]


def test_n_greater_than_one_single_prompt_gives_list(client):
    out = gen(client, text="hello", sampling_params={"max_new_tokens": 4, "n": 3, "seed": 7})
    assert isinstance(out, list) and len(out) == 3
    assert all(o["meta_info"]["completion_tokens"] == 4 for o in out)


def test_stream_is_cumulative_and_ends_with_done(client):
    body = {"text": "Streaming test prompt", "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    full = gen(client, **body)
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["text"].startswith(prev["text"])
        assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        assert prev["meta_info"]["finish_reason"] is None
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
    assert last["text"] == full["text"] and last["output_ids"] == full["output_ids"]


def test_stream_batch_chunks_carry_their_index(client):
    body = {"text": ["first prompt", "second prompt"], "sampling_params": GREEDY}
    full = gen(client, **body)
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        events = sse(r)
    assert events[-1] == "[DONE]"
    last: dict[int, dict] = {}
    for e in events[:-1]:
        assert e["index"] in (0, 1)
        if e["index"] in last:  # cumulative per index
            assert e["text"].startswith(last[e["index"]]["text"])
        last[e["index"]] = e
    assert [last[i]["output_ids"] for i in (0, 1)] == [o["output_ids"] for o in full]
    assert all(last[i]["meta_info"]["finish_reason"]["type"] == "length" for i in (0, 1))


def test_logprobs_shapes_and_values(client, tokenizer):
    prompt = "Logprob check prompt"
    n_prompt = len(tokenizer.encode(prompt))
    out = gen(
        client,
        text=prompt,
        sampling_params=GREEDY,
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    assert set(meta) == META_KEYS | LOGPROB_KEYS
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == n_prompt and len(outp) == 6
    assert inp[0][0] is None and inp[0][1] == tokenizer.encode(prompt)[0]
    assert [e[1] for e in inp] == tokenizer.encode(prompt)
    assert [e[1] for e in outp] == out["output_ids"]
    for lp, tid, text in inp[1:] + outp:
        assert lp <= 0 and math.isfinite(lp)
        assert text == tokenizer.decode([tid])
    tops = meta["output_top_logprobs"]
    assert len(tops) == 6 and all(len(t) == 3 for t in tops)
    for chosen, top in zip(outp, tops):
        assert [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
        # Greedy picks the argmax: the chosen token is the top-1, with the same logprob.
        assert top[0][1] == chosen[1] and top[0][0] == pytest.approx(chosen[0], abs=1e-5)
    # Without texts, the text slot is null.
    plain = gen(client, text=prompt, sampling_params=GREEDY, return_logprob=True)
    assert all(e[2] is None for e in plain["meta_info"]["output_token_logprobs"])
    assert plain["meta_info"]["input_token_logprobs"] == []


def test_stream_logprobs_are_incremental_as_sglang_sends_them(client):
    """SGLang's stream: each chunk carries only its NEW output_token_logprobs (and top
    logprobs) and the cumulative output_token_logprobs_length; joined, the chunks give the
    non-streamed lists exactly."""
    body = {
        "text": "Streamed logprobs prompt",
        "sampling_params": {**GREEDY, "max_new_tokens": 12},
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    full = gen(client, **body)["meta_info"]
    assert full["output_token_logprobs_length"] == len(full["output_token_logprobs"]) == 12
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        chunks = [e["meta_info"] for e in sse(r)[:-1]]
    assert len(chunks) >= 2
    joined, joined_top, seen = [], [], 0
    for meta in chunks:
        new = meta["output_token_logprobs"]
        assert meta["output_token_logprobs_length"] == seen + len(new)
        assert len(meta["output_top_logprobs"]) == len(new)
        seen = meta["output_token_logprobs_length"]
        joined += new
        joined_top += meta["output_top_logprobs"]
    # The same tokens; values equal up to the rounding of a cached vs uncached prefix.
    assert [e[1:] for e in joined] == [e[1:] for e in full["output_token_logprobs"]]
    assert [e[0] for e in joined] == pytest.approx(
        [e[0] for e in full["output_token_logprobs"]], abs=1e-4
    )
    assert [[e[1] for e in t] for t in joined_top] == [
        [e[1] for e in t] for t in full["output_top_logprobs"]
    ]


def test_stop_string_is_matched_and_cut(client, tokenizer):
    base = gen(client, text="Stop string probe", sampling_params={**GREEDY, "max_new_tokens": 12})
    ids = base["output_ids"]
    # A stop string spanning the boundary of output tokens 2 and 3.
    a, b = tokenizer.decode(ids[2:3]), tokenizer.decode(ids[3:4])
    stop = (a[-2:] if len(a) >= 2 else a) + b[:1]
    expected = base["text"][: base["text"].index(stop)]
    out = gen(
        client,
        text="Stop string probe",
        sampling_params={**GREEDY, "max_new_tokens": 12, "stop": [stop]},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == expected
    assert stop not in out["text"]


def test_stop_token_id(client, tokenizer):
    base = gen(client, text="Stop token probe", sampling_params={**GREEDY, "max_new_tokens": 8})
    ids = base["output_ids"]
    k = [i for i in range(8) if ids[i] not in ids[:i]][-1]  # the last first-occurrence
    out = gen(
        client,
        text="Stop token probe",
        sampling_params={**GREEDY, "max_new_tokens": 8, "stop_token_ids": [ids[k]]},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert out["output_ids"] == ids[: k + 1]
    assert out["meta_info"]["completion_tokens"] == k + 1
    assert out["text"] == tokenizer.decode(ids[:k])  # the stop token is counted, not shown


def test_abort_request_ends_stream_with_abort(client):
    body = {
        "text": "abort me",
        "rid": "to-abort",
        "stream": True,
        "sampling_params": {"max_new_tokens": 900, "ignore_eos": True, "temperature": 0},
    }
    events: list = []

    def consume() -> None:
        with client.stream("POST", "/generate", json=body) as r:
            for event in iter_sse(r):
                events.append(event)

    t = threading.Thread(target=consume)
    t.start()
    poll_until(lambda: events, 60, "a chunk streamed")
    r = client.post("/abort_request", json={"rid": "to-abort"})
    assert r.status_code == 200 and r.json() == {"success": True}
    t.join(60)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert last["meta_info"]["completion_tokens"] < 900


def test_model_info_health_and_server_info(client, server, tiny_model_dir):
    info = client.get("/get_model_info").json()
    assert info == {
        "model_path": str(tiny_model_dir),
        "tokenizer_path": str(tiny_model_dir),
        "is_generation": True,
    }
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    si = client.get("/get_server_info").json()
    assert si["max_total_tokens"] == 1024 and "api_key" not in si
    sched = si["scheduler"]
    assert sched["kv_capacity_tokens"] == si["model_info"]["kv_capacity_tokens"] == 1024
    assert sched["kv_used_tokens"] + sched["kv_free_tokens"] == 1024


def test_flush_cache_is_post_only(client):
    gen(client, text="fill the cache", sampling_params=GREEDY)
    before = client.get("/get_server_info").json()["scheduler"]
    assert before["kv_used_tokens"] > 0  # the finished request stays in the radix cache
    assert client.get("/flush_cache").status_code == 405  # a link could not flush it
    assert client.get("/get_server_info").json()["scheduler"]["kv_used_tokens"] > 0
    assert client.post("/flush_cache", json={"empty_cache": True}).status_code == 200
    after = client.get("/get_server_info").json()["scheduler"]
    assert after["kv_used_tokens"] == 0 and after["kv_free_tokens"] == 1024
    out = gen(client, text="fill the cache", sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 0  # flushed: nothing to reuse


def test_metrics(client):
    for _ in range(2):  # the second is drafted from the first one's cached output
        gen(client, text="metrics probe", sampling_params=GREEDY)
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    for name in (
        "radixserve_num_running_reqs",
        "radixserve_num_queued_reqs",
        "radixserve_kv_usage",
        "radixserve_cache_hit_rate",
    ):
        assert name in values, name
    assert values["radixserve_prompt_tokens_total"] > 0
    assert values["radixserve_generation_tokens_total"] >= 6
    drafted = values["radixserve_spec_draft_tokens_total"]
    assert drafted >= values["radixserve_spec_accepted_tokens_total"] > 0
    assert 0 <= values["radixserve_cache_hit_rate"] <= 1
    assert values["radixserve_time_to_first_token_seconds_count"] >= 1
    assert values["radixserve_e2e_request_latency_seconds_count"] >= 1
    ttft = values["radixserve_time_to_first_token_seconds_sum"]
    e2e = values["radixserve_e2e_request_latency_seconds_sum"]
    assert 0 < ttft <= e2e


def _prompt_logprobs(client, text: str, start: int) -> list:
    out = gen(
        client,
        text=text,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=start,
        return_text_in_logprobs=True,
    )
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
    return out["meta_info"]["input_token_logprobs"]


def test_prefill_only_prompt_logprobs_from_start_len(client, tokenizer):
    """What SGLang's RuntimeEndpoint.select sends: max_new_tokens 0, prompt logprobs from
    logprob_start_len on (entry i is prompt token start + i)."""
    text = "Prefill only: score these prompt tokens"
    ids = tokenizer.encode(text)
    entries = _prompt_logprobs(client, text, 3)
    assert [e[1] for e in entries] == ids[3:]
    assert [e[2] for e in entries] == [tokenizer.decode([t]) for t in ids[3:]]
    assert all(e[0] is not None and e[0] <= 0 for e in entries)


def test_prompt_logprobs_of_a_cached_prompt(client, tokenizer):
    text = "Cached prompt: score these prompt tokens again"
    ids = tokenizer.encode(text)
    first = _prompt_logprobs(client, text, 3)
    again = _prompt_logprobs(client, text, 3)  # now positions 0..2 come from the cache
    assert [e[1] for e in first] == ids[3:]
    assert [e[1] for e in again] == ids[3:]
