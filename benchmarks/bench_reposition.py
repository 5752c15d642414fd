"""Positional decoupling: truncated multi-turn conversations with and
without `--hicache-reposition`, its saving and its quality cost.

Real ShareGPT conversations (the data and selection of bench_multiturn.py); the history is
the dataset's own turns (user message, reference reply), so both runs see the same prompts.
Each turn sends the chat-template history plus the next user message, **truncated to
`--context-budget` tokens**: the oldest (user, reply) pairs are dropped (the system prompt
stays) until prompt + `--max-new-tokens` fits, and a dropped pair stays dropped. Per turn:
  1. the model answers it (greedy): TTFT, tokens prefilled, the moved tokens;
  2. the turn's reference reply is scored after the prompt (`max_new_tokens` 0, prompt
     logprobs of the reply tokens): its mean NLL per token given the context the cache gave,
     and the scored sequence is the cached history the next turn continues.
Two runs on two engines at once, every turn on one and then the other, so both see the
machine's load alike (the embedded model, fp32; a host tier holding everything, no
prefetch): "recompute" (the flag off: after a truncation everything past the system prompt
is prefilled again) and "reposition" (the kept turns' K/V moved to their new positions).
Reported: tokens prefilled, mean / p99 TTFT, and on the turns whose history was truncated:
mean NLL (and perplexity) of the reference reply and how often the greedy answer is the
same as the recompute run's.

    python benchmarks/bench_reposition.py --conversations 8 --context-budget 512 \\
        --out benchmarks/results/reposition_<cpu>-<isa>_<date>.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import bench_multiturn as mt
import eval_data
import torch

from radixserve import Engine


@dataclass
class Run:
    config: str
    turns: int = 0
    truncated_turns: int = 0  # turns whose history lost its oldest pairs
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens the model computed for the answers
    moved_tokens: int = 0
    # per turn, (conversation, turn) order: truncated?, TTFT, reply NLL sum and tokens, answer
    truncated: list[bool] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    nll: list[tuple[float, int]] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)
    skipped_scores: int = 0  # replies whose tokens did not continue the prompt's

    def summary(self) -> dict[str, Any]:
        t = sorted(self.ttft_s)
        out = {k: v for k, v in asdict(self).items() if k not in _PER_TURN}
        out["mean_ttft_s"] = sum(t) / len(t)
        out["p99_ttft_s"] = t[min(len(t) - 1, int(0.99 * len(t)))]
        cut = [i for i, c in enumerate(self.truncated) if c]
        kept = [i for i, c in enumerate(self.truncated) if not c]
        out["mean_ttft_truncated_s"] = sum(self.ttft_s[i] for i in cut) / max(len(cut), 1)
        out["mean_ttft_untruncated_s"] = sum(self.ttft_s[i] for i in kept) / max(len(kept), 1)
        out["nll_truncated"] = mean_nll([self.nll[i] for i in cut])
        out["nll_all"] = mean_nll(self.nll)
        out["ppl_truncated"] = math.exp(out["nll_truncated"])
        out["ttft_per_turn_s"] = self.ttft_s  # (conversation, turn) order
        return out


_PER_TURN = ("ttft_s", "truncated", "nll", "answers")


def mean_nll(parts: list[tuple[float, int]]) -> float:
    return sum(s for s, _ in parts) / max(sum(n for _, n in parts), 1)


def truncated_history(
    engine: Engine, pairs: list[tuple[str, str]], first: int, user: str, budget: int
) -> tuple[int, list[dict[str, str]], list[int]]:
    """Drop pairs from `first` on until the prompt plus the reply budget fits: (the first
    kept pair, the messages, the prompt's token ids)."""
    while True:
        msgs = [m for u, r in pairs[first:] for m in chat(u, r)] + [chat(user)[0]]
        ids = engine.tokenizer.encode(engine.apply_chat_template(msgs))
        if len(ids) <= budget or first == len(pairs):
            return first, msgs, ids
        first += 1


def chat(user: str, reply: str | None = None) -> list[dict[str, str]]:
    out = [{"role": "user", "content": user}]
    return out if reply is None else [*out, {"role": "assistant", "content": reply}]


def reply_ids(
    engine: Engine, msgs: list[dict[str, str]], reply: str, prompt: list[int]
) -> list[int]:
    """The reference reply's tokens as the template renders them after `prompt` ([] when
    that rendering does not start with the prompt's tokens)."""
    text = engine.tokenizer.apply_chat_template(
        [*msgs, {"role": "assistant", "content": reply}], tokenize=False
    )
    full = engine.tokenizer.encode(text)
    return full[len(prompt) :] if full[: len(prompt)] == prompt else []


def answer(engine: Engine, prompt: list[int], max_new: int, res: Run) -> tuple[list[int], float]:
    """Step 1 of a turn: the greedy answer and its TTFT, counted into `res`."""
    before = engine.scheduler.stats().computed_tokens_total
    params = {"temperature": 0, "max_new_tokens": max_new}
    out = engine.generate(input_ids=prompt, sampling_params=params)
    assert isinstance(out, dict)
    meta = out["meta_info"]
    computed = engine.scheduler.stats().computed_tokens_total - before
    res.prefilled_tokens += computed - (meta["completion_tokens"] - 1)  # less decode steps
    res.prompt_tokens += len(prompt)
    res.moved_tokens += meta["cached_tokens_details"].get("moved", 0)
    return out["output_ids"], meta["first_token_latency"]


def score(engine: Engine, prompt: list[int], ref: list[int]) -> tuple[float, int]:
    """Step 2: the reference reply's NLL after the prompt (sum, tokens)."""
    out = engine.generate(
        input_ids=prompt + ref, sampling_params={"temperature": 0, "max_new_tokens": 0},
        return_logprob=True, logprob_start_len=len(prompt),
    )  # fmt: skip
    assert isinstance(out, dict)
    lps = [e[0] for e in out["meta_info"]["input_token_logprobs"] if e[0] is not None]
    return -sum(lps), len(lps)


def run(
    engines: dict[str, Engine], convs: list[list[tuple[str, str]]], args: argparse.Namespace
) -> dict[str, Run]:
    """Every conversation's turns, interleaved (turn t of each, then t + 1); each turn on
    every engine in turn, which one first alternating (one process: what the first warms,
    such as a new matmul shape, the second finds warm), so both share the load alike."""
    runs = {name: Run(name) for name in engines}
    first = [0] * len(convs)
    per_turn: dict[tuple[str, int, int], tuple[bool, float, tuple[float, int], list[int]]] = {}
    budget = args.context_budget - args.max_new_tokens
    tok = next(iter(engines.values()))
    for turn in range(max(map(len, convs))):
        for i in [i for i, c in enumerate(convs) if turn < len(c)]:
            user, reply = convs[i][turn]
            first[i], msgs, prompt = truncated_history(tok, convs[i][:turn], first[i], user, budget)
            ref = reply_ids(tok, msgs, reply, prompt)
            order = list(engines.items())
            for name, engine in order if (i + turn) % 2 == 0 else order[::-1]:
                res = runs[name]
                output, ttft = answer(engine, prompt, args.max_new_tokens, res)
                res.turns += 1
                res.truncated_turns += first[i] > 0
                res.skipped_scores += not ref
                nll = score(engine, prompt, ref) if ref else (0.0, 0)
                per_turn[(name, i, turn)] = (first[i] > 0, ttft, nll, output)
                mt.drain([engine])
    for name, i, turn in sorted(per_turn):
        cut, ttft, nll, ids = per_turn[(name, i, turn)]
        runs[name].truncated.append(cut)
        runs[name].ttft_s.append(ttft)
        runs[name].nll.append(nll)
        runs[name].answers.append(ids)
    for engine in engines.values():
        engine.check_integrity()
    return runs


def agreement(a: Run, b: Run) -> dict[str, float]:
    """On the truncated turns: answers equal token for token, and the mean share of the
    longer answer's tokens before the first difference."""
    cut = [i for i, c in enumerate(a.truncated) if c]
    same = [a.answers[i] == b.answers[i] for i in cut]
    lead = [
        mt.common_prefix(a.answers[i], b.answers[i]) / max(len(a.answers[i]), len(b.answers[i]), 1)
        for i in cut
    ]
    untruncated = [i for i, c in enumerate(a.truncated) if not c]
    return {
        "truncated_turns": len(cut),
        "greedy_identical": sum(same) / max(len(same), 1),
        "greedy_common_lead": sum(lead) / max(len(lead), 1),
        "untruncated_identical": float(all(a.answers[i] == b.answers[i] for i in untruncated)),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dataset-path", default=None)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--min-turns", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=6)
    ap.add_argument("--max-user-tokens", type=int, default=96, help="per message and reply")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="per answer")
    ap.add_argument("--context-budget", type=int, default=512, help="prompt + answer tokens")
    ap.add_argument("--pool-tokens", type=int, default=2048)
    ap.add_argument("--host-gb", type=float, default=2.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = eval_data.sharegpt(args.dataset_path)
    probe = Engine(args.model, dtype=args.dtype, max_total_tokens=64)
    convs = mt.load_conversations(
        data, args.conversations, args.min_turns, args.max_turns, args.max_user_tokens,
        probe.tokenizer, args.seed,
    )  # fmt: skip
    probe.shutdown()
    engines = {
        name: Engine(
            args.model,
            dtype=args.dtype,
            max_total_tokens=args.pool_tokens,
            hicache_size=args.host_gb,
            hicache_prefetch_window=0,
            hicache_reposition=on,
        )  # fmt: skip
        for name, on in (("recompute", False), ("reposition", True))
    }
    for engine in engines.values():  # first-call costs (allocator, kernels) not measured
        engine.generate("A warm-up request, not measured.", {"max_new_tokens": 4})
        assert engine.flush_cache()
    start = time.perf_counter()
    try:
        runs = run(engines, convs, args)
    finally:
        for engine in engines.values():
            engine.shutdown()
    for res in runs.values():
        print(json.dumps({k: v for k, v in res.summary().items() if k != "ttft_per_turn_s"}))
    report = {
        "command": " ".join(sys.argv),
        "conversations": len(convs),
        "wall_s": time.perf_counter() - start,
        "rows": [r.summary() for r in runs.values()],
        "agreement": agreement(runs["recompute"], runs["reposition"]),
    }
    print(json.dumps(report["agreement"]))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
