"""benchmarks/bench_serving.py (datasets, metrics, runs against the real server on loopback),
benchmarks/plot.py (PNGs from synthetic and real results), and eval_code over HTTP (it
needs a server, and this file has one running)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import bench_serving as bs
import eval_code as ec
import eval_data
import plot
import pytest
from conftest import API_KEY, ServerHandle
from sandbox import Limits

ROOT = Path(__file__).resolve().parents[1]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- datasets


def sharegpt_file(tmp_path: Path) -> Path:
    convs: list[dict[str, Any]] = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"Question {i}: why is the sky blue? Explain briefly."},
                {"from": "gpt", "value": "Rayleigh scattering of sunlight. " * (i + 1)},
            ],
        }
        for i in range(6)
    ]
    convs.append({"id": "gpt-first", "conversations": [{"from": "gpt", "value": "x " * 20}]})
    convs.append({"id": "alone", "conversations": [{"from": "human", "value": "no reply here"}]})
    convs.append(
        {
            "id": "short",
            "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hey"}],
        }
    )
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    return path


def test_sharegpt_loader_filters_and_measures_reply_lengths(tmp_path: Path, tokenizer) -> None:
    path = sharegpt_file(tmp_path)
    data = eval_data.sharegpt(str(path))
    work = bs.load_sharegpt(data, 100, tokenizer, None, 1024, seed=0)
    # Only the 6 well-formed conversations with >= 4 prompt and reply tokens survive.
    assert len(work) == 6 and all(len(c) == 1 for c in work)
    texts = {c[0].text for c in work}
    assert texts == {f"Question {i}: why is the sky blue? Explain briefly." for i in range(6)}
    for conv in work:
        i = int(conv[0].text.split()[1].rstrip(":"))
        reply = "Rayleigh scattering of sunlight. " * (i + 1)
        assert conv[0].output_len == len(tokenizer.encode(reply, add_special_tokens=False))
    capped = bs.load_sharegpt(data, 2, tokenizer, 7, 1024, seed=0)
    assert len(capped) == 2 and all(c[0].output_len == 7 for c in capped)
    assert bs.load_sharegpt(data, 6, tokenizer, None, 1024, seed=1) != work  # shuffled by seed


def test_generated_shared_prefix_groups_share_exactly_their_system_prompt(tokenizer) -> None:
    work = bs.load_shared_prefix(tokenizer, 3, 4, 40, 8, 5, seed=0)
    assert len(work) == 12 and all(c[0].output_len == 5 for c in work)
    systems = [c[0].text.split("\n")[0] for c in work]
    assert len(set(systems)) == 3 and all(systems.count(s) == 4 for s in set(systems))
    assert len({c[0].text for c in work}) == 12  # questions differ
    for s in set(systems):
        assert 30 <= len(tokenizer.encode(s, add_special_tokens=False)) <= 50, s


def test_random_and_multi_turn_workloads(tokenizer) -> None:
    work = bs.load_random(tokenizer, 20, 32, 16, 0.5, seed=3)
    assert len(work) == 20 and all(8 <= c[0].output_len <= 16 for c in work)
    assert all(c[0].text for c in work)
    assert work == bs.load_random(tokenizer, 20, 32, 16, 0.5, seed=3)  # deterministic
    convs = bs.load_multi_turn(tokenizer, 2, 3, 10, 4, seed=0)
    assert [len(c) for c in convs] == [3, 3] and all(t.output_len == 4 for c in convs for t in c)


def test_multi_turn_prompt_carries_the_conversation_so_far() -> None:
    conv = [bs.Turn("hi", 4), bs.Turn("and then?", 4), bs.Turn("bye", 4)]
    assert bs.prompt_of(conv, [], 0, multi=True) == "User: hi\nAssistant:"
    assert bs.prompt_of(conv, [" A", " B"], 2, multi=True) == (
        "User: hi\nAssistant: A\nUser: and then?\nAssistant: B\nUser: bye\nAssistant:"
    )
    assert bs.prompt_of(conv, [" A"], 1, multi=False) == "and then?"


# ---------------------------------------------------------------- metrics


def test_summarize_exact_values() -> None:
    r1 = bs.Result(0, 0, ok=True, prompt_tokens=10, output_tokens=4, cached_tokens=5,
                   ttft=0.1, e2e=0.4, itls=[0.1, 0.1, 0.1])  # fmt: skip
    r2 = bs.Result(1, 0, ok=True, prompt_tokens=20, output_tokens=2, cached_tokens=0,
                   ttft=0.2, e2e=0.3, itls=[0.1])  # fmt: skip
    r3 = bs.Result(2, 0, error="HTTP 500")
    s = bs.summarize([r1, r2, r3], 2.0, counters=None)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500"])
    assert s["request_throughput"] == pytest.approx(1.0)
    assert (s["input_tok_s"], s["output_tok_s"], s["total_tok_s"]) == pytest.approx((15, 3, 18))
    assert s["concurrency"] == pytest.approx(0.35)
    assert (s["cache_hit_rate"], s["cache_hit_source"]) == (pytest.approx(5 / 30), "responses")
    # numpy's linear percentiles of [100, 200] ms
    assert s["ttft_ms"] == pytest.approx({"mean": 150, "p50": 150, "p90": 190, "p99": 199})
    assert s["itl_ms"] == pytest.approx({"mean": 100, "p50": 100, "p90": 100, "p99": 100})
    assert s["tpot_ms"]["mean"] == pytest.approx(100)  # (0.4-0.1)/3 and (0.3-0.2)/1
    assert s["e2e_ms"]["p50"] == pytest.approx(350)
    r2.cached_tokens = None  # a server that does not report: fall back to /metrics deltas
    s = bs.summarize([r1, r2], 2.0, counters=(100.0, 25.0))
    assert (s["cache_hit_rate"], s["cache_hit_source"]) == (0.25, "metrics")
    assert bs.summarize([r1, r2], 2.0, counters=None)["cache_hit_rate"] is None


# ---------------------------------------------------------------- against the real server


def run_bench(server: ServerHandle, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = tmp_path / "bench.json"
    argv = ["--base-url", server.url, "--api-key", API_KEY, "--disable-tqdm"]
    result = bs.main([*argv, "--output-json", str(out), *extra])
    assert json.loads(out.read_text())["completed"] == result["completed"]
    return result


def check_latencies(r: dict[str, Any]) -> None:
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        st = r[key]
        assert 0 < st["p50"] <= st["p90"] <= st["p99"], (key, st)
    assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]


def test_shared_prefix_run_streams_and_hits_the_cache(server, tmp_path: Path) -> None:
    r = run_bench(
        server, tmp_path, "--dataset", "generated-shared-prefix", "--gsp-groups", "2",
        "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "96",
        "--gsp-question-len", "8", "--gsp-output-len", "6", "--max-concurrency", "1",
        "--flush-cache", "--output-details",
    )  # fmt: skip
    assert (r["completed"], r["failed"]) == (8, 0)
    assert r["output_tokens"] == 8 * 6  # ignore_eos: exactly the asked length
    assert all(len(q["itls"]) == 5 for q in r["requests"])  # one event per token after the 1st
    check_latencies(r)
    # One at a time from a flushed cache: the first prompt of each group misses, the other
    # three reuse the group's ~96-token system prompt (of ~105 prompt tokens).
    assert sum(q["cached_tokens"] == 0 for q in r["requests"]) == 2
    assert sum(q["cached_tokens"] >= 90 for q in r["requests"]) == 6
    assert r["cache_hit_source"] == "responses" and 0.5 < r["cache_hit_rate"] < 0.75


def test_multi_turn_run_sends_turns_in_order(server, tmp_path: Path) -> None:
    r = run_bench(
        server, tmp_path, "--dataset", "multi-turn", "--mt-conversations", "2",
        "--mt-turns", "3", "--mt-question-len", "12", "--mt-output-len", "4",
        "--request-rate", "50", "--output-details",
    )  # fmt: skip
    assert (r["completed"], r["failed"]) == (6, 0)
    by_conv: dict[int, list[dict]] = {}
    for q in r["requests"]:
        by_conv.setdefault(q["conv"], []).append(q)
    for turns in by_conv.values():
        assert [t["turn"] for t in turns] == [0, 1, 2]
        lens = [t["prompt_tokens"] for t in turns]
        assert lens[0] < lens[1] < lens[2], lens  # each prompt holds the history
        # later turns find the earlier conversation (prompt and answer) in the cache
        assert all(t["cached_tokens"] >= prev for t, prev in zip(turns[1:], lens[:-1])), turns


def test_openai_backend_against_our_server(server, tmp_path: Path, tiny_model_dir) -> None:
    r = run_bench(
        server, tmp_path, "--backend", "openai", "--tokenizer", str(tiny_model_dir),
        "--dataset", "random", "--num-prompts", "4", "--random-input-len", "24",
        "--random-output-len", "5", "--random-range-ratio", "1.0", "--max-concurrency", "2",
    )  # fmt: skip
    assert (r["completed"], r["failed"]) == (4, 0)
    assert r["output_tokens"] == 4 * 5  # from the usage chunk
    assert r["config"]["model"] == str(tiny_model_dir)  # asked of /v1/models
    check_latencies(r)
    # the usage's prompt_tokens_details.cached_tokens gives the hit rate
    assert r["cache_hit_source"] == "responses" and 0.0 <= r["cache_hit_rate"] <= 1.0


def test_run_is_bounded_by_max_duration(server, tmp_path: Path) -> None:
    r = run_bench(
        server, tmp_path, "--dataset", "random", "--num-prompts", "30",
        "--random-input-len", "16", "--random-output-len", "400", "--random-range-ratio", "1.0",
        "--max-concurrency", "1", "--max-duration", "1.0", "--warmup-requests", "0",
    )  # fmt: skip
    # every request either finished before --max-duration or was cancelled then
    assert r["completed"] < 30 and r["failed"] >= 1 and r["completed"] + r["failed"] == 30, r
    assert r["errors"] == ["cancelled at --max-duration"]


# ---------------------------------------------------------------- eval_code over HTTP


def test_eval_code_over_http(server, tokenizer) -> None:
    fixture = ROOT / "benchmarks" / "data" / "apps_fixture.jsonl"
    problems = ec.apps_problems(eval_data.apps(str(fixture), limit=3))
    cfg = ec.EvalConfig(k=2, max_new_tokens=8, batch_problems=2, limits=Limits(wall_s=5))
    chat = ec.server_chat_template(server.url, API_KEY)  # the server's tokenizer's template
    r = ec.run_eval(ec.http_generator(server.url, API_KEY), problems, cfg, chat)
    assert (r["problems"], r["samples_per_problem"]) == (3, 2)
    assert [p["n"] for p in r["per_problem"]] == [2, 2, 2]
    assert r["pass@1"] == 0.0 and r["pass@2"] == 0.0  # a random tiny model's code fails
    assert 0 < r["output_tokens"] <= 3 * 2 * 8
    prompts = [ec.render(p, "chat", chat) for p in problems]
    assert prompts[0].startswith("<|im_start|>")  # SmolLM2's ChatML template was used
    shared = len(tokenizer.encode(os.path.commonprefix(prompts)))
    assert shared > 50 and r["cached_tokens"] >= 3 * (shared - 1), (shared, r["cached_tokens"])


# ---------------------------------------------------------------- plots


def test_plots_from_synthetic_results(tmp_path: Path) -> None:
    rows = [
        {"batch": b, "prefix": p, "backend": be, "decode_tok_s": 100.0 * b / (1 + p / 1024)}
        for b in (1, 16)
        for p in (256, 1024, 4096)
        for be in ("tree", "flat", "hf")
    ]
    (tmp_path / "sp.json").write_text(json.dumps({"rows": rows}))
    serving = []
    for label in ("tree", "flat"):
        for rate in (1.0, 2.0, float("inf")):
            stats = {"mean": 10.0, "p50": 10.0 * rate if rate < 10 else 50.0, "p90": 60.0,
                     "p99": 80.0}  # fmt: skip
            run = {"config": {"request_rate": rate, "backend": "radixserve", "label": label},
                   "request_throughput": 3.5, "ttft_ms": stats, "itl_ms": stats,
                   "e2e_ms": stats}  # fmt: skip
            path = tmp_path / f"serving-{label}-{rate}.json"
            path.write_text(json.dumps(run))
            serving.append(str(path))
    out_dir = tmp_path / "img"
    written = plot.main(["--shared-prefix", str(tmp_path / "sp.json"), "--serving", *serving,
                         "--out-dir", str(out_dir)])  # fmt: skip
    assert [p.name for p in written] == ["throughput_vs_prefix.png", "latency_vs_rate.png"]
    for p in written:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, (p, len(data))


def test_plot_of_samples_mode_rows_and_of_a_real_serving_run(server, tmp_path: Path) -> None:
    rows = [{"batch": 8, "prefix": p, "backend": be, "wall_s": 1.0, "tok_s": float(p)}
            for p in (0, 512) for be in ("tree", "hf")]  # fmt: skip
    png = plot.plot_shared_prefix(rows, tmp_path / "samples.png")
    assert png.read_bytes().startswith(PNG_MAGIC)
    argv = ["--dataset", "random", "--num-prompts", "3", "--random-input-len", "16"]
    r = run_bench(server, tmp_path, *argv, "--random-output-len", "4", "--label", "tree")
    png = plot.plot_latency_vs_rate([r], tmp_path / "latency.png")
    assert png.read_bytes().startswith(PNG_MAGIC)
