"""Roofline probes: memory bandwidth and matmul FLOP/s of this machine, measured in-process.

Reusable by every benchmark (a sibling module of the scripts in benchmarks/):

    from roofline import measure_roofline
    roof = measure_roofline()                    # ~2 s; quick=True for tests
    bound = roof.bound_s(nbytes, flops, torch.bfloat16)
    print(roof.describe())

Probes (best of `repeats`, after one warm-up, into preallocated outputs so page faults on
fresh allocations are not timed):
- read bandwidth: `x.sum()` over a float32 tensor much larger than the caches; bytes = size.
- copy bandwidth: `y.copy_(x)`; bytes = 2 * size (read + write).
- matmul FLOP/s per dtype: `torch.mm(a, b, out=c)` on n x n (FLOPs = 2 n^3), the best over
  a few n: the peak depends on n (on this CPU bf16 runs on AMX tiles: ~1.3 TFLOP/s at
  n = 1024 on one idle core, far less at n = 2048 where operands spill the caches).
The roofline bound of a kernel is max(bytes / read bandwidth, FLOPs / matmul peak): the
attention kernels here mostly stream K/V, so read bandwidth is the relevant memory roof.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def best_time_s(fn: Callable[[], object], repeats: int) -> float:
    """Minimum wall time of `repeats` calls after one warm-up call (seconds)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_read_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of a streaming reduction over `nbytes` of float32."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    return x.numel() * 4 / best_time_s(lambda: x.sum(), repeats)


def measure_copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s (read + write counted) of copying `nbytes` into a preallocated tensor."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    y.fill_(0.0)  # touch every page before timing
    return 2 * x.numel() * 4 / best_time_s(lambda: y.copy_(x), repeats)


def measure_matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOPs)."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / best_time_s(lambda: torch.mm(a, b, out=c), repeats)


@dataclass(frozen=True)
class Roofline:
    read_bw: float  # bytes/s
    copy_bw: float  # bytes/s, read + write counted
    matmul_flops: dict[str, float] = field(default_factory=dict)  # str(dtype) -> FLOP/s

    def peak_flops(self, dtype: torch.dtype) -> float:
        assert str(dtype) in self.matmul_flops, f"no matmul probe for {dtype}: {self.matmul_flops}"
        return self.matmul_flops[str(dtype)]

    def bound_s(self, nbytes: float, flops: float, dtype: torch.dtype) -> float:
        """Lower bound on the time of a kernel moving `nbytes` and doing `flops` in `dtype`."""
        return max(nbytes / self.read_bw, flops / self.peak_flops(dtype))

    def as_dict(self) -> dict[str, float]:
        d = {"read_GBps": self.read_bw / 1e9, "copy_GBps": self.copy_bw / 1e9}
        d.update(
            {
                f"matmul_GFLOPs_{k.removeprefix('torch.')}": v / 1e9
                for k, v in self.matmul_flops.items()
            }
        )
        return d

    def describe(self) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in self.as_dict().items())


def measure_matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...] = (512, 1024, 2048)) -> float:
    """Best FLOP/s of `measure_matmul_flops` over the matrix sizes `sizes`."""
    return max(measure_matmul_flops(dtype, n) for n in sizes)


def measure_roofline(
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16), quick: bool = False
) -> Roofline:
    """All probes; `quick` uses small sizes (seconds -> tenths) at some loss of accuracy."""
    nbytes, sizes = (32 << 20, (256,)) if quick else (512 << 20, (512, 1024, 2048))
    flops = {str(dt): measure_matmul_peak(dt, sizes) for dt in dtypes}
    return Roofline(measure_read_bandwidth(nbytes), measure_copy_bandwidth(nbytes), flops)


if __name__ == "__main__":
    print(measure_roofline().describe())
