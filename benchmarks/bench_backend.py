"""Per-layer attention time: TreeBackend vs FlatBackend (vs "none", the no-attention ceiling).

Batch: B requests share one cached radix node of P tokens; each then has R private cached
tokens and q new tokens (q = 1: decode). Times one layer's `forward` (pool write + attention),
averaged over 4 layers sharing one plan (the plan is timed separately), min of `--repeat`
interleaved steps.

The sweep (`--sweep`) times, for small shared segments, the tree backend keeping the segment
(thresholds off) against folding it into the private parts, to pick TreeBackend's thresholds
(`min_requests`, `min_tokens`, `min_reads`, `min_tokens_extend`): ratio = kept / folded,
< 1 means keeping the segment pays.

    python benchmarks/bench_backend.py --threads 1                  # SmolLM2-like heads, bf16
    python benchmarks/bench_backend.py --sweep --threads 1 [--q-len 8] [--dtype float32]
        [--kv-dtype float16]    # the pool's dtype (default: --dtype); the queries are --dtype

`--pad-sweep` times decode steps of B=`--batch` requests whose lengths are uniform in a range,
read through the padded pool-to-grid plan against the concatenated gather (FlatBackend with
padding off), to check `PAD_MAX_WASTE` in radixserve/attention/flat.py:

    python benchmarks/bench_backend.py --pad-sweep --batch 16
"""

from __future__ import annotations

import argparse
import time

import torch

from radixserve import kernels
from radixserve.attention import FlatBackend, NoAttentionBackend, TreeBackend
from radixserve.attention.base import AttentionBackend
from radixserve.attention.flat import GatherPlan, PaddedPlan
from radixserve.core.batch import ForwardBatch
from radixserve.kvcache.pool import KVPool

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def make_batch(
    b: int,
    p: int,
    r: int | list[int],
    q_len: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> ForwardBatch:
    """B requests: shared node 1 (P slots), then R private cached + q_len new slots each
    (`r` one length for all, or one per request)."""
    rs = r if isinstance(r, list) else [r] * b
    num_slots = 1 + p + sum(rs) + b * q_len
    pool = KVPool(num_slots, 1, kv_heads, head_dim, dtype)
    pool.k[0].normal_()
    pool.v[0].normal_()
    shared = torch.arange(1, 1 + p)  # a fresh pool hands out one contiguous run
    kv_indices, new, start = [], [], 1 + p
    for ri in rs:
        own = torch.arange(start, start + ri + q_len)  # (R + q_len,)
        kv_indices.append(torch.cat([shared, own]))
        new.append(own[ri:])
        start += ri + q_len
    t = b * q_len
    return ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.cat([torch.arange(p + ri, p + ri + q_len) for ri in rs]),
        out_cache_loc=torch.cat(new),
        seq_lens=[p + ri + q_len for ri in rs],
        extend_lens=[q_len] * b,
        kv_indices=kv_indices,
        paths=[[(1, p)] if p > 0 else [] for _ in range(b)],
        kv_pool=pool,
    )


def dtypes(args: argparse.Namespace) -> str:
    return f"{args.dtype} q, {args.kv_dtype or args.dtype} K/V"


def time_forward(
    backends: list[AttentionBackend],
    batch: ForwardBatch,
    hq: int,
    repeat: int,
    q_dtype: torch.dtype,
    layers: int = 4,
) -> list[tuple[float, float]]:
    """Per backend: (min plan seconds, min per-layer forward seconds) over `repeat` steps.

    One step = plan once + `layers` forwards (as in a model, the plan and its scratch are
    reused by every layer; all on layer 0 of the pool). Backends are interleaved step by
    step and the MIN is kept: on a shared machine other processes only ever add time."""
    pool_k = batch.kv_pool.k[0]
    t, hkv, d = batch.out_cache_loc.numel(), pool_k.shape[1], pool_k.shape[2]
    q = torch.randn(t, hq, d).to(q_dtype)  # (T, Hq, D)
    k = torch.randn(t, hkv, d).to(q_dtype)  # (T, Hkv, D): new K/V come in the compute dtype
    v = torch.randn(t, hkv, d).to(q_dtype)
    best = [(float("inf"), float("inf")) for _ in backends]
    for i in range(repeat + 1):  # step 0 warms up allocator and caches
        for j, backend in enumerate(backends):
            t0 = time.perf_counter()
            backend.plan(batch)
            t1 = time.perf_counter()
            for _ in range(layers):
                backend.forward(q, k, v, 0, batch, d**-0.5)
            t2 = time.perf_counter()
            if i:
                best[j] = (min(best[j][0], t1 - t0), min(best[j][1], (t2 - t1) / layers))
    return best


