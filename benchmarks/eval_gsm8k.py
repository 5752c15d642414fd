"""GSM8K with self-consistency, written in the frontend DSL (SGLang's names).

Each program: the k-shot prompt (from the train split; shared by every question), the
question, then `s.fork(n)` samples that each generate an answer; the final numbers are
extracted and the majority wins (greedy n=1 is plain k-shot accuracy). Programs run
concurrently with `run_batch`, so the runtime sees the shared k-shot prefix and each
question's n forks together.

    python benchmarks/eval_gsm8k.py --num-questions 50 --num-shots 8 -n 16 --compare
    python benchmarks/eval_gsm8k.py --url http://127.0.0.1:30000 -n 1 --temperature 0

Data (benchmarks/eval_data.py): --data-path (a folder holding train.jsonl and test.jsonl),
else the cached copy, else GSM8K's jsonl files downloaded from openai/grade-school-math.

Reports accuracy, the invalid-answer rate (no number in any sample), wall time, output
tokens/s and the cache hit rate (cached / prompt tokens over every request the runtime
admitted during the run, from its scheduler counters). --compare
runs `tree` then `flat` in-process on the same questions and prints the speedup and the
number of questions whose voted answer / sample texts differ (0 expected when greedy).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import eval_data
from runtime_args import add_runtime_args, check_runtime_args

import radixserve.frontend as rs

STOP = ["Question:", "\n\n\n"]  # the next shot would start with "Question:"
INVALID = None
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def few_shot_prompt(train: list[dict[str, Any]], k: int) -> str:
    """The first k train examples, in GSM8K's own answer format (reasoning, "#### N")."""
    return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train[:k])


def extract_answer(text: str) -> float | None:
    """The number after "####" if present, else the last number in the text (commas
    ignored); None when there is no number."""
    tail = text.split("####", 1)[1] if "####" in text else text
    found = NUMBER.findall(tail)
    if not found:
        return INVALID
    value = found[0] if "####" in text else found[-1]
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return INVALID


def majority(answers: list[float | None]) -> float | None:
    """The most common valid answer (the earliest sample wins a tie); None if none valid."""
    valid = [a for a in answers if a is not None]
    if not valid:
        return INVALID
    counts = Counter(valid)
    best = max(counts.values())
    return next(a for a in valid if counts[a] == best)


@rs.function
def solve(s: Any, few_shot: str, question: str, n: int, max_tokens: int) -> None:
    s += few_shot + f"Question: {question}\nAnswer:"
    forks = s.fork(n)  # the question is committed once; n samples decode from it
    forks += rs.gen("answer", max_tokens=max_tokens, stop=STOP)
    forks.join()  # s["answer"]: the n answers


def cache_counters(backend: Any) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) the runtime has admitted since it started: every
    request counts, the fork commits included (the gens alone would find their whole
    prompt cached by the commit before them)."""
    if hasattr(backend, "engine"):  # EngineBackend: read after its requests finished
        sched = backend.engine.scheduler
        return sched.prompt_tokens_total, sched.cached_tokens_total
    stats = backend.get_server_info()["scheduler"]  # RuntimeEndpoint
    return stats["prompt_tokens_total"], stats["cached_tokens_total"]


def run_eval(
    backend: Any,
    questions: list[dict[str, Any]],
    few_shot: str,
    n: int,
    max_tokens: int,
    temperature: float,
    parallel: int,
) -> dict[str, Any]:
    """Run every question's program on `backend`; accuracy and cost figures."""
    batch = [
        {"few_shot": few_shot, "question": q["question"], "n": n, "max_tokens": max_tokens}
        for q in questions
    ]
    before = cache_counters(backend)
    start = time.perf_counter()
    states = solve.run_batch(batch, backend=backend, num_threads=parallel, temperature=temperature)
    wall = time.perf_counter() - start
    after = cache_counters(backend)
    preds, texts, out_tok = [], [], 0
    for st in states:
        answers = st["answer"]  # re-raises the program's failure, if any
        texts.append(answers)
        preds.append(majority([extract_answer(a) for a in answers]))
        out_tok += sum(meta["completion_tokens"] for meta in st.get_meta_info("answer"))
    labels = [extract_answer(q["answer"]) for q in questions]
    return {
        "questions": len(questions),
        "samples": n,
        "accuracy": sum(p == y for p, y in zip(preds, labels)) / len(questions),
        "invalid": sum(p is INVALID for p in preds) / len(questions),
        "wall_s": wall,
        "output_tokens": out_tok,
        "output_tok_s": out_tok / wall,
        "cache_hit_rate": (after[1] - before[1]) / max(after[0] - before[0], 1),
        "predictions": preds,
        "texts": texts,  # per question, its n sample texts
    }


