"""End-to-end decode with a shared prefix: radixserve tree vs flat vs a no-attention ceiling
vs HF transformers `generate`, on the same model and dtype, side by side in one run.

Decode mode (default): B requests = one P-token shared prefix + a distinct short question
each; the decode step is timed step by step: radixserve's scheduler steps whose batch is one
new token for each of the B requests (prefill steps and steps where some requests still
prefill are left out), HF `generate`'s steps between the streamer's tokens 1..N. A round's
step is the median of its N-1 or so steps. radixserve runs from an empty radix cache each
time (it computes the prefix once and shares it). HF gets the same favour: the prefix is
prefilled once and its KV cache repeated B times (`DynamicCache.batch_repeat_interleave`),
then `generate` runs over it; HF still stores and reads the prefix B times. Within a round
the backends run side by side and take turns ONE STEP each (each drives its `generate` from
its own thread, a `Baton` lets one step run at a time, and every step's compute runs on the
main thread, so all of them use one OpenMP thread team as a user's process does), so the
k-th steps of all backends run within a second of each other and a machine whose speed
drifts (a shared VM) slows them alike; with `--repeats R` the printed tree ratios are the
median over the R rounds of per-round ratios.

Samples mode (`--samples`): "B samples of 128 tokens from one P-token prompt", prefill
included: radixserve `generate(prompt, n=B)` (prompt prefilled once, forked) vs HF
`generate(num_return_sequences=B)` (as users call it: the prompt is expanded B times).

    python benchmarks/bench_shared_prefix.py --batch 1 16 64 --prefix 1024 4096 --json out.json
    python benchmarks/bench_shared_prefix.py --samples --batch 64 --prefix 4096 --new-tokens 128
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import queue
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import eval_data
import torch

from radixserve.config import ATTENTION_BACKENDS
from radixserve.isa import resolve_dtype


def prefix_ids(tokenizer: Any, tokens: int, data_path: str | None, synthetic: bool) -> list[int]:
    """A deterministic prefix of exactly `tokens` tokens: GSM8K's train questions and answers
    (found by eval_data.gsm8k: --data-path, the cache, or downloaded), or synthetic text."""
    if synthetic:
        text = eval_data.synthetic_text(tokens)
    else:
        text = eval_data.gsm8k_text(eval_data.gsm8k(data_path, "train"), tokens)
    ids = tokenizer.encode(text)
    assert len(ids) >= tokens, f"not enough text for a {tokens}-token prefix"
    return ids[:tokens]


def question_ids(tokenizer: Any, batch: int) -> list[list[int]]:
    return [
        tokenizer.encode(f"\n\nQuestion {i}: what is {i} plus {2 * i + 1}?\nAnswer:")
        for i in range(batch)
    ]


class Baton:
    """Runners in threads take turns one step at a time, in a fixed round-robin order: each
    wraps every step in `take(name)` ... `give(name)`, and calls `leave(name)` when done (the
    others go on without it)."""

    def __init__(self, names: list[str]) -> None:
        self._order = list(names)
        self._at = 0  # index in _order of the runner whose turn it is
        self._cv = threading.Condition()

    def take(self, name: str) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._order[self._at] == name)

    def give(self, name: str) -> None:
        with self._cv:
            assert self._order[self._at] == name, f"{name} gives a turn it does not hold"
            self._at = (self._at + 1) % len(self._order)
            self._cv.notify_all()

    def leave(self, name: str) -> None:
        with self._cv:
            i = self._order.index(name)
            del self._order[i]
            if i < self._at:
                self._at -= 1
            if self._at >= len(self._order):  # it held the last turn of the order
                self._at = 0
            self._cv.notify_all()


class MainThread:
    """Runs what runner threads hand it (`call`) on the thread that `serve`s: torch gives each
    thread its own OpenMP team, and a team left spinning after its turn slowed the next
    runner's matmuls 1.15-1.4x on this 2-core VM."""

    def __init__(self) -> None:
        self._calls: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        done: Future = Future()
        self._calls.put((functools.partial(fn, *args, **kwargs), done))
        return done.result()

    def serve(self, until: list[Future]) -> None:
        while not all(f.done() for f in until):
            try:
                fn, done = self._calls.get(timeout=0.01)
            except queue.Empty:
                continue
            try:
                with torch.inference_mode():  # (a thread's grad mode is its own)
                    done.set_result(fn())
            except BaseException as e:  # handed back to the runner that called
                done.set_exception(e)


class Turn:
    """What a runner gets for one round: the baton, its name, and the main thread to compute on."""

    def __init__(self, baton: Baton, name: str, main: MainThread) -> None:
        self.baton, self.name, self.main = baton, name, main


# (n new tokens, its turn) -> seconds of each full-batch decode step
StepsRun = Callable[[int, Turn], list[float]]


