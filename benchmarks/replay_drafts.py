"""What model-free drafters could keep on GSM8K self-consistency: a replay of real samples.

A seeded sample's tokens are the same with any drafts (speculative.py), so a drafter's kept
tokens on a workload can be counted exactly from the samples' outputs alone. This script
decodes `--samples` seeded samples of each of `--questions` 8-shot GSM8K questions together
without speculation (temperature 0.7, as bench_speculative.py's gsm8k-sc), timing every step,
fits step seconds = a + b * rows to those steps, and replays the decode in lock step: at each
step every unfinished sample may draft up to k tokens while the step holds at most `cap`
rows, keeps the drafted tokens that equal its next tokens, and the step costs a + b * rows.
Drafters:

- own: the sample's prompt and output so far (bench `ngram`, scheduler/ngram.py);
- own+siblings: also the other samples' outputs so far, the longest match of the sample's
  last tokens first (what a suffix lookup over every sample could find);
- own+siblings tree: every one of those longest matches, merged into a token tree of k
  nodes, at most 4 under one (draft_tree.weighted_tree, the default --speculative-topk);
- oracle: always right (the most any drafter could give at that cap and draft length).

Prints decode speedup over no drafts for each drafter, cap and draft length, and writes
JSON. The replay leaves out what drafting changes besides rows (samples running ahead of
each other, draft computation): it bounds what drafting these samples can give.

    python benchmarks/replay_drafts.py --gsm8k <gsm8k> --json replay.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from bench_speculative import SC_SAMPLES, gsm8k_self_consistency
from eval_gsm8k import STOP

from radixserve import Engine
from radixserve.scheduler.draft_tree import ROOT, Draft, weighted_tree
from radixserve.scheduler.ngram import MAX_MATCH, MIN_MATCH, NgramIndex

DRAFTERS = ("own", "own+siblings", "own+siblings tree", "oracle")
TREE_TOPK = 4  # branches under a node of the tree drafter's trees
CAPS = (16, 32, 48)
LENGTHS = (2, 4, 8)


def decode(
    engine: Engine, prompts: list[list[int]], n: int
) -> tuple[list[Any], list[tuple[int, float]]]:
    """Each prompt's n seeded samples, and (rows, seconds) of every step after the first."""
    steps: list[tuple[int, float]] = []
    scheduler = engine.scheduler
    plain_step = scheduler.step

    def timed_step() -> Any:
        running = scheduler.running
        decoding = bool(running) and not scheduler.waiting and all(r.output_ids for r in running)
        rows = len(running)  # a row each: no drafts
        t = time.perf_counter()
        out = plain_step()
        if decoding:
            steps.append((rows, time.perf_counter() - t))
        return out

    scheduler.step = timed_step  # type: ignore[method-assign]
    params = {"temperature": 0.7, "max_new_tokens": 256, "n": n, "stop": STOP}
    runs = []
    for i, ids in enumerate(prompts):
        engine.flush_cache()
        out = engine.generate(input_ids=ids, sampling_params={**params, "seed": i})
        runs.append({"prompt": ids, "outputs": [o["output_ids"] for o in out]})
    scheduler.step = plain_step  # type: ignore[method-assign]
    return runs, steps


def fit(steps: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares a, b of seconds = a + b * rows."""
    x = torch.tensor([r for r, _ in steps], dtype=torch.float64)
    y = torch.tensor([s for _, s in steps], dtype=torch.float64)
    design = torch.stack([torch.ones_like(x), x], dim=1)
    a, b = torch.linalg.lstsq(design, y[:, None]).solution.flatten().tolist()
    return a, b


def sibling_draft(seq: list[int], others: list[list[int]], k: int) -> tuple[int, list[list[int]]]:
    """The tokens after each longest match (MIN_MATCH .. MAX_MATCH) of the end of `seq` in
    `others`, the latest of each other first."""
    best, found = 0, []
    for other in others:
        for end in range(len(other) - 2, -1, -1):
            m = 0
            while m < MAX_MATCH and m <= end and other[end - m] == seq[-1 - m]:
                m += 1
            if m >= MIN_MATCH and m > best:
                best, found = m, []
            if m >= MIN_MATCH and m == best:
                found.append(other[end + 1 : end + 1 + k])
    return best, found


def replay(runs: list[Any], drafter: str, cap: int, k: int, a: float, b: float) -> dict[str, Any]:
    seconds, tokens, proposed, kept = 0.0, 0, 0, 0
    for run in runs:
        prompt, outs = run["prompt"], run["outputs"]
        done = [1] * len(outs)  # tokens out; the first came with the prefill
        own = [NgramIndex() for _ in outs]
        tokens += sum(map(len, outs))
        while True:
            live = [i for i, o in enumerate(outs) if done[i] < len(o)]
            if not live:
                break
            rows, progress = len(live), list(done)
            for i in live:
                out, at = outs[i], done[i]
                room = min(k, cap - rows, len(out) - at - 1)
                draft: list[int] = []
                found: list[list[int]] = []
                if room > 0 and drafter == "oracle":
                    draft = out[at : at + room]
                elif room > 0:
                    seq = prompt + out[:at]
                    match, found = own[i].draft(seq, room)
                    draft = found[0] if found else []  # the latest of the longest matches
                    if drafter.startswith("own+siblings"):
                        others = [o[: done[j]] for j, o in enumerate(outs) if j != i]
                        theirs, sibling = sibling_draft(seq, others, room)
                        if theirs > match:
                            draft, found = sibling[0], sibling
                        elif theirs == match:
                            found = found + sibling
                if drafter.endswith("tree"):
                    tree = weighted_tree(found, room, TREE_TOPK)
                else:
                    tree = Draft.chain(draft)
                # kept: the tokens to come, down the branch that holds them
                node: int | None = ROOT
                m = 0
                while at + m < len(out) and (node := tree.child(node, out[at + m])) is not None:
                    m += 1
                rows += len(tree)
                proposed, kept = proposed + len(tree), kept + m
                progress[i] = at + 1 + m
            done = progress
            seconds += a + b * rows
    return {"tokens_per_s": tokens / seconds, "proposed": proposed, "kept": kept}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gsm8k", default=None, metavar="PATH", help="GSM8K folder or jsonl")
    ap.add_argument("--questions", type=int, default=6)
    ap.add_argument("--samples", type=int, default=SC_SAMPLES)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    engine = Engine(None, speculative_algorithm="none")
    prompts = [
        engine.tokenizer.encode(p) for p in gsm8k_self_consistency(args.gsm8k, args.questions)
    ]
    runs, steps = decode(engine, prompts, args.samples)
    a, b = fit(steps)
    print(f"step seconds = {a * 1e3:.1f} ms + {b * 1e3:.2f} ms a row ({len(steps)} steps)")
    plain = replay(runs, "own", 0, 0, a, b)["tokens_per_s"]
    rows = []
    for drafter in DRAFTERS:
        for cap in CAPS:
            for k in LENGTHS:
                r = replay(runs, drafter, cap, k, a, b)
                row = {"drafter": drafter, "cap": cap, "draft_tokens": k, **r}
                row["speedup"] = round(r["tokens_per_s"] / plain, 3)
                rows.append(row)
                print(
                    f"{drafter:13s} cap {cap:2d} k {k}: {row['speedup']:.2f}x  "
                    f"kept {r['kept']}/{r['proposed']}",
                    flush=True,
                )
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "questions": args.questions,
        "samples": args.samples,
        "step_ms": round(a * 1e3, 2),
        "row_ms": round(b * 1e3, 3),
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
