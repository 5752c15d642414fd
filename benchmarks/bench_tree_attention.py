"""Attention-only time of ONE decode step of ONE layer: tree (Hydragen) vs flat, per kernel
implementation, with roofline.

Shapes default to SmolLM2-135M (Hq 9, Hkv 3, D 64); dtypes default to what the engine picks
for the embedded (quantized) model on this CPU: queries in the compute dtype (`--dtype auto`:
float32 unless the CPU has fast bf16), K/V in its `--kv-cache-dtype auto` (`--kv-dtype auto`:
float16 rows under float32 compute where the native kernels read the pool in place, else the
compute dtype). Every request r has the path

    |<------ P1: shared by all B ------>|<-- P2: shared by its group of G -->|<-- R: own -->|

(P2 = 0 for a one-level tree; R includes the current token). The K/V of every path position
lives in ONE pool layer (num_slots, Hkv, D), laid out as a fresh pool hands out slots.
- flat: each request attends its whole path (q_len 1, kv_len P1+P2+R).
- tree: each shared segment once with all the queries under it (segment attention), the
  private parts in one call, merged by log-sum-exp: with "native" each part starts from the
  state of the parts before it (the fused merge of the pool ops' `prior`), with the gathering
  implementations one N-way merge_states at the end.
How K/V reach the kernels depends on the implementation (`--impls`, default native and cpu):
- "native" reads them from the pool in place by slot (kernels.pool_* ops);
- "cpu" (torch) and "reference" gather them first (index_select on (slots, Hkv*D) rows),
  and that gather is timed, as the attention backends pay it every layer.
The slot lists (the per-step plan) are built outside the timed region, as a backend's plan()
runs once per step, not per layer. Times: the two sides of one implementation are
interleaved round-robin, `--repeats` rounds, and the implementations run one after the
other (interleaving them too put each native call right after the torch path's hundreds of
MB of gather writes, whose write-backs cost it ~1.5 ms at the headline); the table shows the
best (min) and the JSON the median too.

Roofline, one bound per side for all implementations (what any kernel must do):
bound = max(bytes / read bandwidth, FLOPs / fp32 matmul peak), with bytes = K/V read once
(flat: B * path rows; tree: the P1 + P2 segments once + B * R private rows) + the queries
read per part + the merge traffic, and FLOPs = 4 * rows * L * D per query head (QK^T and
PV). The compute peak is the best measured over float32 and the storage dtype when the
queries have it too (a kernel can always compute in fp32; a narrower pool under float32
queries is converted to float32 on load, so float32 is its peak). Bandwidth and peaks are
measured in the same run (benchmarks/roofline.py), before and after the cases, keeping the
best of each figure: on a shared machine one probe can land in a busy moment, and a low
probe would flatter every fraction. A gathering implementation moves 3x the K/V bytes
(read, write, read again): that is counted against it, not in its bound
(`gather_bytes` in the JSON).
Flat reads each shared segment once per request; this DRAM roofline prices every re-read at
DRAM bandwidth, but a segment small enough for the last-level cache (a P = 4096 prefix is
3 MB of fp16 K/V a layer) is re-read from there. So a second, cache-aware flat bound is
reported beside it (`flat_bound_cached_ms`, columns `roof$ x` / `of roof$`): the unique K/V
once at DRAM bandwidth, the re-reads at the read bandwidth measured over a buffer the size of
the case's shared segments (`cache_read_GBps`; a segment larger than the cache measures
DRAM again), and the same FLOP bound.

    python benchmarks/bench_tree_attention.py [--quick] [--dtype fp32|bf16|auto] [--kv-dtype ...]
        [--impls native cpu] [--only headline] [--json P] [--plot P]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from roofline import Roofline, measure_read_bandwidth, measure_roofline

from radixserve import kernels
from radixserve.isa import resolve_dtype
from radixserve.worker.model_worker import kv_cache_dtype

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
IMPLS = ("native", "cpu", "reference")


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

    @property
    def n_groups(self) -> int:
        return self.batch // self.group if self.prefix2 else 0

    def label(self) -> str:
        two = f" P2={self.prefix2}/G={self.group}" if self.prefix2 else ""
        return f"B={self.batch} P={self.prefix}{two} R={self.private}"


@dataclass(frozen=True)
class Shapes:
    q_dtype: torch.dtype  # queries and outputs
    kv_dtype: torch.dtype  # the pool's rows
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64

    def kv_row_bytes(self) -> int:  # K and V of one token
        return 2 * self.kv_heads * self.head_dim * self.kv_dtype.itemsize


def sweep(quick: bool) -> list[Case]:
    """The default sweep (a few minutes on 2 cores) or the --quick preset (seconds)."""
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


def runs(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_starts, kv_lens), each (len(lens),) int64: runs of the given lengths back to back."""
    return torch.tensor([0, *itertools.accumulate(lens)][:-1]), torch.tensor(lens)


