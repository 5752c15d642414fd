"""Attention-only time of ONE decode step of ONE layer: tree (Hydragen) vs flat, with roofline.

Shapes default to SmolLM2-135M (Hq 9, Hkv 3, D 64), bf16. Every request r has the path

    |<------ P1: shared by all B ------>|<-- P2: shared by its group of G -->|<-- R: own -->|

(P2 = 0 for a one-level tree; R includes the current token). The K/V of every path position
lives in ONE pool layer (num_slots, Hkv, D), laid out as a fresh pool hands out slots.
- flat: gather each request's whole path from the pool by slot index (index_select on
  (slots, Hkv*D) rows) and run private_attention with q_len 1, kv_len P1+P2+R per request.
- tree: gather each shared segment once and run segment_attention with all the queries
  under it; gather the private parts and run private_attention; merge_states all parts.
Both sides count their gathers; the slot lists (the per-step plan) are built outside the
timed region, as a backend's plan() runs once per step, not per layer.

Roofline per side: bound = max(bytes / read bandwidth, FLOPs / matmul peak of the dtype),
bytes = K/V read by attention + gather traffic (read + write of the copy) + merge traffic,
FLOPs = 4 * rows * L * D per query head (QK^T and PV). Bandwidth and matmul peaks are
measured in the same run (benchmarks/roofline.py).

    python benchmarks/bench_tree_attention.py [--quick] [--dtype bf16] [--json P] [--plot P]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script or loaded
from benchmarks.roofline import Roofline, measure_roofline  # noqa: E402
from radixserve import kernels  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    sweep: str
    batch: int  # B requests, one query token each
    prefix: int  # P1, shared by all
    private: int  # R, per request, incl. the current token
    prefix2: int = 0  # P2, shared per group
    group: int = 1  # G requests per P2 group

    def __post_init__(self) -> None:
        assert self.batch % self.group == 0, f"batch {self.batch} % group {self.group} != 0"

    @property
    def path_len(self) -> int:
        return self.prefix + self.prefix2 + self.private

    def label(self) -> str:
        two = f" P2={self.prefix2}/G={self.group}" if self.prefix2 else ""
        return f"B={self.batch} P={self.prefix}{two} R={self.private}"


@dataclass(frozen=True)
class Shapes:
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64


def sweep(quick: bool) -> list[Case]:
    """The default sweep (~2-3 min on 2 cores) or the --quick preset (seconds)."""
    if quick:
        return [
            Case("batch", 2, 64, 16),
            Case("batch", 8, 128, 16),
            Case("two-level", 8, 64, 16, 64, 4),
        ]
    cases = [Case("headline", 64, 4096, 128)]
    cases += [Case("batch", b, 4096, 128) for b in (1, 4, 16, 256)]
    cases += [Case("prefix", 64, p, 128) for p in (256, 1024, 16384)]
    cases += [Case("private", 64, 4096, r) for r in (16, 512)]
    cases += [Case("two-level", 64, 2048, 128, 2048, g) for g in (4, 16)]
    return cases


@dataclass
class Layout:
    """One pool layer and the per-step slot lists (the plan) for a Case."""

    k_pool: torch.Tensor  # (num_slots, Hkv*D): rows of the pool, flattened heads
    v_pool: torch.Tensor
    q: torch.Tensor  # (B, Hq, D)
    prefix_slots: torch.Tensor  # (P1,)
    group_slots: list[torch.Tensor]  # B // G tensors of (P2,)
    private_slots: torch.Tensor  # (B*R,), request-major
    flat_slots: torch.Tensor  # (B*(P1+P2+R),), request-major: each request's whole path


def build_layout(case: Case, shapes: Shapes, dtype: torch.dtype, gen: torch.Generator) -> Layout:
    n_groups = case.batch // case.group if case.prefix2 else 0
    n_slots = 1 + case.prefix + n_groups * case.prefix2 + case.batch * case.private  # 0: scratch
    row = shapes.kv_heads * shapes.head_dim
    k_pool = torch.randn(n_slots, row, generator=gen).to(dtype)
    v_pool = torch.randn(n_slots, row, generator=gen).to(dtype)
    q = torch.randn(case.batch, shapes.q_heads, shapes.head_dim, generator=gen).to(dtype)
    cursor = 1  # slots handed out in order, as a fresh pool does; slot 0 is scratch

    def take(n: int) -> torch.Tensor:
        nonlocal cursor
        cursor += n
        return torch.arange(cursor - n, cursor)  # (n,) int64 slots

    prefix_slots = take(case.prefix)
    group_slots = [take(case.prefix2) for _ in range(n_groups)]
    private = [take(case.private) for _ in range(case.batch)]
    paths = []
    for r in range(case.batch):
        mid = [group_slots[r // case.group]] if n_groups else []
        paths.append(torch.cat([prefix_slots, *mid, private[r]]))
    return Layout(
        k_pool, v_pool, q, prefix_slots, group_slots, torch.cat(private), torch.cat(paths)
    )


class Gatherer:
    """Pool rows -> (n, Hkv, D) K or V by slot index (index_select on (slots, Hkv*D) rows).

    Fresh output per call by default, as the attention backends do; with `prealloc`, into a
    persistent workspace per `key`, which removes the allocator's page faults from the time."""

    def __init__(self, kv_heads: int, prealloc: bool) -> None:
        self.kv_heads, self.prealloc = kv_heads, prealloc
        self.bufs: dict[str, torch.Tensor] = {}

    def __call__(self, key: str, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        if not self.prealloc:
            rows = pool.index_select(0, slots)  # (n, Hkv*D) copy: the gather traffic
        else:
            buf = self.bufs.get(key)
            if buf is None:
                buf = self.bufs[key] = pool.new_empty(slots.numel(), pool.shape[1])
            rows = torch.index_select(pool, 0, slots, out=buf)
        return rows.view(slots.numel(), self.kv_heads, -1)  # (n, Hkv, D)


def run_flat(lay: Layout, case: Case, gather: Gatherer, scale: float) -> torch.Tensor:
    k = gather("flat_k", lay.k_pool, lay.flat_slots)  # (B*path, Hkv, D)
    v = gather("flat_v", lay.v_pool, lay.flat_slots)
    out, _ = kernels.private_attention(
        lay.q, k, v, [1] * case.batch, [case.path_len] * case.batch, scale
    )
    return out


def run_tree(lay: Layout, case: Case, gather: Gatherer, scale: float) -> torch.Tensor:
    k1 = gather("p1_k", lay.k_pool, lay.prefix_slots)  # (P1, Hkv, D), read once for all B
    v1 = gather("p1_v", lay.v_pool, lay.prefix_slots)
    parts = [kernels.segment_attention(lay.q, k1, v1, scale)]
    if lay.group_slots:
        outs, lses = [], []
        for g, slots in enumerate(lay.group_slots):
            qg = lay.q[g * case.group : (g + 1) * case.group]  # (G, Hq, D)
            kg, vg = gather("p2_k", lay.k_pool, slots), gather("p2_v", lay.v_pool, slots)
            o, lse = kernels.segment_attention(qg, kg, vg, scale)
            outs.append(o)
            lses.append(lse)
        parts.append((torch.cat(outs), torch.cat(lses)))
    kp = gather("own_k", lay.k_pool, lay.private_slots)  # (B*R, Hkv, D)
    vp = gather("own_v", lay.v_pool, lay.private_slots)
    own = [1] * case.batch, [case.private] * case.batch
    parts.append(kernels.private_attention(lay.q, kp, vp, *own, scale))
    stacked = torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts])
    out, _ = kernels.merge_states(*stacked)  # (B, Hq, D)
    return out


