"""Prompt modules (Prompt Cache) vs full prefill vs the radix cache, and what reuse costs in
quality. In-process Engine (the embedded SmolLM2-135M unless --model), one request at a time
for the timings.

(a) TTFT on long prompts: `--docs` documents (GSM8K train problems concatenated to
    `--doc-tokens` tokens each) are the modules of one schema; each of `--prompts` prompts
    imports a random subset of `--min-docs`..`--max-docs` of them in a random order, plus a
    question. Per prompt, time to the first token (max_new_tokens=1) with
      - module reuse: the modules' K/V is registered once; only the question is computed;
      - full prefill: the expanded prompt (module_reuse=False) on an empty radix cache;
      - radix cache: the expanded prompt with every earlier prompt left in the radix cache
        (it only helps when a prompt starts with the same documents in the same order).
(b) Quality: GSM8K few-shot where each of `--shots` train examples is a module and each of
    `--questions` test questions imports a different random subset of `--shots-per-question`;
    greedy answers with and without module reuse, in one run: accuracy of each, agreement
    (same text, same extracted answer), and the KL divergence of the first token's
    distribution, full prefill || reuse, over the full prefill's top-20 tokens (a token
    missing from reuse's top 20 gets reuse's 20th logprob: an under-estimate).

(c) `--decode` (instead of (a) and (b)): one decode step of `--batch` requests, each
    importing a random `--min-docs`..`--max-docs` of the `--docs` modules in a random order
    (so a module sits at other offsets in different requests), with the tree attention
    backend (a module shared by several requests is one segment, read once per step) and
    the flat one (every request reads all its keys). Per backend: the median of
    `--steps` decode steps' wall time (scheduler steps, after every prompt is prefilled)
    and of the backend's plan and of one layer's attention over the last step's batch, best of
    `--repeats` rounds that interleave the backends, and the K/V rows one layer's
    attention reads in that step.

    python benchmarks/bench_prompt_modules.py --data-path /path/to/gsm8k --json out.json \\
        --plot docs/img/prompt_modules.png
    python benchmarks/bench_prompt_modules.py --data-path /path/to/gsm8k --decode --json d.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path
from typing import Any

import eval_data
import torch
from eval_gsm8k import STOP, extract_answer

from radixserve import Engine
from radixserve.attention.tree_plan import TreePlan
from radixserve.core.batch import ForwardBatch
from radixserve.core.params import SamplingParams
from radixserve.core.request import TokenizedRequest
from radixserve.prompt import pml

FIRST_TOKEN = {"temperature": 0, "max_new_tokens": 1}


def documents(engine: Engine, rows: list[dict[str, Any]], n: int, tokens: int) -> list[str]:
    """n texts of about `tokens` tokens, each made of whole GSM8K problems."""
    docs, i = [], 0
    for _ in range(n):
        parts: list[str] = []
        while len(engine.tokenizer.encode("\n\n".join(parts))) < tokens:
            parts.append(f"Question: {rows[i]['question']}\nAnswer: {rows[i]['answer']}")
            i += 1
        docs.append("\n\n".join(parts) + "\n\n")
    return docs


def ttft(engine: Engine, **kw: Any) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    out = engine.generate(sampling_params=FIRST_TOKEN, **kw)
    assert isinstance(out, dict)
    return time.perf_counter() - start, out["meta_info"]


def bench_ttft(
    engine: Engine, plain: Engine, args: argparse.Namespace, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """(a): `engine` keeps its radix cache across prompts; `plain` has none (full prefill)."""
    docs = documents(engine, rows, args.docs, args.doc_tokens)
    schema = pml.schema("docs", *(pml.module(f"doc{i}", d) for i, d in enumerate(docs)))
    start = time.perf_counter()
    engine.register_schema(schema)
    register_s = time.perf_counter() - start
    rng = random.Random(args.seed)
    out = []
    for p in range(args.prompts):
        picked = rng.sample(range(args.docs), rng.randint(args.min_docs, args.max_docs))
        text = f"Question: {rows[-1 - p]['question']}\nAnswer:"
        prompt = pml.prompt("docs", *(pml.use(f"doc{i}") for i in picked), text)
        expanded = engine.schemas.prompt(prompt).expanded
        full_s, full = ttft(plain, input_ids=expanded)
        radix_s, radix = ttft(engine, pml=prompt, module_reuse=False)  # earlier prompts cached
        reuse_s, reuse = ttft(engine, pml=prompt)
        row = {
            "docs": picked,
            "prompt_tokens": full["prompt_tokens"],
            "full_s": full_s,
            "radix_s": radix_s,
            "radix_cached_tokens": radix["cached_tokens"],
            "reuse_s": reuse_s,
            "reuse_computed_tokens": reuse["prompt_tokens"] - reuse["cached_tokens"],
        }
        out.append(row)
        print(
            f"prompt {p}: {row['prompt_tokens']} tokens, docs {picked}: full {full_s:.2f} s, "
            f"radix {radix_s:.2f} s ({radix['cached_tokens']} cached), reuse "
            f"{reuse_s * 1e3:.0f} ms ({row['reuse_computed_tokens']} computed)",
            flush=True,
        )
    engine.remove_schema("docs")
    summary = {k: statistics.median(r[k] for r in out) for k in ("full_s", "radix_s", "reuse_s")}
    summary["speedup_vs_full"] = summary["full_s"] / summary["reuse_s"]
    summary["speedup_vs_radix"] = summary["radix_s"] / summary["reuse_s"]
    return {"register_s": register_s, "median": summary, "rows": out}


def first_token_kl(full: dict[str, Any], reuse: dict[str, Any]) -> float:
    """KL(full || reuse) of the first output token over the full prefill's top-20 tokens."""
    p = {tok: lp for lp, tok, _ in full["meta_info"]["output_top_logprobs"][0]}
    q = {tok: lp for lp, tok, _ in reuse["meta_info"]["output_top_logprobs"][0]}
    floor = min(q.values())
    return sum(math.exp(lp) * (lp - q.get(tok, floor)) for tok, lp in p.items())


