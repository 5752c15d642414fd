"""Quantized linears vs float32 F.linear, side by side in one run, on SmolLM2's and the
Llama-3.2-1B shapes.

For each weight shape (N, K) and rows M: float32 `F.linear` on the dequantized weight, and
the native kernels of radixserve/models/quant.py on the same weight (the embedded model's
Q4_1 / Q8_0, or each of `--formats`, K-quants included): `small`
(int16 activations, weights streamed: the decode kernel), `gemm` (int16 activations, the
int16 GEMM), `tiled` (dequantize tiles into sgemm), `bf16` (bf16 x, bf16 tiles into the
bf16 GEMM), for Q4_K, Q6_K, Q8_0 and MXFP4 `int8` (x rounded to int8, the streaming kernel
in the file layout) and, for the formats a build packs (Q4_K, Q6_K, MXFP4), `tiles` (the
same on the weight packed into tiles: the default). Prints ms per call and the weight-read
bound (bytes / measured bandwidth): the measurements behind Format.small_m (small vs gemm)
and BF16_TILED_M (gemm vs bf16).

    python benchmarks/bench_quant.py --json benchmarks/results/quant_<cpu>-<isa>_<date>.json
    python benchmarks/bench_quant.py --shapes 1b_gate_up --formats q4_0 q4_k q6_k --rows 1 16
    python benchmarks/bench_quant.py --shapes oss_gate_up oss_down --formats mxfp4  # gpt-oss
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from roofline import measure_read_bandwidth

from radixserve.isa import cpu_isa
from radixserve.models import quant
from radixserve.models.synthetic import random_blocks

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576), "1b_qkv": (3072, 2048), "1b_gate_up": (16384, 2048),
          "1b_down": (2048, 8192), "oss_gate_up": (5760, 2880),
          "oss_down": (2880, 2880)}  # fmt: skip


def best_ms(fn: Callable[[int], Any], copies: int, repeats: int) -> float:
    """Best time of fn(i), cycling i over `copies` weight copies (so weights come from DRAM,
    as in a forward pass that reads the whole model, not from the last call's cache)."""
    fn(0)
    best = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        fn(r % copies)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def bench_shape(name: str, n: int, k: int, fmt: str, rows: list[int], repeats: int,
                bw: float) -> list[dict[str, Any]]:  # fmt: skip
    native = quant.ops()
    assert native is not None, "the quantized kernels did not build"
    # > any L3 here in each storage: more copies of the small quantized weight than of its
    # float32 form (one copy of a 20 MB weight would be read from a 32 MB L3)
    copies = max(1, (192 << 20) // (n * quant.FORMATS[fmt].row_bytes(k)))
    blocks = [
        torch.from_numpy(random_blocks(n, k, fmt, seed))
        if fmt in quant.LLAMA_CPP_ONLY
        else quant.quantize(torch.randn(n, k) * 0.05, fmt)
        for seed in range(copies)
    ]
    fp32_copies = max(1, (192 << 20) // (n * k * 4))
    ws = [quant.dequantize(b, fmt, k) for b in blocks[:fp32_copies]]  # (N, K) float32
    code = quant.FORMATS[fmt].code
    int8_code = {**quant.X8_CODES, **quant.B8_CODES}.get(fmt)
    packs = native.packs and fmt in quant.PACKED_CODES and n % quant.PACK_ROWS[fmt] == 0
    tiles = [quant.pack(native, b, fmt, k) for b in blocks] if packs else []
    out = []
    for m in rows:
        x = torch.randn(m, k)
        xb = x.bfloat16()
        reps = max(repeats, copies)
        row = {"shape": name, "fmt": fmt, "M": m,
               "fp32_ms": best_ms(lambda i: F.linear(x, ws[i]), len(ws), reps),  # noqa: B023
               "small_ms": best_ms(lambda i: native.qmatmul_small(x, blocks[i], code, k), copies, reps),  # noqa: B023,E501
               "gemm_ms": best_ms(lambda i: native.qmatmul_gemm(x, blocks[i], code, k), copies, reps),  # noqa: B023,E501
               "tiled_ms": best_ms(lambda i: native.qmatmul_tiled(x, blocks[i], code, k), copies, reps),  # noqa: B023,E501
               "bf16_ms": best_ms(lambda i: native.qmatmul_tiled(xb, blocks[i], code, k), copies, reps),  # noqa: B023,E501
               "int8_ms": best_ms(lambda i: native.qmatmul_small(x, blocks[i], int8_code, k), copies, reps)  # noqa: B023,E501
               if int8_code is not None else None,
               "tiles_ms": best_ms(lambda i: native.qmatmul_small(x, tiles[i], quant.PACKED_CODES[fmt], k), copies, reps)  # noqa: B023,E501
               if tiles else None,
               "fp32_bound_ms": n * k * 4 / bw * 1e3,
               "quant_bound_ms": blocks[0].numel() / bw * 1e3}  # fmt: skip
        out.append(row)
        print(f"{name:8s} {fmt} M={m:5d}  fp32 {row['fp32_ms']:8.3f}  small {row['small_ms']:8.3f}"
              f"  gemm {row['gemm_ms']:8.3f}  tiled {row['tiled_ms']:8.3f}"
              f"  bf16 {row['bf16_ms']:8.3f}"
              + (f"  int8 {row['int8_ms']:8.3f}" if row["int8_ms"] is not None else "")
              + (f"  tiles {row['tiles_ms']:8.3f}" if row["tiles_ms"] is not None else "")
              + f" ms   bounds: fp32 {row['fp32_bound_ms']:.3f},"
              f" {fmt} {row['quant_bound_ms']:.3f} ms")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 1024])
    ap.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if not s.startswith("oss_")],
                    choices=list(SHAPES))  # fmt: skip
    ap.add_argument("--formats", nargs="+", default=None, choices=list(quant.FORMATS),
                    help="each shape in each format (default: the embedded model's)")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    bw = measure_read_bandwidth()
    print(f"CPU ISA {cpu_isa()}, {torch.get_num_threads()} threads, read {bw / 1e9:.1f} GB/s")
    rows: list[dict[str, Any]] = []
    for name in args.shapes:
        embedded = "q8_0" if name == "lm_head" else "q4_1"  # as in the embedded GGUF
        for fmt in args.formats or [embedded]:
            rows += bench_shape(name, *SHAPES[name], fmt, args.rows, args.repeats, bw)
    res = {"isa": cpu_isa(), "threads": torch.get_num_threads(), "read_bw": bw, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