@dataclass
class Layout:
    """One pool layer and the per-step slot lists (the plan) for a Case."""

    k_pool: torch.Tensor  # (num_slots, Hkv, D)
    v_pool: torch.Tensor
    q: torch.Tensor  # (B, Hq, D)
    prefix_slots: torch.Tensor  # (P1,)
    group_slots: list[torch.Tensor]  # B // G tensors of (P2,)
    private_slots: torch.Tensor  # (B*R,), request-major
    private_runs: tuple[torch.Tensor, torch.Tensor]  # request b's private keys (starts, lens)
    flat_slots: torch.Tensor  # (B*(P1+P2+R),), request-major: each request's whole path
    flat_runs: tuple[torch.Tensor, torch.Tensor]


def build_layout(case: Case, shapes: Shapes, gen: torch.Generator) -> Layout:
    n_slots = 1 + case.prefix + case.n_groups * case.prefix2 + case.batch * case.private
    row = (shapes.kv_heads, shapes.head_dim)
    k_pool = torch.randn(n_slots, *row, generator=gen).to(shapes.kv_dtype)  # slot 0: scratch
    v_pool = torch.randn(n_slots, *row, generator=gen).to(shapes.kv_dtype)
    q = torch.randn(case.batch, shapes.q_heads, shapes.head_dim, generator=gen)
    q = q.to(shapes.q_dtype)
    cursor = 1  # slots handed out in order, as a fresh pool does; slot 0 is scratch

    def take(n: int) -> torch.Tensor:
        nonlocal cursor
        cursor += n
        return torch.arange(cursor - n, cursor)  # (n,) int64 slots

    prefix_slots = take(case.prefix)
    group_slots = [take(case.prefix2) for _ in range(case.n_groups)]
    private = [take(case.private) for _ in range(case.batch)]
    paths = []
    for r in range(case.batch):
        mid = [group_slots[r // case.group]] if case.n_groups else []
        paths.append(torch.cat([prefix_slots, *mid, private[r]]))
    return Layout(
        k_pool, v_pool, q, prefix_slots, group_slots, torch.cat(private),
        runs([case.private] * case.batch), torch.cat(paths), runs([case.path_len] * case.batch),
    )  # fmt: skip


class Gatherer:
    """Pool rows -> (n, Hkv, D) K or V by slot index (index_select on (slots, Hkv*D) rows),
    for the implementations that do not read the pool in place.

    Fresh output per call by default; with `prealloc`, into a persistent workspace per `key`
    (as the attention backends' plans do), which removes page faults from the time. Rows
    stored narrower than the queries are converted to the queries' dtype after the gather
    (the torch kernels compute in one dtype), and that conversion is timed with it."""

    def __init__(self, prealloc: bool, dtype: torch.dtype) -> None:
        self.prealloc = prealloc
        self.dtype = dtype
        self.bufs: dict[str, torch.Tensor] = {}

    def __call__(self, key: str, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        rows = pool.view(pool.shape[0], -1)  # (num_slots, Hkv*D)
        if not self.prealloc:
            out = rows.index_select(0, slots).to(self.dtype)  # (n, Hkv*D): the gather traffic
        else:
            out = torch.index_select(rows, 0, slots, out=self._buf(key, rows, rows.dtype, slots))
            if out.dtype != self.dtype:  # converted into a workspace too
                out = self._buf(key + "/cast", rows, self.dtype, slots).copy_(out)
        return out.view(slots.numel(), *pool.shape[1:])  # (n, Hkv, D)

    def _buf(
        self, key: str, rows: torch.Tensor, dtype: torch.dtype, slots: torch.Tensor
    ) -> torch.Tensor:
        buf = self.bufs.get(key)
        if buf is None:
            buf = self.bufs[key] = rows.new_empty(slots.numel(), rows.shape[1], dtype=dtype)
        return buf


def run_flat(lay: Layout, case: Case, gather: Gatherer | None, scale: float) -> torch.Tensor:
    """Flat decode; gather is None when the kernels read the pool in place."""
    if gather is None:
        out, _ = kernels.pool_decode_attention(
            lay.q, lay.k_pool, lay.v_pool, lay.flat_slots, *lay.flat_runs, scale
        )
        return out
    k = gather("flat_k", lay.k_pool, lay.flat_slots)  # (B*path, Hkv, D)
    v = gather("flat_v", lay.v_pool, lay.flat_slots)
    own = [1] * case.batch, [case.path_len] * case.batch
    return kernels.private_attention(lay.q, k, v, *own, scale)[0]


def segment(
    lay: Layout,
    q: torch.Tensor,
    slots: torch.Tensor,
    gather: Gatherer | None,
    key: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, Hq, D) against one shared segment: read once for all n queries."""
    if gather is None:
        return kernels.pool_segment_attention(q, lay.k_pool, lay.v_pool, slots, scale)
    k, v = gather(key + "_k", lay.k_pool, slots), gather(key + "_v", lay.v_pool, slots)
    return kernels.segment_attention(q, k, v, scale)


def tree_in_place(lay: Layout, case: Case, scale: float) -> torch.Tensor:
    """Each part's kernel starts from the state of the parts before it: no merge pass."""
    k, v = lay.k_pool, lay.v_pool
    state = kernels.pool_segment_attention(lay.q, k, v, lay.prefix_slots, scale)  # (B,Hq,D),(B,Hq)
    if lay.group_slots:
        outs, lses = [], []
        for g, slots in enumerate(lay.group_slots):
            rows = slice(g * case.group, (g + 1) * case.group)  # the group's G requests
            prior = state[0][rows], state[1][rows]
            o, lse = kernels.pool_segment_attention(lay.q[rows], k, v, slots, scale, prior)
            outs.append(o)
            lses.append(lse)
        state = torch.cat(outs), torch.cat(lses)
    own = lay.private_slots, *lay.private_runs
    return kernels.pool_decode_attention(lay.q, k, v, *own, scale, prior=state)[0]


def run_tree(lay: Layout, case: Case, gather: Gatherer | None, scale: float) -> torch.Tensor:
    """Tree decode; gather is None when the kernels read the pool in place."""
    if gather is None:
        return tree_in_place(lay, case, scale)
    parts = [segment(lay, lay.q, lay.prefix_slots, gather, "p1", scale)]
    if lay.group_slots:
        outs, lses = [], []
        for g, slots in enumerate(lay.group_slots):
            qg = lay.q[g * case.group : (g + 1) * case.group]  # (G, Hq, D)
            o, lse = segment(lay, qg, slots, gather, "p2", scale)
            outs.append(o)
            lses.append(lse)
        parts.append((torch.cat(outs), torch.cat(lses)))
    kp = gather("own_k", lay.k_pool, lay.private_slots)  # (B*R, Hkv, D)
    vp = gather("own_v", lay.v_pool, lay.private_slots)
    lens = [1] * case.batch, [case.private] * case.batch
    parts.append(kernels.private_attention(lay.q, kp, vp, *lens, scale))
    stacked = torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts])
    out, _ = kernels.merge_states(*stacked)  # (B, Hq, D)
    return out


def time_round_robin(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall ms of each fn, called in turn `repeats` times after one warm-up each, so a busy
    period of the (shared) machine hits every side alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def traffic(case: Case, shapes: Shapes) -> dict[str, float]:
    """Bytes and FLOPs per side (see the module docstring)."""
    kv_row = shapes.kv_row_bytes()
    q_rows = case.batch * shapes.q_heads * shapes.head_dim * shapes.q_dtype.itemsize  # or outs
    flat_rows = case.batch * case.path_len
    tree_rows = case.prefix + case.n_groups * case.prefix2 + case.batch * case.private
    n_parts = 3 if case.prefix2 else 2
    merge = (n_parts + 1) * q_rows  # read N partial outputs, write 1
    return {
        "flat_bytes": flat_rows * kv_row + 2.0 * q_rows,  # K/V once, q in, out
        "tree_bytes": tree_rows * kv_row + 2.0 * n_parts * q_rows + merge,
        "flat_reread_bytes": (flat_rows - tree_rows) * kv_row,  # shared rows read again
        "flat_gather_bytes": 2.0 * flat_rows * kv_row,  # what a gather adds: write + re-read
        "tree_gather_bytes": 2.0 * tree_rows * kv_row,
        "flops": 4.0 * case.batch * case.path_len * shapes.head_dim * shapes.q_heads,
    }


def bounds_ms(case: Case, shapes: Shapes, roof: Roofline, cache_bw: float) -> dict[str, float]:
    tr = traffic(case, shapes)
    peak = max(roof.peak_flops(dt) for dt in compute_dtypes(shapes))
    side = {
        k: max(tr[f"{k}_bytes"] / roof.read_bw, tr["flops"] / peak) * 1e3 for k in ("tree", "flat")
    }
    reread = tr["flat_reread_bytes"]
    cached = max((tr["flat_bytes"] - reread) / roof.read_bw + reread / max(cache_bw, roof.read_bw),
                 tr["flops"] / peak) * 1e3  # fmt: skip
    return {
        "tree_bound_ms": side["tree"],
        "flat_bound_ms": side["flat"],
        "flat_bound_cached_ms": cached,
        "cache_read_GBps": cache_bw / 1e9,
        **tr,
    }


def compute_dtypes(shapes: Shapes) -> tuple[torch.dtype, ...]:
    """What a kernel may compute in: float32 always; the storage dtype where the queries have
    it too (a narrower pool under float32 queries is converted to float32 on load)."""
    if shapes.q_dtype == shapes.kv_dtype != torch.float32:
        return torch.float32, shapes.q_dtype
    return (torch.float32,)


def shared_read_bw(case: Case, shapes: Shapes) -> float:
    """Read bandwidth over a working set the size of the case's shared segments (what flat
    re-reads): the last-level cache's when they fit in it."""
    shared_rows = case.prefix + case.n_groups * case.prefix2
    nbytes = max(shared_rows * shapes.kv_row_bytes(), 1 << 16)
    return measure_read_bandwidth(nbytes, repeats=max(5, (64 << 20) // nbytes))


def run_case(
    case: Case, shapes: Shapes, roof: Roofline, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One result row per implementation."""
    lay = build_layout(case, shapes, torch.Generator().manual_seed(0))
    scale = shapes.head_dim**-0.5
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    for impl in args.impls:
        kernels.set_impl(impl)
        in_place = kernels.reads_pool_in_place(lay.q)
        gather = None if in_place else Gatherer(args.prealloc, shapes.q_dtype)
        for side, run in (("tree", run_tree), ("flat", run_flat)):
            fns[f"{impl}/{side}"] = _with_impl(impl, run, lay, case, gather, scale)
    diffs = {impl: _max_diff(fns[f"{impl}/tree"](), fns[f"{impl}/flat"]()) for impl in args.impls}
    times: dict[str, list[float]] = {}
    for impl in args.impls:  # sides of one impl interleaved; impls one after the other
        sides = {k: fn for k, fn in fns.items() if k.startswith(f"{impl}/")}
        times.update(time_round_robin(sides, args.repeats))
    bounds = bounds_ms(case, shapes, roof, shared_read_bw(case, shapes))
    return [_row(case, impl, times, bounds, diffs[impl]) for impl in args.impls]


def best_of(a: Roofline, b: Roofline) -> Roofline:
    """Each figure's best over two probes (a busy moment only ever lowers a probe)."""
    flops = {k: max(v, b.matmul_flops.get(k, 0.0)) for k, v in a.matmul_flops.items()}
    return Roofline(max(a.read_bw, b.read_bw), max(a.copy_bw, b.copy_bw), flops)


def rebound(case: Case, row: dict[str, Any], shapes: Shapes, roof: Roofline) -> dict[str, Any]:
    """The row's bounds and fractions recomputed against the final roofline."""
    times = {f"{row['impl']}/tree": [row["tree_ms"]], f"{row['impl']}/flat": [row["flat_ms"]]}
    bounds = bounds_ms(case, shapes, roof, row["cache_read_GBps"] * 1e9)
    new = _row(case, row["impl"], times, bounds, 0.0)
    keep = ("tree_median_ms", "flat_median_ms", "max_abs_diff_tree_vs_flat")
    return {**new, **{k: row[k] for k in keep}}


def _with_impl(impl: str, run: Callable, *args: Any) -> Callable[[], torch.Tensor]:
    def call() -> torch.Tensor:
        kernels.set_impl(impl)  # process-wide choice; a global store, nothing to time
        return run(*args)

    return call


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _row(
    case: Case, impl: str, times: dict[str, list[float]], bounds: dict[str, float], diff: float
) -> dict[str, Any]:
    tree, flat = times[f"{impl}/tree"], times[f"{impl}/flat"]
    tree_ms, flat_ms = min(tree), min(flat)
    roof_x = bounds["flat_bound_ms"] / bounds["tree_bound_ms"]
    roof_cached_x = bounds["flat_bound_cached_ms"] / bounds["tree_bound_ms"]
    return {
        **asdict(case),
        "label": case.label(),
        "impl": impl,
        "tree_ms": tree_ms,
        "flat_ms": flat_ms,
        "tree_median_ms": statistics.median(tree),
        "flat_median_ms": statistics.median(flat),
        "speedup": flat_ms / tree_ms,
        "roofline_speedup": roof_x,
        "speedup_of_roofline": flat_ms / tree_ms / roof_x,
        "roofline_speedup_cached": roof_cached_x,
        "speedup_of_roofline_cached": flat_ms / tree_ms / roof_cached_x,
        "flat_frac_of_bound_cached": bounds["flat_bound_cached_ms"] / flat_ms,
        "tree_frac_of_bound": bounds["tree_bound_ms"] / tree_ms,
        "flat_frac_of_bound": bounds["flat_bound_ms"] / flat_ms,
        "max_abs_diff_tree_vs_flat": diff,
        **bounds,
    }


HEADER = (
    f"{'sweep':<10}{'config':<34}{'impl':<8}{'tree ms':>9}{'flat ms':>9}{'speedup':>9}"
    f"{'roof x':>8}{'of roof':>8}{'tree bd':>9}{'%roof':>7}{'flat bd':>9}{'%roof':>7}"
    f"{'roof$ x':>8}{'of roof$':>9}{'flat bd$':>9}{'%roof$':>7}"
)


def format_row(r: dict[str, Any]) -> str:
    f = lambda k: float(r[k])  # noqa: E731
    return (
        f"{r['sweep']!s:<10}{r['label']!s:<34}{r['impl']!s:<8}{f('tree_ms'):>9.3f}"
        f"{f('flat_ms'):>9.3f}{f('speedup'):>8.2f}x{f('roofline_speedup'):>7.1f}x"
        f"{100 * f('speedup_of_roofline'):>7.0f}%{f('tree_bound_ms'):>9.3f}"
        f"{100 * f('tree_frac_of_bound'):>6.0f}%{f('flat_bound_ms'):>9.3f}"
        f"{100 * f('flat_frac_of_bound'):>6.0f}%{f('roofline_speedup_cached'):>7.1f}x"
        f"{100 * f('speedup_of_roofline_cached'):>8.0f}%{f('flat_bound_cached_ms'):>9.3f}"
        f"{100 * f('flat_frac_of_bound_cached'):>6.0f}%"
    )


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    impls = list(dict.fromkeys(r["impl"] for r in results))
    for ax, (sweep_name, key) in zip(
        axes, [("batch", "batch"), ("prefix", "prefix"), ("private", "private")], strict=False
    ):
        for impl in impls:
            rows = [r for r in results if r["sweep"] in (sweep_name, "headline")]
            rows = sorted((r for r in rows if r["impl"] == impl), key=lambda r: float(r[key]))
            xs = [float(r[key]) for r in rows]
            ax.plot(xs, [float(r["speedup"]) for r in rows], "o-", label=f"measured ({impl})")
        rows = sorted(
            (
                r
                for r in results
                if r["sweep"] in (sweep_name, "headline") and r["impl"] == impls[0]
            ),
            key=lambda r: float(r[key]),
        )
        ax.plot([float(r[key]) for r in rows], [float(r["roofline_speedup"]) for r in rows],
                "s--", label="roofline")  # fmt: skip
        ax.set_title(f"{sweep_name} sweep (others as the headline)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(key)
        ax.set_ylabel("flat / tree time")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="query dtype; auto: the model's compute dtype on this CPU")  # fmt: skip
    p.add_argument("--kv-dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="K/V pool dtype; auto: the engine's --kv-cache-dtype auto for "
                        "quantized weights")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny preset for tests")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (best and median)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=None,
                   help="kernel impls (default: native if it builds, and cpu)")  # fmt: skip
    p.add_argument("--only", nargs="+", default=None, help="run only these sweeps (names)")
    p.add_argument("--prealloc", action="store_true", help="gather into persistent workspaces")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG of the sweeps here")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 15)
    if args.impls is None:
        native_ok = kernels.native.auto_ok()
        args.impls = ["native", "cpu"] if native_ok else ["cpu"]
    return args


def pick_dtypes(q: str, kv: str) -> Shapes:
    """The queries' and the pool's dtypes ("auto": what the engine picks, see --help)."""
    q_dtype = resolve_dtype("auto", "cpu")[0] if q == "auto" else DTYPES[q]
    if kv != "auto":
        return Shapes(q_dtype, DTYPES[kv])
    return Shapes(q_dtype, kv_cache_dtype("auto", q_dtype, quantized=True, device="cpu")[0])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = pick_dtypes(args.dtype, args.kv_dtype)
    names = {v: k for k, v in DTYPES.items()}
    before = kernels.get_impl()
    probe_dtypes = compute_dtypes(shapes)
    roof = measure_roofline(probe_dtypes, quick=args.quick)
    print(f"roofline ({torch.get_num_threads()} threads, first probe): {roof.describe()}")
    cases = [c for c in sweep(args.quick) if not args.only or c.sweep in args.only]
    timed: list[tuple[Case, dict[str, Any]]] = []
    try:
        for case in cases:
            for row in run_case(case, shapes, roof, args):
                timed.append((case, row))
                print(f"  measured {case.label()} ({row['impl']})", file=sys.stderr, flush=True)
    finally:
        kernels.set_impl(before)
    roof = best_of(roof, measure_roofline(probe_dtypes, quick=args.quick))
    print(f"roofline (best of the probes before and after): {roof.describe()}")
    dt = f"queries {names[shapes.q_dtype]}, K/V {names[shapes.kv_dtype]}"
    print(f"{dt}, best of {args.repeats} interleaved rounds")
    print(HEADER)
    results = [rebound(case, row, shapes, roof) for case, row in timed]
    for row in results:
        print(format_row(row), flush=True)
    report = {
        "dtype": names[shapes.q_dtype],
        "kv_dtype": names[shapes.kv_dtype],
        "threads": torch.get_num_threads(),
        "impls": args.impls,
        "repeats": args.repeats,
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