def side_by_side(runs: dict[str, StepsRun], n: int) -> dict[str, list[float]]:
    """Every runner decodes n new tokens from its own thread, the runners taking turns one step
    at a time, each step computed on this thread -> each runner's timed steps."""
    baton, main = Baton(list(runs)), MainThread()

    def one(name: str) -> list[float]:
        try:
            return runs[name](n, Turn(baton, name, main))
        finally:
            baton.leave(name)

    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(one, name) for name in runs}
        main.serve(list(futures.values()))
    return {name: fut.result() for name, fut in futures.items()}


def decode_times(runs: dict[str, StepsRun], n: int, repeats: int) -> list[dict]:
    """Per round, every backend decodes n new tokens side by side (`side_by_side`). Returns one
    row per backend: its decode step (the median full-batch step of a round) in every round,
    and the best round."""
    steps: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(repeats):
        for name, timed in side_by_side(runs, n).items():
            assert timed, f"{name}: no full-batch decode step in {n} new tokens"
            steps[name].append(statistics.median(timed))
    return [
        {"backend": name, "step_s": min(steps[name]), "round_steps_s": steps[name]} for name in runs
    ]


def round_ratio(rows: list[dict], num: str, den: str) -> float:
    """Median over rounds of num's decode rate / den's (both from the same round)."""
    steps = {r["backend"]: r["round_steps_s"] for r in rows}
    return statistics.median(d / t for t, d in zip(steps[num], steps[den], strict=True))


def engine_runner(engine: Any, prompts: list[list[int]]) -> StepsRun:
    """Times every scheduler step whose batch is one decode token for each of the prompts
    (the prefill steps, and the steps where part of the batch still prefills, are left out).
    The timer wraps the scheduler's `step` only while a run generates; each step is one turn
    of the baton."""
    sched, width = engine.scheduler, len(prompts)  # a full decode batch: one token each

    def run(n: int, turn: Turn) -> list[float]:
        engine.flush_cache()
        sched.last_batch = None
        timed: list[float] = []
        step = sched.step

        def timed_step() -> Any:
            turn.baton.take(turn.name)
            try:
                t = time.perf_counter()
                out = turn.main.call(step)
                dt = time.perf_counter() - t
            finally:
                turn.baton.give(turn.name)
            batch = sched.last_batch
            if batch is not None and batch.input_ids.numel() == len(batch.extend_lens) == width:
                timed.append(dt)
            return out

        sched.step = timed_step  # an instance attribute shadows the method for this engine
        try:
            engine.generate(
                input_ids=prompts,
                sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            )
        finally:
            sched.step = step
        return timed

    return run


class _StepClock:
    """A `generate` streamer: each put (the prompt, then every token) ends a step and is a
    turn of the baton; it keeps when each step ended and when the next one began."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.ends: list[float] = []
        self.starts: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.ends.append(time.perf_counter())
        self.turn.baton.give(self.turn.name)
        self.turn.baton.take(self.turn.name)
        self.starts.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_runner(model: Any, prefix: list[int], prompts: list[list[int]]) -> StepsRun:
    """Times each decode step of `generate` (from the turn after the streamer's put of token
    i-1 to the put of token i, i = 2..n)."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(torch.tensor([prefix]), past_key_values=cache, use_cache=True)
    cache.batch_repeat_interleave(len(prompts))
    width = max(map(len, prompts))
    assert all(len(p) == width for p in prompts), "HF side needs equal-length prompts"
    ids = torch.tensor(prompts)

    def run(n: int, turn: Turn) -> list[float]:
        kv = copy.deepcopy(cache)  # generate extends it in place
        clock = _StepClock(turn)
        forward = model.forward
        model.forward = functools.partial(turn.main.call, forward)  # compute on the main thread
        turn.baton.take(turn.name)
        try:
            with torch.inference_mode():
                out = model.generate(
                    ids,
                    past_key_values=kv,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    attention_mask=torch.ones_like(ids),
                    streamer=clock,
                )
        finally:
            turn.baton.give(turn.name)
            model.forward = forward  # as before the run (a hook's wrapper stays in place)
        assert out.shape[1] == width + n and len(clock.ends) == n + 1
        # step i (tokens 2..n) ran from the turn after token i-1's put to token i's put
        return [e - b for b, e in zip(clock.starts[1:], clock.ends[2:])]

    return run


def load_engines(args: argparse.Namespace, capacity: int) -> dict[str, Any]:
    from radixserve import Engine

    return {
        b: Engine(
            args.model,
            dtype=args.dtype,
            attention_backend=b,
            max_total_tokens=capacity,
            chunked_prefill_size=4096,
            max_prefill_tokens=16384,
            max_running_requests=max(args.batch) + 8,
        )
        for b in args.backends
        if b in ATTENTION_BACKENDS
    }