def time_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, min) wall ms over `repeats` calls after one warm-up."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts), min(ts)


def traffic(case: Case, shapes: Shapes, elt: int) -> dict[str, float]:
    """Bytes and FLOPs per side (see the module docstring)."""
    kv_row = 2 * shapes.kv_heads * shapes.head_dim * elt  # K and V of one token
    flops = 4.0 * case.batch * case.path_len * shapes.head_dim * shapes.q_heads  # equal both sides
    flat_rows = case.batch * case.path_len
    n_groups = case.batch // case.group if case.prefix2 else 0
    tree_rows = case.prefix + n_groups * case.prefix2 + case.batch * case.private
    n_parts = 3 if case.prefix2 else 2
    merge = (n_parts + 1) * case.batch * shapes.q_heads * shapes.head_dim * elt  # read N, write 1
    return {
        "flat_bytes": 3.0 * flat_rows * kv_row,  # gather read + write, attention read
        "tree_bytes": 3.0 * tree_rows * kv_row + merge,
        "flops": flops,
    }


def run_case(
    case: Case, shapes: Shapes, dtype: torch.dtype, roof: Roofline, repeats: int, prealloc: bool
) -> dict[str, Any]:
    lay = build_layout(case, shapes, dtype, torch.Generator().manual_seed(0))
    gather, scale = Gatherer(shapes.kv_heads, prealloc), shapes.head_dim**-0.5
    tree_out = run_tree(lay, case, gather, scale)
    flat_out = run_flat(lay, case, gather, scale)
    max_diff = (tree_out.float() - flat_out.float()).abs().max().item()
    tree_ms, tree_min = time_ms(lambda: run_tree(lay, case, gather, scale), repeats)
    flat_ms, flat_min = time_ms(lambda: run_flat(lay, case, gather, scale), repeats)
    tr = traffic(case, shapes, torch.finfo(dtype).bits // 8)
    tree_bound = roof.bound_s(tr["tree_bytes"], tr["flops"], dtype) * 1e3
    flat_bound = roof.bound_s(tr["flat_bytes"], tr["flops"], dtype) * 1e3
    return {
        **asdict(case),
        "label": case.label(),
        "tree_ms": tree_ms,
        "flat_ms": flat_ms,
        "tree_min_ms": tree_min,
        "flat_min_ms": flat_min,
        "speedup": flat_ms / tree_ms,
        "tree_bound_ms": tree_bound,
        "flat_bound_ms": flat_bound,
        "roofline_speedup": flat_bound / tree_bound,
        "tree_frac_of_bound": tree_bound / tree_ms,
        "flat_frac_of_bound": flat_bound / flat_ms,
        "max_abs_diff_tree_vs_flat": max_diff,
        **tr,
    }


HEADER = (
    f"{'sweep':<10}{'config':<30}{'tree ms':>9}{'flat ms':>9}{'speedup':>9}"
    f"{'roof x':>8}{'tree %roof':>11}{'flat %roof':>11}"
)


def format_row(r: dict[str, Any]) -> str:
    f = lambda k: float(r[k])  # noqa: E731
    return (
        f"{r['sweep']!s:<10}{r['label']!s:<30}{f('tree_ms'):>9.3f}{f('flat_ms'):>9.3f}"
        f"{f('speedup'):>8.2f}x{f('roofline_speedup'):>7.1f}x"
        f"{100 * f('tree_frac_of_bound'):>10.0f}%{100 * f('flat_frac_of_bound'):>10.0f}%"
    )


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (sweep_name, key) in zip(
        axes, [("batch", "batch"), ("prefix", "prefix"), ("private", "private")], strict=False
    ):
        rows = [r for r in results if r["sweep"] in (sweep_name, "headline")]
        rows.sort(key=lambda r: float(r[key]))
        xs = [float(r[key]) for r in rows]
        ax.plot(xs, [float(r["speedup"]) for r in rows], "o-", label="measured")
        ax.plot(xs, [float(r["roofline_speedup"]) for r in rows], "s--", label="roofline")
        ax.set_title(f"{sweep_name} sweep (others as the headline)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(key)
        ax.set_ylabel("flat / tree time")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--quick", action="store_true", help="tiny preset for tests")
    p.add_argument("--repeats", type=int, default=None, help="timed calls per side (median)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--impl", choices=kernels.IMPLS, default="auto")
    p.add_argument("--only", nargs="+", default=None, help="run only these sweeps (names)")
    p.add_argument("--prealloc", action="store_true", help="gather into persistent workspaces")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG of the sweeps here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels.set_impl(args.impl)
    dtype = DTYPES[args.dtype]
    repeats = args.repeats or (2 if args.quick else 7)
    roof = measure_roofline(tuple(dict.fromkeys([torch.float32, dtype])), quick=args.quick)
    print(f"roofline ({torch.get_num_threads()} threads): {roof.describe()}")
    print(HEADER)
    results = []
    for case in sweep(args.quick):
        if args.only and case.sweep not in args.only:
            continue
        results.append(run_case(case, Shapes(), dtype, roof, repeats, args.prealloc))
        print(format_row(results[-1]), flush=True)
    report = {
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "impl": args.impl,
        "repeats": repeats,
        "prealloc": args.prealloc,
        "roofline": roof.as_dict(),
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(results, args.plot)
    return report


if __name__ == "__main__":
    main()