def bench_quality(engine: Engine, args: argparse.Namespace, data: str | None) -> dict[str, Any]:
    """(b): every question imports its own subset of the shots; greedy, both ways at once."""
    train = eval_data.gsm8k(data, "train", args.shots)
    test = eval_data.gsm8k(data, "test", args.questions)
    shots = [
        pml.module(f"shot{i}", f"Question: {r['question']}\nAnswer: {r['answer']}\n\n")
        for i, r in enumerate(train)
    ]
    engine.register_schema(pml.schema("gsm8k", *shots))
    rng = random.Random(args.seed)
    prompts = [
        pml.prompt(
            "gsm8k",
            *(pml.use(f"shot{i}") for i in rng.sample(range(args.shots), args.shots_per_question)),
            f"Question: {row['question']}\nAnswer:",
        )
        for row in test
    ]
    params = {"temperature": 0, "max_new_tokens": args.max_tokens, "stop": STOP}
    runs = {}
    for reuse in (True, False):
        start = time.perf_counter()
        out = engine.generate(
            pml=prompts,
            sampling_params=params,
            module_reuse=reuse,
            return_logprob=True,
            top_logprobs_num=20,
        )
        assert isinstance(out, list)
        runs[reuse] = (out, time.perf_counter() - start)
        engine.flush_cache()
    engine.remove_schema("gsm8k")
    gold = [extract_answer(r["answer"]) for r in test]
    answers = {k: [extract_answer(o["text"]) for o in v[0]] for k, v in runs.items()}
    n = len(test)
    pairs = list(zip(runs[True][0], runs[False][0]))
    kls = [first_token_kl(full, reuse) for reuse, full in pairs]
    return {
        "questions": n,
        "accuracy_reuse": sum(a == g for a, g in zip(answers[True], gold)) / n,
        "accuracy_full": sum(a == g for a, g in zip(answers[False], gold)) / n,
        "same_text": sum(a["text"] == b["text"] for a, b in pairs) / n,
        "same_answer": sum(a == b for a, b in zip(answers[True], answers[False])) / n,
        "same_first_token": sum(a["output_ids"][:1] == b["output_ids"][:1] for a, b in pairs) / n,
        "kl_first_token_top20_mean": statistics.mean(kls),
        "kl_first_token_top20_median": statistics.median(kls),
        "wall_s_reuse": runs[True][1],
        "wall_s_full": runs[False][1],
        "prompt_tokens_mean": statistics.mean(
            o["meta_info"]["prompt_tokens"] for o in runs[False][0]
        ),
    }