def pad_questions(qs: list[list[int]]) -> list[list[int]]:
    """Equal lengths (HF batches without padding tricks): left-pad with a space token."""
    width = max(map(len, qs))
    return [q[:1] * (width - len(q)) + q for q in qs]


def bench_decode(args: argparse.Namespace, engines: dict[str, Any], hf: Any) -> list[dict]:
    tok = next(iter(engines.values())).tokenizer
    rows = []
    for p in args.prefix:
        prefix = prefix_ids(tok, p, args.data_path, args.synthetic_prefix)
        for b in args.batch:
            prompts = [prefix + q for q in pad_questions(question_ids(tok, b))]
            runs = {
                name: hf_runner(hf, prefix, prompts)
                if name == "hf"
                else engine_runner(engines[name], prompts)
                for name in args.backends
            }
            group = decode_times(runs, args.new_tokens, args.repeats)
            for r in group:
                r.update(batch=b, prefix=p, decode_tok_s=b / r["step_s"])
                print(
                    f"B={b:4d} P={p:6d} {r['backend']:5s} decode {r['decode_tok_s']:9.1f} tok/s "
                    f"(step {r['step_s'] * 1e3:8.1f} ms, best round)",
                    flush=True,
                )
            if "tree" in runs:
                ratios = {j: round_ratio(group, "tree", j) for j in runs if j != "tree"}
                for r in group:
                    r["tree_rate_ratio"] = ratios.get(r["backend"])
                print(
                    f"   tree rate / other, median of {args.repeats} rounds: "
                    + ", ".join(f"/{k} {v:.2f}x" for k, v in ratios.items())
                )
            rows.extend(group)
    return rows


def bench_samples(args: argparse.Namespace, engines: dict[str, Any], hf: Any) -> list[dict]:
    tok = next(iter(engines.values())).tokenizer
    rows = []
    for p in args.prefix:
        prompt = prefix_ids(tok, p, args.data_path, args.synthetic_prefix)
        for b in args.batch:
            params = {
                "temperature": 0.7,
                "max_new_tokens": args.new_tokens,
                "ignore_eos": True,
                "n": b,
                "seed": 0,
            }
            for name in args.backends:
                t = time.perf_counter()
                if name == "hf":
                    with torch.inference_mode():
                        hf.generate(
                            torch.tensor([prompt]),
                            num_return_sequences=b,
                            do_sample=True,
                            temperature=0.7,
                            top_k=0,
                            max_new_tokens=args.new_tokens,
                            min_new_tokens=args.new_tokens,
                            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        )
                else:
                    engines[name].flush_cache()
                    engines[name].generate(input_ids=prompt, sampling_params=params)
                wall = time.perf_counter() - t
                rows.append(
                    {
                        "backend": name,
                        "batch": b,
                        "prefix": p,
                        "wall_s": wall,
                        "tok_s": b * args.new_tokens / wall,
                    }
                )
                print(
                    f"{b} samples x {args.new_tokens} tokens, P={p}: {name:5s} {wall:8.2f} s",
                    flush=True,
                )
            walls = {r["backend"]: r["wall_s"] for r in rows[-len(args.backends) :]}
            if "tree" in walls:
                print(
                    "   tree speedup: "
                    + ", ".join(
                        f"vs {k} {v / walls['tree']:.2f}x" for k, v in walls.items() if k != "tree"
                    )
                )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prefix", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["tree", "flat", "none", "hf"],
        choices=[*ATTENTION_BACKENDS, "hf"],
    )
    ap.add_argument("--samples", action="store_true", help="B samples of one prompt, prefill incl.")
    ap.add_argument("--repeats", type=int, default=1, help="decode: rounds of side-by-side runs")
    ap.add_argument("--data-path", default=None, help="GSM8K folder (default: cached/downloaded)")
    ap.add_argument("--synthetic-prefix", action="store_true", help="synthetic text, no GSM8K")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not set(args.backends) & set(ATTENTION_BACKENDS):
        ap.error("--backends needs a radixserve backend too (its engine tokenizes the prompts)")
    if args.samples and args.new_tokens == 16:
        args.new_tokens = 128
    capacity = max(args.prefix) * 2 + max(args.batch) * (args.new_tokens + 64) + 1024
    engines = load_engines(args, capacity)
    hf = None
    if "hf" in args.backends:
        from transformers import AutoModelForCausalLM

        from radixserve.models import resolve_model_path

        hf = AutoModelForCausalLM.from_pretrained(
            resolve_model_path(args.model), dtype=resolve_dtype(args.dtype, "cpu")[0]
        ).eval()
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {args.new_tokens} new tokens")
    rows = (bench_samples if args.samples else bench_decode)(args, engines, hf)
    res = {
        "mode": "samples" if args.samples else "decode",
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
        "prefix_text": "synthetic" if args.synthetic_prefix else "gsm8k",
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
