"""What moving K/V between the pool and the tiers costs: a step's share, and a record's.

save: a HiCache over a KV pool shaped like the embedded model's (SmolLM2-135M: 30 layers,
3 KV heads, head_dim 64, fp32 rows) with a host tier; `--leaves` prefixes of `--tokens`
tokens are inserted, then evicted, and the eviction (which demotes: copies the leaf's
chunks out of the pool in the step) is timed; with --redis URL the write-through copy of
`insert` too.
load: the embedded model (fp32) with a host tier; a `--tokens`-token prompt is pushed out
of the pool into the host tier by another one, then asked again with 16 new tokens: its
time to first token (a host hit of `--tokens` tokens), loaded layer by layer during the
step (--hicache-layerwise) or whole before it, `--repeat` times each, alternating.
codec: what writing and reading one record of the disk and Redis tiers costs, on the
writer thread and at a load, MAC'd (`ChunkCodec`) and sealed (`SealedChunkCodec`,
--hicache-encrypt): encode and decode of one chunk at the pool layouts of SmolLM2-135M (30
layers, 3 KV heads, head_dim 64) and Llama-3.2-1B (16 layers, 8 KV heads, head_dim 64) in
`--dtype`; `--chunks` chunks of random rows, each encoded and decoded once per round by
both codecs in turn, `--repeat` rounds; medians per chunk. `--out` writes the JSON record
(the CPU named).

    python benchmarks/bench_hicache_io.py save --leaves 16 --tokens 512 --repeat 5
    python benchmarks/bench_hicache_io.py load --tokens 1024 --repeat 5
    python benchmarks/bench_hicache_io.py codec --chunks 16 --repeat 20 --threads 1 \
        --out benchmarks/results/tier_crypt_<cpu>-<isa>_<date>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from bench_scheduler import machine_tag

from radixserve.kvcache.hicache import HiCache, pool_layout
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.remote_store import RemoteStore
from radixserve.kvcache.tier_store import (
    CHUNK_TOKENS,
    ChunkCodec,
    ChunkLayout,
    HostStore,
    SealedChunkCodec,
)

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
# (layers, KV heads, head_dim) of each model's KV pool
LAYOUTS = {"smollm2-135m": (LAYERS, KV_HEADS, HEAD_DIM), "llama-3.2-1b": (16, 8, 64)}
CODECS = {"mac": ChunkCodec, "sealed": SealedChunkCodec}
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


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


def codec_cost(name: str, dtype: torch.dtype, chunks: int, repeat: int) -> list[dict[str, Any]]:
    """One row per codec at layout `name`: median microseconds per chunk of encode and of
    decode, and the record's size. Every decode is checked bit for bit (not timed)."""
    layers, heads, dim = LAYOUTS[name]
    layout = ChunkLayout(layers, heads, dim, dtype)
    secret = os.urandom(32)
    codecs = {label: cls(layout, secret) for label, cls in CODECS.items()}
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(layout.shape, generator=g).to(dtype) for _ in range(chunks)]
    tokens = list(range(1000, 1000 + CHUNK_TOKENS))
    times: dict[str, dict[str, list[float]]] = {c: {"encode": [], "decode": []} for c in codecs}
    sizes = {}
    for _ in range(repeat):
        for i, chunk in enumerate(data):
            for label, codec in codecs.items():
                key = f"{label}-{i}"
                t0 = time.perf_counter()
                record = codec.encode(key, tokens, chunk)
                t1 = time.perf_counter()
                back = codec.decode(key, record, tokens)
                t2 = time.perf_counter()
                assert torch.equal(back, chunk), label
                times[label]["encode"].append(t1 - t0)
                times[label]["decode"].append(t2 - t1)
                sizes[label] = len(record)
    rows = []
    for label, t in times.items():
        enc, dec = statistics.median(t["encode"]), statistics.median(t["decode"])
        rows.append({
            "layout": name, "dtype": str(dtype).removeprefix("torch."), "codec": label,
            "chunk_bytes": layout.chunk_bytes, "record_bytes": sizes[label],
            "encode_us": round(1e6 * enc, 1), "decode_us": round(1e6 * dec, 1),
            "encode_gb_s": round(layout.chunk_bytes / enc / 1e9, 2),
            "decode_gb_s": round(layout.chunk_bytes / dec / 1e9, 2),
            "samples": len(t["encode"]),
        })  # fmt: skip
    return rows


def cpu_model() -> str:
    """The CPU's model name (what `lscpu` shows), '' where /proc/cpuinfo is missing."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def codec_report(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name in args.layouts:
        rows += codec_cost(name, DTYPES[args.dtype], args.chunks, args.repeat)
    for r in rows:
        print(
            f"{r['layout']:13s} {r['dtype']} {r['codec']:6s} chunk {r['chunk_bytes']:7d} B "
            f"record {r['record_bytes']:7d} B  encode {r['encode_us']:7.1f} us "
            f"({r['encode_gb_s']:.2f} GB/s)  decode {r['decode_us']:7.1f} us "
            f"({r['decode_gb_s']:.2f} GB/s)"
        )
    return {
        "what": "codec",
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "machine": machine_tag(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "command": "python benchmarks/bench_hicache_io.py " + " ".join(sys.argv[1:]),
        "chunks": args.chunks,
        "repeat": args.repeat,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["save", "load", "codec"])
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--redis", default=None, help="redis://... to time the write-through too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--dtype", choices=list(DTYPES), default="float16", help="codec: rows' dtype")
    ap.add_argument("--chunks", type=int, default=16, help="codec: distinct chunks per round")
    ap.add_argument("--out", default=None, help="codec: write the JSON record here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.what == "codec":
        report = codec_report(args)
        if args.out is not None:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {args.out}")
        return report
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