def _in_process(args: argparse.Namespace, attention: str) -> Any:
    from radixserve.frontend.engine_backend import EngineBackend

    return EngineBackend(
        model=args.model,
        dtype=args.dtype,
        attention_backend=attention,
        max_total_tokens=args.max_total_tokens,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--data-path", default=None,
        help="GSM8K folder holding train.jsonl and test.jsonl (default: cached or downloaded)",
    )  # fmt: skip
    ap.add_argument("--num-questions", type=int, default=50)
    ap.add_argument("--num-shots", type=int, default=8)
    ap.add_argument("-n", "--samples", type=int, default=16, help="self-consistency forks")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--parallel", type=int, default=64, help="programs run at once")
    ap.add_argument(
        "--control-parallel", type=int, default=None, metavar="P",
        help="with --compare: also run flat with --parallel P, a flat-vs-flat control that "
        "differs only in batch composition (shows how much greedy text bf16 rounding alone moves)",
    )  # fmt: skip
    add_runtime_args(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    check_runtime_args(args)
    train = eval_data.gsm8k(args.data_path, "train", args.num_shots)
    few_shot = few_shot_prompt(train, args.num_shots)
    questions = eval_data.gsm8k(args.data_path, "test", args.num_questions)
    runs = []
    plan = [(args.attention_backend, args.parallel)]  # (backend, programs at once)
    if args.compare:
        plan = [("tree", args.parallel), ("flat", args.parallel)]
        if args.control_parallel:
            plan.append(("flat", args.control_parallel))
    for name, parallel in [("server", args.parallel)] if args.url else plan:
        backend = (
            rs.RuntimeEndpoint(args.url, args.api_key) if args.url else _in_process(args, name)
        )
        try:
            r = run_eval(backend, questions, few_shot, args.samples, args.max_tokens,
                         args.temperature, parallel)  # fmt: skip
        finally:
            backend.close()
            del backend
            gc.collect()  # free the first engine's KV pool before the second is built
        runs.append({"backend": name, "parallel": parallel, **r})
        print(
            f"[{name}, parallel {parallel}] {r['questions']} questions x {r['samples']} samples:"
            f" accuracy {r['accuracy']:.3f}  invalid {r['invalid']:.3f}  {r['wall_s']:.1f} s"
            f"  {r['output_tok_s']:.1f} out tok/s  cache hit {r['cache_hit_rate']:.3f}"
        )
    result: dict[str, Any] = {"num_shots": args.num_shots, "runs": runs}
    if args.compare:
        tree, flat = runs[:2]
        result["speedup"] = flat["wall_s"] / tree["wall_s"]
        result["differing_answers"], result["differing_texts"] = _differ(tree, flat)
        print(f"tree vs flat end-to-end speedup: {result['speedup']:.2f}x; questions whose"
              f" answer / sample texts differ: {result['differing_answers']} /"
              f" {result['differing_texts']} of {len(questions)}")  # fmt: skip
        if len(runs) == 3:
            result["control_differing_answers"], result["control_differing_texts"] = _differ(
                flat, runs[2]
            )
            print(f"control, flat (parallel {args.parallel}) vs flat (parallel"
                  f" {args.control_parallel}): answer / sample texts differ:"
                  f" {result['control_differing_answers']} /"
                  f" {result['control_differing_texts']} of {len(questions)}")  # fmt: skip
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


def _differ(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, int]:
    """(questions whose voted answer differs, questions whose sample texts differ)."""
    answers = sum(x != y for x, y in zip(a["predictions"], b["predictions"], strict=True))
    return answers, sum(x != y for x, y in zip(a["texts"], b["texts"], strict=True))


if __name__ == "__main__":
    main()