def rows_read(batch: ForwardBatch) -> int:
    """K/V rows one layer's attention reads in `batch`: every request's keys (flat), or each
    kept segment once plus every private part (tree)."""
    plan = batch.attn_plan
    if not isinstance(plan, TreePlan):
        return sum(batch.seq_lens)
    shared = sum(s.num_tokens for s in plan.segments)
    return shared + sum(batch.seq_lens) - sum(s.num_tokens * len(s.requests) for s in plan.segments)


def decode_steps(engine: Engine, prompts: list[Any], steps: int) -> dict[str, Any]:
    """Prefill `prompts` on `engine`'s scheduler, then time `steps` decode steps."""
    sched = engine.scheduler
    params = SamplingParams(temperature=0, max_new_tokens=steps + 2, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        ids, use = engine.schemas.token_ids(prompt, module_reuse=True)
        sched.add_request(TokenizedRequest(f"decode-{i}", ids, params, modules=use))
    while len(sched.running) < len(prompts) or any(not r.output_ids for r in sched.running):
        sched.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - start)
    batch = sched.last_batch
    assert batch is not None and batch.is_decode and batch.num_requests == len(prompts)
    plan = batch.attn_plan
    segments = plan.segments if isinstance(plan, TreePlan) else []
    out = {
        "step_s_median": statistics.median(times),
        "step_s": times,
        "kv_rows_read": rows_read(batch),
        "kv_rows": sum(batch.seq_lens),
        "segments": [[len(s.requests), s.num_tokens] for s in segments],
    }
    list(sched.run_until_idle())
    out.update(attention_s(engine, batch, steps))
    return out


def attention_s(engine: Engine, batch: ForwardBatch, repeats: int) -> dict[str, float]:
    """Median times of the backend's plan and of one layer's attention over `batch` (random
    q/k/v, layer 0). Its requests have finished: the slots it writes are free ones."""
    mc, backend = engine.worker.model_config, engine.worker.backend
    t, dtype = batch.input_ids.numel(), engine.worker.dtype
    q = torch.randn(t, mc.num_heads, mc.head_dim, dtype=dtype)
    k = torch.randn(t, mc.num_kv_heads, mc.head_dim, dtype=dtype)
    plans, layers = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.plan(batch)
        plans.append(time.perf_counter() - start)
        start = time.perf_counter()
        backend.forward(q, k, k.clone(), 0, batch, mc.head_dim**-0.5)
        layers.append(time.perf_counter() - start)
    return {"plan_s": statistics.median(plans), "layer_s": statistics.median(layers)}


