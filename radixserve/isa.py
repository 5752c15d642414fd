"""What this CPU does fast, and the compute dtype that follows: the one place it is decided.

Measured on the two kinds of x86 box this project runs on (2 cores each):
- Intel with AVX-512 + AMX: oneDNN bf16 matmuls reach ~2 TFLOP/s, 6x its fp32 rate.
- AMD EPYC Zen 3 with AVX2 + FMA + F16C only: fp32 matmuls reach ~179 GFLOP/s but bf16
  matmuls fall to ~1.3 GFLOP/s (oneDNN has no bf16 kernel there; torch runs a naive loop).
So `dtype="auto"` computes in bf16 only where the CPU has bf16 instructions (AMX tiles or
AVX512-BF16) and torch dispatches to its AVX-512 kernels; everywhere else in float32.

`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` make torch and oneDNN behave as on an
AVX2-only CPU; `cpu_isa()` honours the first (torch reports "AVX2" then), so the AVX2 path
can be tested on any machine. `RADIXSERVE_CPU_ISA=avx2|scalar` lowers it further for our own
kernels (e.g. to test the portable build on an AVX2 box).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from radixserve.config import DTYPES

logger = logging.getLogger("radixserve.isa")
ISAS = ("scalar", "avx2", "avx512")  # ascending: each implies the ones before it


@functools.cache
def cpu_isa() -> str:
    """The widest vector ISA our CPU kernels may use here: "avx512", "avx2" or "scalar"."""
    torch_isa = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", ...
    found = "avx512" if torch_isa.startswith("AVX512") else "avx2" if torch_isa == "AVX2" else ""
    if found == "avx2" and not _has_fma_f16c():
        found = "scalar"  # our AVX2 kernels also need FMA and F16C
    found = found or "scalar"
    override = os.environ.get("RADIXSERVE_CPU_ISA", "").lower()
    if override:
        if override not in ISAS:
            raise ValueError(f"RADIXSERVE_CPU_ISA must be one of {ISAS}, got {override!r}")
        if ISAS.index(override) < ISAS.index(found):
            found = override  # only ever lowered: a wider ISA than the CPU has would crash
    return found


def _has_fma_f16c() -> bool:
    flags = cpu_flags()
    if flags is None:
        return torch.cpu._is_avx2_supported()  # no /proc (macOS): trust torch's AVX2 check
    return {"fma", "f16c"} <= flags


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags (/proc/cpuinfo), or None where there is no /proc."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return None


VNNI_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"})


def quant_kernel_isa() -> str:
    """The build of the quantized-matmul kernels: "avx512vnni" where the AVX-512 ISA is in
    use and the CPU has AVX512-VNNI (int16 dot products into int32, 32 lanes), else
    cpu_isa() with "avx512" served by the AVX2 kernels."""
    isa = cpu_isa()
    if isa == "avx512":
        return "avx512vnni" if VNNI_FLAGS <= (cpu_flags() or frozenset()) else "avx2"
    return isa


def fast_cpu_bf16() -> bool:
    """Whether bf16 matmuls run fast here: bf16 instructions and AVX-512 dispatch in torch."""
    bf16_hw = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    onednn_capped = "AVX2" in os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return bf16_hw and cpu_isa() == "avx512" and not onednn_capped


def resolve_dtype(requested: str, device: str, int8_x: bool = False) -> tuple[torch.dtype, str]:
    """The compute dtype for `requested` ("auto" or a DTYPES name) on `device`, and why.
    `int8_x`: every matrix of the model rounds x to int8 (loader.int8_x_only); on a CPU
    "auto" is then float32, the dtype of the native decoder layers (two calls a layer, not
    ~25 torch ops: a 1B Q4_K_M decodes ~7 % faster than in bf16 on a Zen 4).

    An explicit dtype is always honoured; an explicit bfloat16 on a CPU without fast bf16
    logs a warning naming the cost.
    """
    on_cuda = device.startswith("cuda")
    if requested != "auto":
        dtype = DTYPES[requested]
        if dtype == torch.bfloat16 and not on_cuda and not fast_cpu_bf16():
            logger.warning(
                "dtype bfloat16 on a CPU without bf16 instructions (ISA %s): matmuls run "
                "~100x slower than float32 here; --dtype auto picks float32",
                cpu_isa(),
            )
        return dtype, "requested"
    if on_cuda:
        bf16 = torch.cuda.is_bf16_supported()
        return (torch.bfloat16, "GPU supports bf16") if bf16 else (torch.float16, "GPU: no bf16")
    if int8_x:
        return torch.float32, "int8 x in every matmul: float32 native decoder layers"
    if fast_cpu_bf16():
        return torch.bfloat16, f"CPU ISA {cpu_isa()} with bf16 instructions (AMX / AVX512-BF16)"
    return torch.float32, f"CPU ISA {cpu_isa()} has no fast bf16 matmul"
