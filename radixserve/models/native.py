"""Fused CPU ops for the decoder (radixserve/csrc/fused_cpu.cpp), bf16 or float32: RMSNorm
and the RoPE of the q/k heads, built once on first use.

`ops()` compiles the C++ source (radixserve/native_build.py) and returns the module, or None
where the build fails or native ops are off (EngineConfig.native_ops): the model then runs the
same math as plain torch ops.

Why: a decode step at batch 16 runs ~25 small ops per layer between the oneDNN matmuls,
and the chain of torch ops behind one RMSNorm (cast, pow, mean, rsqrt, mul, cast, mul)
cost more than its own kernels (measured: the layer's linears slow down when interleaved
with them). One call per RMSNorm made B=16 decode steps ~7 % faster on the 2-core dev CPU
(34.6 -> 32.1 ms); one call for RoPE (instead of flip, two products, a sum and a copy)
another 1–2 ms. Both compute the torch formulas' float32 math and roundings: bit for bit in
tests/test_models.py, except RMSNorm where torch itself reorders its float32 sum (large
inputs): within two bf16 ulps there (float32: a few float32 ulps). In float32 on the AVX2
EPYC, torch's RMSNorm chain cost ~40 us per call at batch 1 (61 calls a step). (A scalar
C++ SwiGLU was 5x slower than torch's vectorised silu and was dropped.)
"""

from __future__ import annotations

from types import ModuleType

import torch

from radixserve.native_build import CSRC, build, native_module

SOURCE = CSRC / "fused_cpu.cpp"


@native_module
def ops() -> ModuleType | None:
    """The compiled module (`rms_norm`, `rope_qk`), or None when native ops are off
    (EngineConfig.native_ops) or it cannot be built."""
    return build("radixserve_fused_cpu", SOURCE, None)


def applies(x: torch.Tensor) -> bool:
    """Whether the fused ops take `x`: bf16 / float32 rows on CPU with a unit column stride."""
    on_cpu = x.dtype in (torch.bfloat16, torch.float32) and x.device.type == "cpu"
    return on_cpu and x.dim() == 2 and x.stride(1) == 1