def bench_decode(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """(c): the same prompts, one decode batch, tree vs flat attention; `--repeats` rounds,
    the two backends interleaved in each, the best round's median kept per backend."""
    rng = random.Random(args.seed)
    picks = [
        rng.sample(range(args.docs), rng.randint(args.min_docs, args.max_docs))
        for _ in range(args.batch)
    ]
    prompts = [
        pml.prompt("docs", *(pml.use(f"doc{i}") for i in picked), f"Question {b}:")
        for b, picked in enumerate(picks)
    ]
    engines = {}
    for backend in ("tree", "flat"):
        engine = Engine(args.model, dtype=args.dtype, max_total_tokens=65536,
                        attention_backend=backend)  # fmt: skip
        docs = documents(engine, rows, args.docs, args.doc_tokens)
        schema = pml.schema("docs", *(pml.module(f"doc{i}", d) for i, d in enumerate(docs)))
        engine.register_schema(schema)
        decode_steps(engine, prompts, 2)  # warm up: first steps pay one-time costs
        engines[backend] = engine
    out: dict[str, Any] = {"batch": args.batch, "imports": picks, "rounds": []}
    for r in range(args.repeats):
        runs = {name: decode_steps(e, prompts, args.steps) for name, e in engines.items()}
        out["rounds"].append(runs)
        for name, run in runs.items():
            print(
                f"round {r} {name}: decode step {run['step_s_median'] * 1e3:.1f} ms, plan "
                f"{run['plan_s'] * 1e3:.2f} ms, one layer's attention "
                f"{run['layer_s'] * 1e3:.2f} ms (medians of {args.steps}), "
                f"K/V rows read per layer {run['kv_rows_read']} of "
                f"{run['kv_rows']}, segments (requests, tokens) {run['segments']}",
                flush=True,
            )
    for name, engine in engines.items():
        engine.check_integrity()
        for key in ("step_s_median", "plan_s", "layer_s"):
            out[f"{name}_{key}"] = min(r[name][key] for r in out["rounds"])
    out["speedup"] = out["flat_step_s_median"] / out["tree_step_s_median"]
    out["layer_speedup"] = out["flat_layer_s"] / out["tree_layer_s"]
    print(
        f"best of {args.repeats}: decode step tree {out['tree_step_s_median'] * 1e3:.1f} ms, "
        f"flat {out['flat_step_s_median'] * 1e3:.1f} ms (tree {out['speedup']:.2f}x); one "
        f"layer's attention tree {out['tree_layer_s'] * 1e3:.2f} ms, flat "
        f"{out['flat_layer_s'] * 1e3:.2f} ms (tree {out['layer_speedup']:.2f}x); plan tree "
        f"{out['tree_plan_s'] * 1e3:.2f} ms, flat {out['flat_plan_s'] * 1e3:.2f} ms",
        flush=True,
    )
    return out


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(result["ttft"]["rows"], key=lambda r: r["prompt_tokens"])
    fig, ax = plt.subplots(figsize=(7, 4))
    x = [r["prompt_tokens"] for r in rows]
    for key, label, marker in (
        ("full_s", "full prefill", "s"),
        ("radix_s", "radix cache", "^"),
        ("reuse_s", "prompt modules", "o"),
    ):
        ax.plot(x, [r[key] for r in rows], marker=marker, linestyle="", label=label)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens (modules + question)")
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title(f"TTFT, SmolLM2-135M, {result['machine']}", fontsize=9)
    ax.legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-path", default=None, help="GSM8K folder (train/test.jsonl)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=800)
    ap.add_argument("--min-docs", type=int, default=5)
    ap.add_argument("--max-docs", type=int, default=7)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--shots", type=int, default=32)
    ap.add_argument("--shots-per-question", type=int, default=8)
    ap.add_argument("--questions", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--decode", action="store_true", help="(c) only: tree vs flat decode")
    ap.add_argument("--batch", type=int, default=16, help="(c): requests in the decode batch")
    ap.add_argument("--steps", type=int, default=10, help="(c): decode steps timed")
    ap.add_argument("--repeats", type=int, default=3, help="(c): interleaved rounds")
    ap.add_argument("--machine", default="this machine", help="label for the plot title")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = eval_data.gsm8k(args.data_path, "train")
    if args.decode:
        result = {"machine": args.machine, "threads": torch.get_num_threads(), "args": vars(args)}
        result["decode"] = bench_decode(args, rows)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
        return result
    engine = Engine(args.model, dtype=args.dtype, max_total_tokens=65536)
    plain = Engine(args.model, dtype=args.dtype, max_total_tokens=16384, disable_radix_cache=True)
    for e in (engine, plain):  # first calls pay one-time costs (kernel builds, allocations)
        e.generate(" ".join(["warm up"] * 300), FIRST_TOKEN)
    result: dict[str, Any] = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "machine": args.machine,
        "dtype": str(engine.worker.dtype),
        "threads": torch.get_num_threads(),
        "args": vars(args),
        "ttft": bench_ttft(engine, plain, args, rows),
    }
    print(json.dumps(result["ttft"]["median"], indent=1), flush=True)
    if not args.skip_quality:
        result["quality"] = bench_quality(engine, args, args.data_path)
        print(json.dumps(result["quality"], indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, Path(args.plot))
    return result


if __name__ == "__main__":
    main()
