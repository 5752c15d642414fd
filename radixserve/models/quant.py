"""Block-quantized weights (GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4 and the K-quants Q4_K,
Q5_K, Q6_K) kept in their file layout, and the linear layer that multiplies by them
(radixserve/csrc/quant_cpu.cpp, built per CPU ISA on first use; the C++ file documents every
block format).

Why: a decode step at small batch reads every weight once, so its time is the weight bytes
over the memory bandwidth. Q4_1 stores 32 weights in 20 bytes (5 bits a weight) against
128 bytes in float32: ~6x fewer bytes per step. x is rounded to int16 per 32-block and the
block products are summed as exact integers (error <= amax / 65534 of each block: on
SmolLM2, |logprob delta| 7.8e-4 mean against float32, benchmarks/eval_quant.py;
tests/test_quant.py), by one of two kernels: up to the format's `small_m` rows, a
weight-streaming kernel (each weight block widened once for up to 16 rows of x; above 16
rows, once for 32); above it, an int16 GEMM (x transposed 8 rows a vector, madd at twice
the multiply-adds per instruction of a float32 FMA: ~1.2-1.5x dequantize + sgemm at
64-1024 rows, bench_quant.py). Both give a row the same bits (the same exact block sums,
scaled and summed in the same order), whatever rows share its call. A bf16 model with
BF16_TILED_M rows or more, on a CPU with fast bf16 matmuls, gets bf16 tiles and the bf16
GEMM instead (as if it held the dequantized weights in bf16); a build without AVX2
dequantizes float32 tiles into sgemm above `small_m`.

Layout of a weight (N, K): a uint8 tensor (N, K / block * block_bytes), row n holding the
blocks of output row n (32 weights a block; 256 a super-block for the K-quants). For the
K-quants x is rounded per 256-block, to 14, 13 and 12 bits for Q4_K, Q5_K and Q6_K (error
<= amax / 16382, 8190, 4094), so that a super-block's products, its sub-block scales
multiplied into the integer quants, sum exactly in int32 under one scale: one reduction
and one float32 scaling a super-block instead of eight.

Q4_K and Q6_K with int8 x (`activations="int8"`, the default: X8_CODES): x is rounded per
256-block as llama.cpp rounds activations (error <= amax / 254), and the quants meet it in
byte multiply-adds (VNNI vpdpbusd, AVX2 maddubs) without being widened: Q4_K 1.1-1.7x the
int16 kernels' speed at 1-64 rows on a 1B model's shapes (bench_quant.py). Its streaming
kernel runs at every M below the bf16 tiles, so a row's bits never depend on its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from torch import Tensor, nn

from radixserve.config import QUANT_ACTIVATIONS, QUANT_ACTIVATIONS_DEFAULT
from radixserve.isa import fast_cpu_bf16, quant_kernel_isa
from radixserve.native_build import CSRC, build, native_module

SOURCE = CSRC / "quant_cpu.cpp"
BLOCK = 32
SUPER_BLOCK = 256
# Rows from which a bf16 model's quantized linears run as bf16 tiles into the bf16 GEMM
# (weights rounded to bf16, as in a bf16 model holding the dequantized weights) instead of
# the int16 GEMM, where bf16 matmuls are fast (AVX512-BF16 / AMX). On a Zen 4 EPYC (AVX512-BF16,
# benchmarks/bench_quant.py) bf16 tiles take 1.2-1.6x the int16 GEMM's time at 48-64 rows, about
# the same at 96, 0.6-0.95x at 128, 0.6x at 1024.
BF16_TILED_M = 96
# A quantized projection as the native calls take it: per part its blocks, format code and
# small_m, then the bias.
NativeLinear = tuple[list[Tensor], list[int], list[int], Tensor | None]
Release = Callable[[Tensor], object] | None  # told of file-layout blocks no longer read


@dataclass(frozen=True)
class Format:
    name: str
    code: int  # the C++ enum
    block: int  # weights per block (K-quants: per super-block)
    block_bytes: int
    # Rows of x up to which the weight-streaming kernel beats the int16 GEMM, which widens
    # each weight once per call into a buffer and fills whole groups of 16 (VNNI) or 8 rows
    # of x: the legacy formats and Q8_0 to 32 rows (above 16 the streaming kernel's passes
    # hold 32 rows: on SmolLM2's and a 1B model's shapes the GEMM takes 1.3-1.75x its time
    # at 17-24 rows, 0.99-1.09x at 32, 0.93-0.96x at 48; Zen 4 EPYC); the K-quants with
    # int16 x, whose streaming kernel scales and reduces once a super-block, Q4_K and Q5_K to
    # 24 and Q6_K to 32 (on the 1B shape's 16384 x 2048 gate/up at 24 rows the GEMM takes
    # 1.13x the streaming kernel's time for Q4_K, 1.5x for Q6_K; at 32 rows 0.92x and 1.34x;
    # Zen 5 EPYC); benchmarks/bench_quant.py. Either kernel gives a row the same bits.
    small_m: int

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.block_bytes


FORMATS = {
    f.name: f
    for f in (
        Format("q4_0", 0, BLOCK, 18, 32),
        Format("q4_1", 1, BLOCK, 20, 32),
        Format("q8_0", 2, BLOCK, 34, 32),
        Format("q4_k", 3, SUPER_BLOCK, 144, 24),
        Format("q5_k", 4, SUPER_BLOCK, 176, 24),
        Format("q6_k", 5, SUPER_BLOCK, 210, 32),
        Format("q5_0", 6, BLOCK, 22, 32),
        Format("q5_1", 7, BLOCK, 24, 32),
        Format("mxfp4", 12, BLOCK, 17, 32),
    )
}
# The format codes of Q4_K and Q6_K weights with x rounded to int8 per 256-block, as
# llama.cpp rounds activations (error <= amax / 254 against the int16 path's amax / 16382
# and 4094): the kernels' byte multiply-adds do twice the products per instruction. Their
# weight-streaming kernel runs at any M (no GEMM), so a row's bits never depend on the rows
# beside it.
X8_CODES = {"q4_k": 8, "q6_k": 9}
X8_SMALL_M = 1 << 30  # the rows up to which it streams: all
# The format codes of Q8_0 and MXFP4 weights with x rounded to int8 per 32-block (as
# llama.cpp rounds activations for them): each block's exact byte products summed, scaled
# and added to the row in block order; in the file layout up to the format's small_m rows
# (decode, draft verification), the int16 GEMM above (prefill). MXFP4 weights (gpt-oss's
# experts) take them under `activations="int8"`, in tiles (PACKED_CODES) where the build
# packs; Q8_0 weights keep int16 x by default (its code is for callers that pick it).
B8_CODES = {"q8_0": 13, "mxfp4": 14}
B8_BY_DEFAULT = {"mxfp4"}  # the formats whose x is int8 under activations="int8"
# The int8-x weights packed once into tiles of PACK_ROWS rows (AVX2 builds, `pack`), with
# the file layout's results bit for bit (radixserve/csrc/quant_cpu.cpp), streamed at any M:
# - Q4_K / Q6_K: each super-block's bytes in the kernel's lane order with its scales
#   decoded, so the kernel masks nibbles instead of shuffling bytes and decoding 6-bit
#   scales ("packed K-quant tiles"; a 1B Q4_K_M decodes 128 tokens in ~0.9x the file
#   layout's time, docs/cpu.md);
# - MXFP4: 16 rows' codes interleaved 4 weights a row, so one vector of bytes meets 4
#   bytes of x in 16 rows' lanes and each block's sum ends in its row's lane (no horizontal
#   sums), 16 rows' scales in one load ("legacy blocks with int8 x"; its bytes are the
#   file's). A gpt-oss expert's rows at one row of x: docs/cpu.md.
PACKED_CODES = {"q4_k": 10, "q6_k": 11, "mxfp4": 15}
PACKED_BYTES = {"q4_k": 148, "q6_k": 210, "mxfp4": 17}  # a block in tiles (file: 144, 210, 17)
PACK_ROWS = {"q4_k": 8, "q6_k": 8, "mxfp4": 16}
PACK_SLICE_BYTES = 32 << 20  # file bytes packed (and released) at a time
# Formats made by llama.cpp's quantizer (and, MXFP4, by model authors), not by `quantize`
# below: the `gguf` package's dequantization is their reference (the others' reference is
# `dequantize` below).
LLAMA_CPP_ONLY = {
    "q4_k": GGMLQuantizationType.Q4_K, "q5_k": GGMLQuantizationType.Q5_K,
    "q6_k": GGMLQuantizationType.Q6_K, "q5_0": GGMLQuantizationType.Q5_0,
    "q5_1": GGMLQuantizationType.Q5_1, "mxfp4": GGMLQuantizationType.MXFP4,
}  # fmt: skip


@native_module
def ops() -> ModuleType | None:
    """The compiled kernels for this CPU's ISA, or None (no compiler, or native ops off:
    quantized linears then dequantize with torch ops, correct but slow)."""
    return build("radixserve_quant", SOURCE, quant_kernel_isa())


def dequantize(blocks: Tensor, fmt: str, k: int) -> Tensor:
    """Reference dequantization: blocks (N, row bytes) uint8 -> (N, K) float32 (the formats
    of LLAMA_CPP_ONLY by the `gguf` package's numpy reference)."""
    f = FORMATS[fmt]
    n = blocks.shape[0]
    if fmt in LLAMA_CPP_ONLY:
        values = gguf_dequantize(blocks.numpy(), LLAMA_CPP_ONLY[fmt])  # (N, K) float32
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(n, k)
    b = blocks.view(n, k // BLOCK, f.block_bytes)  # (N, K/32, bytes)
    d = b[..., :2].contiguous().view(torch.float16).float()  # (N, K/32, 1)
    if fmt == "q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()  # (N, K/32, 32)
        return (d * q).view(n, k)
    qs = b[..., 4:] if fmt == "q4_1" else b[..., 2:]  # (N, K/32, 16)
    q = torch.cat((qs & 15, qs >> 4), dim=-1).float()  # (N, K/32, 32): low nibbles first
    m = b[..., 2:4].contiguous().view(torch.float16).float() if fmt == "q4_1" else -8 * d
    return (d * q + m).view(n, k)


def pack(native: ModuleType, blocks: Tensor, fmt: str, k: int, release: Release = None) -> Tensor:
    """Blocks of a PACKED_CODES format (N, row bytes) in the file layout, N a multiple of
    its PACK_ROWS -> their tiles (N, K / block * PACKED_BYTES), by `native` (a build that
    `packs`), PACK_SLICE_BYTES of blocks at a time; `release` is told of each slice once
    packed."""
    n, rows = blocks.shape[0], PACK_ROWS[fmt]
    out = torch.empty(n, k // FORMATS[fmt].block * PACKED_BYTES[fmt], dtype=torch.uint8)
    step = max(1, PACK_SLICE_BYTES // (blocks.shape[1] * rows)) * rows
    for r in range(0, n, step):  # tile t is rows t * rows .. of either layout
        native.pack(blocks[r : r + step], FORMATS[fmt].code, k, out[r : r + step])
        if release is not None:
            release(blocks[r : r + step])
    return out


def quantize(w: Tensor, fmt: str) -> Tensor:
    """(N, K) float weights -> blocks in `fmt` (round to nearest; GGUF's reference scheme:
    Q8_0 / Q4_0 scale by the block's max magnitude, Q4_1 spans the block's [min, max])."""
    n, k = w.shape
    assert fmt not in LLAMA_CPP_ONLY, f"{fmt} files are made by llama.cpp's quantizer, not here"
    assert k % BLOCK == 0, f"K={k} is not a multiple of {BLOCK}"
    x = w.float().reshape(n, k // BLOCK, BLOCK)  # (N, K/32, 32)
    if fmt == "q8_0":
        d = (x.abs().amax(-1, keepdim=True) / 127).half()
        q = torch.round(x / d.float().clamp_min(1e-30)).clamp(-127, 127).to(torch.int8)
        return _pack(n, [d.view(torch.uint8), q.view(torch.uint8)])
    if fmt == "q4_1":
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d, m = ((hi - lo) / 15).half(), lo.half()
        q = torch.round((x - m.float()) / d.float().clamp_min(1e-30)).clamp(0, 15)
        scales = [d.view(torch.uint8), m.view(torch.uint8)]
    else:  # q4_0: the signed value of largest magnitude maps to -8
        mx = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))
        d = (mx / -8).half()
        q = torch.round(x / d.float().where(d != 0, 1.0) + 8).clamp(0, 15)
        scales = [d.view(torch.uint8)]
    q = q.to(torch.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # (N, K/32, 16)
    return _pack(n, [*scales, nibbles])


def _pack(n: int, parts: list[Tensor]) -> Tensor:
    """Concatenate per-block byte fields (N, K/32, *) into rows (N, K/32 * block_bytes)."""
    return torch.cat(parts, dim=-1).reshape(n, -1).contiguous()


NativeParts = tuple[list[Tensor], list[int], list[int]]  # blocks, format codes, small_m


def native_parts(
    parts: Sequence[QuantWeight | QuantStack], activations: str, release: Release
) -> NativeParts:
    """Each part's blocks, format code and small_m as the native calls take them; parts with
    int8 x packed into tiles (PACKED_CODES) where the build packs, `release` told of each
    packed slice of file-layout blocks. A part's blocks may have leading dims (stacked
    experts: (E, N, row bytes)); they pack as one (E * N)-row weight, tile by tile."""
    native = ops()
    blocks, codes, small = [], [], []
    for p in parts:
        int8 = p.fmt in X8_CODES and activations == "int8"
        b8 = p.fmt in B8_BY_DEFAULT and activations == "int8"
        tiles_fit = p.fmt in PACK_ROWS and p.blocks.shape[-2] % PACK_ROWS[p.fmt] == 0
        if (int8 or b8) and tiles_fit and native is not None and native.packs:
            rows = p.blocks.reshape(-1, p.blocks.shape[-1])  # (E * N, row bytes): a view
            tiles = pack(native, rows, p.fmt, p.in_features, release)
            blocks.append(tiles.view(*p.blocks.shape[:-1], tiles.shape[-1]))
            codes.append(PACKED_CODES[p.fmt])
            small.append(X8_SMALL_M)
            continue
        blocks.append(p.blocks)
        codes.append(X8_CODES[p.fmt] if int8 else B8_CODES[p.fmt] if b8 else FORMATS[p.fmt].code)
        small.append(X8_SMALL_M if int8 else FORMATS[p.fmt].small_m)
    return blocks, codes, small


def unread(blocks: Sequence[Tensor], codes: Sequence[int]) -> list[Tensor]:
    """The file-layout blocks whose packed copies (codes in PACKED_CODES) are read instead."""
    packed = set(PACKED_CODES.values())
    return [b for b, code in zip(blocks, codes) if code in packed]


@dataclass(frozen=True)
class QuantWeight:
    """A block-quantized (N, K) weight: `blocks` (N, row bytes) uint8 in `fmt`, K =
    `in_features` (see the module doc)."""

    blocks: Tensor
    fmt: str
    in_features: int

    def __post_init__(self) -> None:
        f = FORMATS[self.fmt]
        k, blocks = self.in_features, self.blocks
        assert k % f.block == 0, f"in_features {k} not a multiple of {f.block}"
        want = (blocks.shape[0], f.row_bytes(k))
        assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == want, (blocks.shape, want)


@dataclass(frozen=True)
class QuantStack:
    """E block-quantized (N, K) weights stacked, one per expert: `blocks` (E, N, row bytes)
    uint8 in `fmt` (a mixture of experts' ffn_*_exps tensor, as a view of the file's map)."""

    blocks: Tensor
    fmt: str
    in_features: int

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, e: int) -> QuantWeight:
        """Expert e's (N, K) weight, a view of the stack's bytes."""
        return QuantWeight(self.blocks[e], self.fmt, self.in_features)


class QuantLinear(nn.Module):
    """y = x @ W.T + bias, W the quantized `parts` stacked by rows (a fused projection whose
    parts may differ in format, e.g. Q4_K q/k with a Q6_K v); x (..., K) in any float dtype,
    y in x's dtype.

    Runs the kernel the module doc picks for x's rows and dtype, part by part; `activations`
    "int8" rounds x to int8 for Q4_K and Q6_K parts (X8_CODES), "int16" keeps every part's x
    int16.
    Holds each part's bytes as a buffer (`blocks0`, `blocks1`, ...), used in place: a part
    may be a read-only view of a memory-mapped file, and is never written.
    """

    def __init__(
        self,
        parts: Sequence[QuantWeight],
        bias: Tensor | None,
        activations: str = QUANT_ACTIVATIONS_DEFAULT,
    ) -> None:
        super().__init__()
        assert parts and len({p.in_features for p in parts}) == 1, "parts of one K"
        assert activations in QUANT_ACTIVATIONS, activations
        self.activations = activations
        self.formats = [FORMATS[p.fmt] for p in parts]
        self.in_features = parts[0].in_features
        self.out_features = sum(p.blocks.shape[0] for p in parts)
        self._names = [f"blocks{i}" for i in range(len(parts))]
        for name, part in zip(self._names, parts):
            self.register_buffer(name, part.blocks)
        self.bias: Tensor | None
        self.register_buffer("bias", bias)
        self._native_arg: NativeLinear | None = None

    @property
    def parts(self) -> list[QuantWeight]:
        return [
            QuantWeight(b, f.name, self.in_features) for b, f in zip(self._blocks(), self.formats)
        ]

    def _blocks(self) -> list[Tensor]:
        blocks = [self._buffers[n] for n in self._names]
        return [b for b in blocks if b is not None]  # (all set: registered in __init__)

    def forward(self, x: Tensor) -> Tensor:
        # (Lean on purpose: a batch-1 decode step makes ~120 of these calls.)
        x2 = x.reshape(-1, self.in_features)
        native = ops()
        bf16_tiles = x2.dtype == torch.bfloat16 and x2.shape[0] >= BF16_TILED_M
        if native is not None and bf16_tiles and fast_cpu_bf16():
            x2 = x2.contiguous()
            y = torch.cat(
                [native.qmatmul_tiled(x2, b, f.code, self.in_features)
                 for b, f in zip(self._blocks(), self.formats)], dim=1,
            )  # fmt: skip
            y = y if self.bias is None else y.add_(self.bias)
            return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()  # (M, K)
        if native is None:
            w = torch.cat(
                [
                    dequantize(b, f.name, self.in_features)
                    for b, f in zip(self._blocks(), self.formats)
                ]
            )
            y = x2 @ w.T if self.bias is None else x2 @ w.T + self.bias
        else:  # float32 throughout; one rounding to x's dtype, after the bias
            y = native.qlinear(x2, self._native_arg or self.native_arg())
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def native_arg(self, release: Release = None) -> NativeLinear:
        """This projection as the native calls take it (`qlinear`, llama.NativeLayer): made
        once, and again after the buffers are replaced (`_apply`, `_load_from_state_dict`).
        Parts with int8 x are packed into tiles here (PACKED_CODES) where the build packs,
        PACK_SLICE_BYTES of the file layout at a time; `release` is then called on each
        slice of file-layout blocks once it is packed (the loader drops its file pages)."""
        if self._native_arg is None:
            parts = native_parts(self.parts, self.activations, release)
            self._native_arg = (*parts, self._buffers["bias"])
        return self._native_arg

    def unread_blocks(self) -> list[Tensor]:
        """The parts' file-layout blocks whose packed copies the native calls read instead
        (none before native_arg is made)."""
        if self._native_arg is None:
            return []
        return unread(self._blocks(), self._native_arg[1])

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        self._native_arg = None
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._native_arg = None
        super()._load_from_state_dict(*args, **kwargs)

    def rows(self, ids: Tensor) -> Tensor:
        """Rows `ids` (int64) of the dequantized weight -> (len(ids), K) float32 (token
        embeddings from a quantized table, a single part)."""
        (part,) = self.parts
        native = ops()
        if native is None:
            return dequantize(part.blocks[ids], part.fmt, self.in_features)
        return native.dequant(part.blocks, FORMATS[part.fmt].code, self.in_features, ids)
