"""Offline throughput: radixserve Engine vs HF transformers `generate`, same model, dtype,
prompts and batch, measured side by side in one run.

Decode throughput = B * (N - 1) / (time for N new tokens - time for 1 new token), so the
prefill is subtracted out on both sides. Every prompt is distinct and the radix cache is
flushed before each timed run, so radixserve gets no cache hit here.

    python benchmarks/bench_offline.py --batch 16 --new-tokens 64 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

QUESTIONS = [
    "Explain how a rainbow forms.",
    "Write a short poem about the sea.",
    "What is the capital of France?",
    "Give three tips for learning to cook.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "What causes the seasons?",
    "Summarise the plot of Romeo and Juliet.",
    "How do vaccines work?",
    "List five fruits and their colours.",
    "What is photosynthesis?",
    "Tell me a fun fact about octopuses.",
    "How does a bicycle stay upright?",
    "Write a haiku about autumn.",
    "What is the difference between weather and climate?",
    "How do bees make honey?",
]


def prompts(engine: Any, batch: int) -> list[str]:
    msgs = [
        [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"}]
        for i in range(batch)
    ]
    return [engine.apply_chat_template(m) for m in msgs]


def time_engine(engine: Any, texts: list[str], n: int) -> float:
    engine.flush_cache()
    t = time.perf_counter()
    engine.generate(texts, {"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
    return time.perf_counter() - t


def time_hf(model: Any, tok: Any, texts: list[str], n: int) -> float:
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **enc,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=tok.pad_token_id or tok.eos_token_id,
        )
    assert out.shape[1] == enc["input_ids"].shape[1] + n
    return time.perf_counter() - t


def long_prompt(engine: Any, tokens: int) -> list[int]:
    """A distinct chat prompt of about `tokens` tokens (GSM8K-like word problems)."""
    body = " ".join(
        f"Question {i}: Tom has {i} apples and buys {i + 3} more. How many?"
        for i in range(tokens // 16)
    )
    ids = engine.tokenizer.encode(engine.apply_chat_template([{"role": "user", "content": body}]))
    return ids[-tokens:]


def cache_hit(engine: Any, tokens: int) -> dict[str, Any]:
    """Time to first token of a long prompt, cold and then again (radix cache hit)."""
    engine.flush_cache()
    ids = long_prompt(engine, tokens)
    greedy1 = {"temperature": 0, "max_new_tokens": 1}
    runs = [engine.generate(input_ids=ids, sampling_params=greedy1)["meta_info"] for _ in range(2)]
    cold, warm = runs[0]["e2e_latency"], runs[1]["e2e_latency"]
    return {
        "prompt_tokens": len(ids),
        "cached_tokens": runs[1]["cached_tokens"],
        "cached_fraction": runs[1]["cached_tokens"] / len(ids),
        "ttft_cold_s": cold,
        "ttft_hit_s": warm,
        "ttft_ratio": cold / warm,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF folder, .gguf or hub id; default: embedded")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--attention-backend", default="tree", choices=["tree", "flat"])
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs per side")
    ap.add_argument("--cache-prompt-tokens", type=int, default=2048)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from radixserve import Engine
    from radixserve.models import resolve_model_path

    engine = Engine(
        args.model,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_total_tokens=args.batch * (args.new_tokens + 128) + 2 * args.cache_prompt_tokens,
    )
    path = resolve_model_path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=engine.worker.dtype).eval()
    texts = prompts(engine, args.batch)
    n = args.new_tokens
    time_engine(engine, texts[:2], 4)  # warm-up both sides
    time_hf(hf, engine.tokenizer, texts[:2], 4)
    res: dict[str, Any] = {
        "batch": args.batch,
        "new_tokens": n,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
    }
    sides = {
        "radixserve": lambda k: time_engine(engine, texts, k),
        "hf": lambda k: time_hf(hf, engine.tokenizer, texts, k),
    }
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.repeats):  # interleaved, best of each: robust to a busy machine
        for side, fn in sides.items():
            for k in (1, n):
                best[side, k] = min(best.get((side, k), float("inf")), fn(k))
    for side in sides:
        t1, tn = best[side, 1], best[side, n]
        res[side] = {
            "t_1": t1,
            "t_n": tn,
            "e2e_tok_s": args.batch * n / tn,
            "decode_tok_s": args.batch * (n - 1) / max(tn - t1, 1e-9),
        }
    res["decode_ratio"] = res["radixserve"]["decode_tok_s"] / res["hf"]["decode_tok_s"]
    res["e2e_ratio"] = res["radixserve"]["e2e_tok_s"] / res["hf"]["e2e_tok_s"]
    print(f"batch {args.batch}, {n} new tokens, {args.dtype}, {res['threads']} threads")
    print(f"{'':12}{'decode tok/s':>14}{'e2e tok/s':>12}")
    for side in ("radixserve", "hf"):
        r = res[side]
        print(f"{side:12}{r['decode_tok_s']:14.1f}{r['e2e_tok_s']:12.1f}")
    print(f"ratio radixserve/hf: decode {res['decode_ratio']:.2f}x, e2e {res['e2e_ratio']:.2f}x")
    hit = res["cache_hit"] = cache_hit(engine, args.cache_prompt_tokens)
    print(
        f"prefix cache: {hit['prompt_tokens']}-token prompt, second request cached "
        f"{hit['cached_tokens']} ({hit['cached_fraction']:.1%}); TTFT cold "
        f"{hit['ttft_cold_s'] * 1e3:.0f} ms, hit {hit['ttft_hit_s'] * 1e3:.0f} ms "
        f"({hit['ttft_ratio']:.1f}x lower)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