def bench_realistic(args: argparse.Namespace, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    print(
        f"# per-layer forward, Hq={args.q_heads} Hkv={args.kv_heads} D={args.head_dim} "
        f"{dtypes(args)}, {torch.get_num_threads()} threads, kernels={kernels.__name__}"
    )
    print(
        f"{'B':>4} {'P':>6} {'R':>5} {'q':>3} | {'flat ms':>9} {'tree ms':>9} {'none ms':>9} "
        f"| {'flat/tree':>9} | {'tree plan ms':>12}"
    )
    for b in args.batch or [8, 32, 64]:
        for p in args.shared or [256, 1024, 4096]:
            batch = make_batch(
                b, p, args.private, args.q_len, args.kv_heads, args.head_dim, kv_dtype
            )
            backends = [FlatBackend(), TreeBackend(), NoAttentionBackend()]
            (_, flat), (plan, tree), (_, none) = time_forward(
                backends, batch, args.q_heads, args.repeat, dtype
            )
            print(
                f"{b:>4} {p:>6} {args.private:>5} {args.q_len:>3} | {flat * 1e3:>9.3f} "
                f"{tree * 1e3:>9.3f} {none * 1e3:>9.3f} | {flat / tree:>9.2f} | "
                f"{plan * 1e3:>12.3f}"
            )


def bench_sweep(args: argparse.Namespace, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    print(
        f"# threshold sweep: kept/folded time of one shared segment, R={args.private}, "
        f"q={args.q_len}, {dtypes(args)}  (< 1: keeping the segment pays)"
    )
    lengths = args.shared or [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
    print(f"{'k/L':>6} " + " ".join(f"{n:>6}" for n in lengths))
    kept = TreeBackend(2, 1, min_reads=1, min_tokens_extend=1)  # every segment kept
    folded = TreeBackend(10**9)  # every segment folded
    for b in args.batch or [2, 4, 8, 16, 32, 64]:
        row = []
        for p in lengths:
            batch = make_batch(
                b, p, args.private, args.q_len, args.kv_heads, args.head_dim, kv_dtype
            )
            (_, t_kept), (_, t_fold) = time_forward(
                [kept, folded], batch, args.q_heads, args.repeat, dtype
            )
            row.append(t_kept / t_fold)
        print(f"{b:>6} " + " ".join(f"{x:>6.2f}" for x in row))


def bench_pad_sweep(args: argparse.Namespace, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    print(f"# decode, padded grid vs concatenated gather, {dtypes(args)}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'B':>4} {'kv range':>12} {'waste':>6} | {'padded ms':>9} {'gather ms':>9} | ratio")
    gen = torch.Generator().manual_seed(0)
    padded, gathered = FlatBackend(), FlatBackend(pad_max_waste=0.0)
    for lo, hi in [(30, 100), (150, 250), (400, 600), (900, 1100), (50, 400), (10, 1000)]:
        for b in args.batch or [8, 32, 64]:
            lens = torch.randint(lo, hi, (b,), generator=gen).tolist()
            batch = make_batch(b, 0, lens, 1, args.kv_heads, args.head_dim, kv_dtype)
            (_, t_pad), (_, t_gather) = time_forward(
                [padded, gathered], batch, args.q_heads, args.repeat, dtype
            )
            assert isinstance(batch.attn_plan, GatherPlan)  # the last plan built: gathered's
            padded.plan(batch)
            assert isinstance(batch.attn_plan, PaddedPlan), "the case must pad"
            grid = max(lens) + 1  # L: the longest request's keys incl. its new token
            waste = b * grid / (sum(lens) + b)
            print(f"{b:>4} {f'[{lo},{hi})':>12} {waste:>6.2f} | {t_pad * 1e3:>9.3f} "
                  f"{t_gather * 1e3:>9.3f} | {t_gather / t_pad:5.2f}x  (L={grid})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", help="k (default 8 32 64; sweep 2 .. 64)")
    ap.add_argument("--shared", type=int, nargs="+", help="L (256 1024 4096; sweep 16 .. 4096)")
    ap.add_argument("--private", type=int, default=128)
    ap.add_argument("--q-len", type=int, default=1)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    ap.add_argument("--kv-dtype", choices=list(DTYPES), help="the pool's (default: --dtype)")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    ap.add_argument("--sweep", action="store_true", help="threshold sweep instead")
    ap.add_argument("--pad-sweep", action="store_true", help="padded vs gathered decode")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    kv_dtype = DTYPES[args.kv_dtype or args.dtype]
    run = bench_pad_sweep if args.pad_sweep else bench_sweep if args.sweep else bench_realistic
    run(args, dtype, kv_dtype)


if __name__ == "__main__":
    main()
