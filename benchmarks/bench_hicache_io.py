"""What moving K/V between the pool and the host tier costs a step.

save: a HiCache over a KV pool shaped like the embedded model's (SmolLM2-135M: 30 layers,
3 KV heads, head_dim 64, fp32 rows) with a host tier; `--leaves` prefixes of `--tokens`
tokens are inserted, then evicted, and the eviction (which demotes: copies the leaf's
chunks out of the pool in the step) is timed; with --redis URL the write-through copy of
`insert` too.
load: the embedded model (fp32) with a host tier; a `--tokens`-token prompt is pushed out
of the pool into the host tier by another one, then asked again with 16 new tokens: its
time to first token (a host hit of `--tokens` tokens), loaded layer by layer during the
step (--hicache-layerwise) or whole before it, `--repeat` times each, alternating.

    python benchmarks/bench_hicache_io.py save --leaves 16 --tokens 512 --repeat 5
    python benchmarks/bench_hicache_io.py load --tokens 1024 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from radixserve.kvcache.hicache import HiCache, pool_layout
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.remote_store import RemoteStore
from radixserve.kvcache.tier_store import ChunkCodec, HostStore

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


def one_round(leaves: int, tokens: int, redis: str | None, seed: int) -> dict[str, float]:
    pool = KVPool(leaves * tokens + 1, LAYERS, KV_HEADS, HEAD_DIM, torch.float32)
    for k, v in zip(pool.k, pool.v):
        k.normal_()
        v.normal_()
    layout = pool_layout(pool)
    host = HostStore(2 * leaves * tokens * layout.chunk_bytes, layout, None)
    codec = ChunkCodec(layout, os.urandom(32))
    remote = RemoteStore(redis, codec, ttl_s=60) if redis else None
    cache = HiCache(pool, [host], remote, f"bench-{seed}-{time.time()}")
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(100, 30000, (tokens,), generator=g).tolist() for _ in range(leaves)]
    start = time.perf_counter()
    for seq in seqs:
        slots = pool.alloc(tokens)
        assert slots is not None
        cache.insert(seq, slots)
    insert_s = time.perf_counter() - start
    start = time.perf_counter()
    assert cache.evict(leaves * tokens) == leaves * tokens
    evict_s = time.perf_counter() - start
    assert host.stored_bytes == leaves * (tokens // 16) * layout.chunk_bytes
    cache.close()
    return {"evict_ms_per_1k_tokens": 1e6 * evict_s / (leaves * tokens),
            "insert_ms_per_1k_tokens": 1e6 * insert_s / (leaves * tokens)}  # fmt: skip


def load_ttft(tokens: int, repeat: int) -> dict[str, Any]:
    """Median TTFT (s) of a host-tier hit of `tokens` tokens, layer-wise and whole."""
    from radixserve import Engine

    pool = tokens + 64
    engines = {
        mode: Engine(dtype="float32", max_total_tokens=pool, hicache_size=1.0,
                     hicache_layerwise=mode == "layerwise")
        for mode in ("layerwise", "whole")
    }  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 40000, (tokens,), generator=g).tolist()
    ttft: dict[str, list[float]] = {mode: [] for mode in engines}
    one = {"temperature": 0, "max_new_tokens": 1}
    for r in range(repeat + 1):  # round 0: warm-up, not counted
        for mode, engine in engines.items():
            filler = torch.randint(1000, 40000, (tokens,), generator=g).tolist()
            engine.generate(input_ids=filler, sampling_params=one)  # `prompt` -> host tier
            asked = prompt + torch.randint(1000, 40000, (16,), generator=g).tolist()
            out = engine.generate(input_ids=asked, sampling_params=one)
            assert isinstance(out, dict)
            meta = out["meta_info"]
            if r > 0:
                assert meta["cached_tokens_details"].get("host", 0) >= tokens - 16, meta
                ttft[mode].append(meta["first_token_latency"])
    for engine in engines.values():
        engine.check_integrity()
        engine.shutdown()
    return {f"{mode}_ttft_s": statistics.median(t) for mode, t in ttft.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["save", "load"])
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--redis", default=None, help="redis://... to time the write-through too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.what == "load":
        out = load_ttft(args.tokens, args.repeat)
    else:
        rounds = [one_round(args.leaves, args.tokens, args.redis, s) for s in range(args.repeat)]
        out = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        out.update(leaves=args.leaves, redis=bool(args.redis))
    out.update(what=args.what, tokens=args.tokens, repeat=args.repeat)
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
