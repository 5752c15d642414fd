"""Block-quantized weights (radixserve/models/quant.py, gguf_weights.py): kernels against the
reference dequantization, the reference against the `gguf` package's own, the GGUF reader
against the transformers-converted checkpoint, and quantized models against float32 ones."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import psutil
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from helpers import alloc_slots, extend, greedy_generate, make_pool
from test_model_sources import tiny_qwen2

from radixserve import Engine, isa, kernels
from radixserve.attention.flat import FlatBackend
from radixserve.config import EngineConfig
from radixserve.isa import cpu_isa, fast_cpu_bf16, quant_kernel_isa, resolve_dtype
from radixserve.models import load_model, resolve_model_path
from radixserve.models.gguf_weights import (
    gguf_tensors,
    mapped,
    matrix_formats,
    read_gguf_weights,
    release_pages,
    unpermute_rows,
)
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.loader import int8_x_only, load_config
from radixserve.models.quant import (
    B8_CODES,
    BF16_TILED_M,
    FORMATS,
    LLAMA_CPP_ONLY,
    PACK_ROWS,
    PACKED_CODES,
    SOURCE,
    X8_CODES,
    QuantLinear,
    QuantWeight,
    dequantize,
    ops,
    pack,
    quantize,
)
from radixserve.models.resolve import embedded_gguf, gguf_source
from radixserve.models.synthetic import build_tiny_model, copy_tokenizer, random_blocks
from radixserve.native_build import build, native_ops_enabled, use_native_ops
from radixserve.worker.model_worker import file_mapped_bytes, kv_capacity

GGML = {"q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
        "q8_0": GGMLQuantizationType.Q8_0, **LLAMA_CPP_ONLY}  # fmt: skip
LEGACY = ["q4_0", "q4_1", "q8_0"]  # the formats radixserve can quantize to itself
# float32 matmul of the same dequantized weights, summed in another order: relative to the
# size of |x| @ |w|.T (the sum of absolute products), errors stay ~K * 2^-24.
REL_TOL = 1e-5


def _weights(n: int, k: int, fmt: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt in LLAMA_CPP_ONLY:
        blocks = torch.from_numpy(random_blocks(n, k, fmt, seed))
    else:
        g = torch.Generator().manual_seed(seed)
        blocks = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    return blocks, dequantize(blocks, fmt, k)


def widths(fmt: str) -> list[int]:
    """Two row widths K for the format: one block (or super-block), and several."""
    return [256, 768] if FORMATS[fmt].block == 256 else [32, 576]


def q16_rows(x: torch.Tensor, fmt: str = "q4_1") -> torch.Tensor:
    """x (M, K) as the integer kernels see it: each 32-block (K-quants: 256-block) rounded
    to int16 steps of amax / Q (Q = 32767; Q4_K 8191, Q5_K 4095, Q6_K 2047, which keep a
    super-block's integer sum within int32), returned dequantized."""
    qmax = {"q4_k": 8191, "q5_k": 4095, "q6_k": 2047}.get(fmt, 32767)
    b = x.view(x.shape[0], -1, FORMATS[fmt].block)
    amax = b.abs().amax(-1, keepdim=True)
    # Q / amax divided as the kernels divide it (torch's scalar / tensor takes a reciprocal)
    inverse = torch.full_like(amax, float(qmax)) / amax
    q = torch.round(b * torch.where(amax > 0, inverse, torch.zeros_like(amax)))
    return (q * (amax / qmax)).view_as(x)


def _close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    err = ((got.double() - want).abs() / scale).max().item()
    assert err <= REL_TOL, f"relative error {err:.2e} > {REL_TOL:.0e}"


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_reference_and_native_dequantize_match_the_gguf_package(fmt: str) -> None:
    """Bit for bit: the reference (quant.dequantize), the native row dequantization and the
    float32 tiles of qmatmul_tiled (a product with the identity) all give the `gguf`
    package's weights."""
    k = widths(fmt)[1]
    blocks, ours = _weights(24, k, fmt, seed=1)
    theirs = gguf_dequantize(blocks.numpy(), GGML[fmt])
    np.testing.assert_array_equal(ours.numpy(), theirs)
    native = ops()
    assert native is not None
    rows = native.dequant(blocks, FORMATS[fmt].code, k, torch.arange(24))
    np.testing.assert_array_equal(rows.numpy(), theirs)
    tiles = native.qmatmul_tiled(torch.eye(k), blocks, FORMATS[fmt].code, k)  # (K, N) = w.T
    np.testing.assert_array_equal(tiles.T.numpy(), theirs)


def test_mxfp4_scales_at_every_exponent_match_the_gguf_package() -> None:
    """MXFP4's E8M0 scale 2^(e - 128) at every exponent byte, the subnormal 2^-128 and
    2^-127 of e = 0, 1 and the overflow to inf of e = 255 included; then the kernels at the
    exponents whose scale times x's (about 2^-14) stays a normal float32."""
    native = ops()
    assert native is not None
    k, code = 64, FORMATS["mxfp4"].code
    blocks = torch.from_numpy(random_blocks(256, k, "mxfp4", seed=3)).view(256, 2, 17)
    blocks[:, :, 0] = torch.arange(256, dtype=torch.uint8)[:, None]  # row e: exponent byte e
    blocks = blocks.reshape(256, -1)
    with np.errstate(over="ignore"):  # e = 255: 12 * 2^127
        theirs = gguf_dequantize(blocks.numpy(), GGMLQuantizationType.MXFP4)
        ours = dequantize(blocks, "mxfp4", k).numpy()
    assert 0 < np.abs(theirs[0][theirs[0] != 0]).min() < 2**-126 and np.isinf(theirs[255]).any()
    np.testing.assert_array_equal(ours, theirs)
    rows = native.dequant(blocks, code, k, torch.arange(256))
    np.testing.assert_array_equal(rows.numpy(), theirs)
    tiles = native.qmatmul_tiled(torch.eye(k), blocks[:250], code, k)  # 12 * 2^(e - 128) finite
    np.testing.assert_array_equal(tiles.T.numpy(), theirs[:250])
    normal = blocks[20:250]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    small = native.qmatmul_small(x, normal, code, k)
    _close(small, q16_rows(x), dequantize(normal, "mxfp4", k))
    assert torch.equal(native.qmatmul_gemm(x, normal, code, k), small)
    if native.packs:  # tiles decode 16 rows' exponents at once, subnormal scales included
        file_rows = blocks[:240]  # 12 * 2^(239 - 128) * x stays finite
        tiles = pack(native, file_rows, "mxfp4", k)
        x[1, 7] = float("inf")
        got = native.qmatmul_small(x, tiles, PACKED_CODES["mxfp4"], k)
        want = native.qmatmul_small(x, file_rows, B8_CODES["mxfp4"], k)
        assert torch.equal(got[[0, 2]], want[[0, 2]]) and bool(got[[0, 2]].isfinite().all())
        assert bool(got[1].isnan().all()) and bool(want[1].isnan().all())


@pytest.mark.parametrize("fmt", LEGACY)
def test_quantize_error_is_within_half_a_step(fmt: str) -> None:
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    back = dequantize(quantize(w, fmt), fmt, 64).view(16, 2, 32)
    blocks = w.view(16, 2, 32)
    span = blocks.amax(-1) - blocks.amin(-1)
    step = {"q8_0": blocks.abs().amax(-1) / 127, "q4_0": blocks.abs().amax(-1) / 8,
            "q4_1": span / 15}[fmt]  # fmt: skip
    err = (back - blocks).abs().amax(-1)
    # Half a step (a whole one for Q4_0, whose code 16 for -max clamps to 15: the format has
    # 8 negative codes and 7 positive ones), plus the fp16 rounding of the scale.
    steps = 1.0 if fmt == "q4_0" else 0.5
    assert bool((err <= step * (steps + 16 * 2**-10) + 1e-6).all()), (err / step).max()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 67, 130])
@pytest.mark.parametrize("wide", [False, True])
def test_native_kernels_match_reference(fmt: str, m: int, wide: bool) -> None:
    native = ops()
    assert native is not None, "the quantized kernels must build on the test machines"
    k = widths(fmt)[wide]
    blocks, w = _weights(75, k, fmt, seed=m)  # 75 rows: not a multiple of any tile or panel
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
    code = FORMATS[fmt].code
    _close(native.qmatmul_small(x, blocks, code, k), q16_rows(x, fmt), w)  # int16 activations
    _close(native.qmatmul_gemm(x, blocks, code, k), q16_rows(x, fmt), w)  # (130: > a pass)
    _close(native.qmatmul_tiled(x, blocks, code, k), x, w)  # exact float32 activations


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_weight_streaming_rows_do_not_depend_on_the_rows_beside_them(fmt: str) -> None:
    """Each row of x (a decode batch, a draft's verification rows) gets the bits it gets
    alone, whatever its position: 16-row, 8-row and single-row weight tasks, x rows in one
    pass up to 16, then in passes of 32 (beyond small_m too)."""
    native = ops()
    assert native is not None
    k = widths(fmt)[1]
    blocks, _ = _weights(16 * 5 + 8 + 3, k, fmt, seed=7)
    x = torch.randn(2 * 32 + 5, k, generator=torch.Generator().manual_seed(7))
    code = FORMATS[fmt].code
    alone = torch.cat([native.qmatmul_small(x[i : i + 1], blocks, code, k) for i in range(len(x))])
    for m in range(2, len(x) + 1):
        assert torch.equal(native.qmatmul_small(x[:m], blocks, code, k), alone[:m]), m
    assert torch.equal(native.qmatmul_small(x.flip(0), blocks, code, k), alone.flip(0))


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int16_gemm_gives_the_weight_streaming_bits(fmt: str) -> None:
    """The int16 GEMM (above small_m) gives every row the bits the weight-streaming kernel
    gives it, weight rows beyond whole 16- and 8-row tasks included: the same exact block
    sums, scaled and summed in the same order. A row's result does not depend on how many
    rows share its step."""
    native = ops()
    assert native is not None and native.int_gemm
    k = widths(fmt)[1]
    blocks, _ = _weights(16 * 4 + 8 + 3, k, fmt, seed=11)
    code = FORMATS[fmt].code
    for m in (1, 7, 16, 40):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        small = native.qmatmul_small(x, blocks, code, k)
        gemm = native.qmatmul_gemm(x, blocks, code, k)
        assert torch.equal(small, gemm), (m, (small - gemm).abs().max().item())


def test_int16_gemm_is_built_where_avx2_is() -> None:
    """The int16 GEMM is the AVX2 build's path above small_m; a portable build falls back."""
    native = ops()
    assert native is not None
    assert native.int_gemm == (cpu_isa() != "scalar")


@pytest.mark.kernels
@pytest.mark.skipif(quant_kernel_isa() != "avx512vnni", reason="needs a CPU with AVX512-VNNI")
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 8, 16, 17, 40])
def test_vnni_kernels_equal_the_avx2_kernels(fmt: str, m: int) -> None:
    """The AVX512-VNNI build (16 weight rows a task at batch 1, 16-row groups in the int16
    GEMM) gives the AVX2 build's results bit for bit: the same integer block sums, scaled
    and summed in the same order."""
    wide, narrow = ops(), build("radixserve_quant", SOURCE, "avx2")
    assert wide is not None and narrow is not None
    assert wide.vnni and not narrow.vnni
    k = widths(fmt)[1]
    blocks, _ = _weights(16 * 5 + 8 + 3, k, fmt, seed=5)  # 16-row, 8-row and single-row tasks
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(6 + m))
    int8 = {**X8_CODES, **B8_CODES}
    codes = [FORMATS[fmt].code] + ([int8[fmt]] if fmt in int8 else [])  # int8 x too
    for code in codes:
        for kernel in ("qmatmul_small", "qmatmul_gemm"):
            got, want = (getattr(mod, kernel)(x, blocks, code, k) for mod in (wide, narrow))
            assert torch.equal(got, want), (kernel, code)
    if fmt in PACKED_CODES:  # the same tiles from either build, the same bits from them
        whole = blocks[: len(blocks) // PACK_ROWS[fmt] * PACK_ROWS[fmt]]
        tiles = pack(wide, whole, fmt, k)
        assert torch.equal(tiles, pack(narrow, whole, fmt, k))
        got, want = (mod.qmatmul_small(x, tiles, PACKED_CODES[fmt], k) for mod in (wide, narrow))
        assert torch.equal(got, want)


def q8_rows(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the int8 kernels see it (Q4_K with int8 x): each 256-block rounded as
    llama.cpp rounds activations (Q8_K: its first value of largest magnitude v maps to
    -127, q = min(127, round(x * -127 / v)), d = 1 / (-127 / v)), returned dequantized."""
    b = x.view(x.shape[0], -1, 256)
    v = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))
    iscale = torch.full_like(v, -127.0) / v
    q = torch.round(b * iscale).clamp(max=127)
    return (q * (1 / iscale)).view_as(x)


def q8_block_rows(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) as the int8 kernels of Q8_0 and MXFP4 see it: each 32-block rounded to
    int8 steps of amax / 127 (half to even), returned dequantized."""
    b = x.view(x.shape[0], -1, 32)
    amax = b.abs().amax(-1, keepdim=True)
    inverse = torch.full_like(amax, 127.0) / amax
    q = torch.round(b * torch.where(amax > 0, inverse, torch.zeros_like(amax)))
    return (q * (amax / 127)).view_as(x)


@pytest.mark.parametrize("fmt", list(B8_CODES))
@pytest.mark.parametrize("m", [1, 2, 8, 9, 17, 40])
@pytest.mark.parametrize("wide", [False, True])
def test_int8_block_kernels_match_reference_and_keep_rows_apart(
    fmt: str, m: int, wide: bool
) -> None:
    """Q8_0 and MXFP4 with x rounded to int8 per 32-block (B8_CODES): the streaming loop at
    any M equals the reference on the rounded x (exact byte products, 1 or 18 blocks a row:
    an odd count's last block alone), each row's bits are its bits alone, and above small_m
    the call runs the int16 GEMM of the same weights."""
    native = ops()
    assert native is not None
    k = widths(fmt)[wide]
    blocks, w = _weights(16 * 3 + 8 + 3, k, fmt, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
    code = B8_CODES[fmt]
    got = native.qmatmul_small(x, blocks, code, k)
    _close(got, q8_block_rows(x), w)
    alone = torch.cat([native.qmatmul_small(x[i : i + 1], blocks, code, k) for i in range(m)])
    assert torch.equal(got, alone)
    if native.int_gemm:
        plain = native.qmatmul_gemm(x, blocks, FORMATS[fmt].code, k)
        assert torch.equal(native.qmatmul_gemm(x, blocks, code, k), plain)


@pytest.mark.parametrize("fmt", list(X8_CODES))
@pytest.mark.parametrize("m", [1, 2, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("k", [256, 768])
def test_int8_activation_kernels_match_reference(fmt: str, m: int, k: int) -> None:
    """Q4_K and Q6_K with int8 x (X8_CODES): the product with x rounded as llama.cpp rounds
    it, from qmatmul_small and qmatmul_gemm (which runs the same loops at any M)."""
    native = ops()
    assert native is not None
    blocks, w = _weights(16 * 2 + 8 + 3, k, fmt, seed=m)  # 16-row, 8-row, single rows
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + m))
    for kernel in (native.qmatmul_small, native.qmatmul_gemm):
        _close(kernel(x, blocks, X8_CODES[fmt], k), q8_rows(x), w)


@pytest.mark.parametrize("fmt", list(PACKED_CODES))
@pytest.mark.parametrize("m", [1, 5, 16, 17, 40])
def test_packed_tiles_give_the_file_layouts_bits(fmt: str, m: int) -> None:
    """Q4_K and Q6_K packed into tiles of 8 rows, MXFP4 into tiles of 16 (PACKED_CODES):
    the same products as the file layout with int8 x, bit for bit, at any M (K-quants from
    16-row and 8-row tasks), and the MXFP4 product is the reference's on the rounded x."""
    native = ops()
    assert native is not None and native.packs == native.int_gemm  # AVX2 builds pack
    k, n = 768, 16 * 2 + PACK_ROWS[fmt]
    blocks, w = _weights(n, k, fmt, seed=20 + m)
    tiles = pack(native, blocks, fmt, k)
    row_bytes = {"q4_k": k // 256 * 148, "q6_k": k // 256 * 210, "mxfp4": k // 32 * 17}[fmt]
    assert tiles.shape == (n, row_bytes)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = native.qmatmul_small(x, blocks, {**X8_CODES, **B8_CODES}[fmt], k)
    for kernel in (native.qmatmul_small, native.qmatmul_gemm):
        assert torch.equal(kernel(x, tiles, PACKED_CODES[fmt], k), want)
    if fmt in B8_CODES:
        _close(want, q8_block_rows(x), w)


def test_packing_refuses_what_it_cannot_tile() -> None:
    native = ops()
    assert native is not None
    q4k, _ = _weights(12, 256, "q4_k", seed=1)
    q40, _ = _weights(16, 256, "q4_0", seed=1)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="multiples of 8"):
        pack(native, q4k, "q4_k", 256)
    mxfp4, _ = _weights(24, 256, "mxfp4", seed=1)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        pack(native, mxfp4, "mxfp4", 256)
    with pytest.raises(RuntimeError, match="only Q4_K, Q6_K and MXFP4"):
        native.pack(q40, FORMATS["q4_0"].code, 256, torch.empty(16, 148, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="out must be"):
        native.pack(q4k[:8], FORMATS["q4_k"].code, 256, torch.empty(8, 144, dtype=torch.uint8))
    tiles = pack(native, q4k[:8], "q4_k", 256)
    with pytest.raises(RuntimeError, match="file layout"):
        native.qmatmul_tiled(x, tiles, PACKED_CODES["q4_k"], 256)
    with pytest.raises(RuntimeError, match="row bytes"):  # the file layout under a packed code
        native.qmatmul_small(x, q4k[:8], PACKED_CODES["q4_k"], 256)


@pytest.mark.parametrize("fmt", list(X8_CODES))
def test_int8_activation_rows_do_not_depend_on_the_rows_beside_them(fmt: str) -> None:
    """Each row of x and each weight row get the same bits in any position: 16-row, 8-row
    and single-row weight tasks, x rows in one pass up to 16, then in passes of 32."""
    native = ops()
    assert native is not None
    k, code = 768, X8_CODES[fmt]
    blocks, _ = _weights(16 * 3 + 8 + 3, k, fmt, seed=8)
    x = torch.randn(69, k, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([native.qmatmul_small(x[i : i + 1], blocks, code, k) for i in range(69)])
    for m in (2, 16, 17, 40, 69):
        assert torch.equal(native.qmatmul_small(x[:m], blocks, code, k), alone[:m]), m
    for n in (0, 5, 16, 51):  # weight rows alone: the single-row loop
        one = native.qmatmul_small(x, blocks[n : n + 1], code, k)
        assert torch.equal(one[:, 0], alone[:, n]), n


@pytest.mark.parametrize("fmt", list(X8_CODES))
def test_int8_activation_error_is_bounded_and_per_row(fmt: str) -> None:
    """Rounding x to int8 moves each value by at most half a step (amax / 254 of its
    256-block); a non-finite value gives NaN in its row only, and an all-zero row gives 0."""
    native = ops()
    assert native is not None
    blocks, w = _weights(64, 512, fmt, seed=9)
    x = torch.randn(6, 512, generator=torch.Generator().manual_seed(9))
    step = x.view(6, 2, 256).abs().amax(-1, keepdim=True).expand(6, 2, 256).reshape(6, 512) / 254
    bound = step.double() @ w.double().abs().T + REL_TOL * (x.double().abs() @ w.double().abs().T)
    got = native.qmatmul_small(x, blocks, X8_CODES[fmt], 512)
    err = (got.double() - x.double() @ w.double().T).abs()
    assert bool((err <= bound).all()), (err / bound).max()
    x[2, 100], x[4] = float("nan"), 0.0
    got = native.qmatmul_small(x, blocks, X8_CODES[fmt], 512)
    assert bool(got[2].isnan().all()) and bool(got[[0, 1, 3, 5]].isfinite().all())
    assert bool((got[4] == 0).all())


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_bf16_tiles_are_the_bf16_rounded_weights(fmt: str) -> None:
    """bf16 x: qmatmul_tiled multiplies by the weights rounded to bf16 (as torch rounds them)
    in the bf16 GEMM, output bf16; QuantLinear takes that path for a bf16 model from
    BF16_TILED_M rows where bf16 matmuls are fast, else the float32 path."""
    native = ops()
    assert native is not None
    k = widths(fmt)[1]
    blocks, w = _weights(75, k, fmt, seed=5)
    x = torch.randn(BF16_TILED_M, k, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = native.qmatmul_tiled(x, blocks, FORMATS[fmt].code, k)
    assert got.dtype == torch.bfloat16
    wb = w.bfloat16().double()
    err = (got.double() - x.double() @ wb.T).abs() / (x.double().abs() @ wb.abs().T)
    assert err.max().item() <= 2**-8  # the output's bf16 rounding and float32 sums only
    layer = QuantLinear([QuantWeight(blocks, fmt, k)], None)
    expected = got if fast_cpu_bf16() else layer(x.float()).bfloat16()
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("kernel", ["qmatmul_small", "qmatmul_gemm"])
def test_int16_activation_error_is_bounded_and_per_row(kernel: str) -> None:
    """Rounding x to int16 moves each product by at most half a step (amax / 65534) of its
    block: the output error is bounded by |w| @ that step (plus float32 summation error), and
    a non-finite value in one row of x gives NaN in that row only."""
    native = ops()
    assert native is not None
    run = getattr(native, kernel)
    blocks, w = _weights(64, 576, "q4_1", seed=9)
    x = torch.randn(6, 576, generator=torch.Generator().manual_seed(9))
    step = x.view(6, -1, 32).abs().amax(-1, keepdim=True).expand(6, 18, 32).reshape(6, 576) / 65534
    bound = step.double() @ w.double().abs().T + REL_TOL * (x.double().abs() @ w.double().abs().T)
    got = run(x, blocks, FORMATS["q4_1"].code, 576)
    err = (got.double() - x.double() @ w.double().T).abs()
    assert bool((err <= bound).all()), (err / bound).max()
    x[2, 100] = float("inf")
    got = run(x, blocks, FORMATS["q4_1"].code, 576)
    assert bool(got[2].isnan().all()) and bool(got[[0, 1, 3, 4, 5]].isfinite().all())


def test_quant_linear_bias_dtype_and_leading_dims() -> None:
    blocks, w = _weights(40, 64, "q4_1", seed=3)
    gen = torch.Generator().manual_seed(3)
    bias = torch.randn(40, generator=gen)
    layer = QuantLinear([QuantWeight(blocks, "q4_1", 64)], bias)
    small_m = FORMATS["q4_1"].small_m
    native = ops()
    assert native is not None
    for rows in (1, small_m + 5):  # both kernels: int16 x, or float32 tiles without AVX2
        x = torch.randn(2, rows, 64, generator=gen)
        y = layer(x)
        assert y.shape == (2, rows, 40) and y.dtype == torch.float32
        exact_x = 2 * rows > small_m and not native.int_gemm
        xs = x if exact_x else q16_rows(x.view(-1, 64)).view_as(x)
        torch.testing.assert_close(y, xs @ w.T + bias, rtol=1e-5, atol=1e-5)
    xb = torch.randn(3, 64, generator=gen).bfloat16()
    yb = layer(xb)
    assert yb.dtype == torch.bfloat16
    want = (q16_rows(xb.float()) @ w.T + bias).bfloat16().float()
    # Both sides round a float32 result to bf16; the kernel sums in another order, so a
    # result near a rounding midpoint may land one bf16 step (2^-7 relative) away.
    torch.testing.assert_close(yb.float(), want, rtol=2**-7, atol=1e-5)


def test_rows_are_dequantized_rows_and_bad_ids_raise() -> None:
    blocks, w = _weights(50, 64, "q8_0", seed=4)
    layer = QuantLinear([QuantWeight(blocks, "q8_0", 64)], None)
    ids = torch.tensor([0, 49, 7, 7])
    torch.testing.assert_close(layer.rows(ids), w[ids], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="out of range"):
        layer.rows(torch.tensor([50]))


def test_shape_mismatch_is_refused() -> None:
    native = ops()
    assert native is not None
    blocks, _ = _weights(8, 64, "q4_0", seed=5)
    with pytest.raises(RuntimeError, match="multiple of 32|do not match"):
        native.qmatmul_small(torch.randn(1, 96), blocks, FORMATS["q4_0"].code, 96)
    with pytest.raises(AssertionError):
        QuantWeight(blocks, "q4_1", 64)  # q4_0 bytes declared as q4_1


@pytest.mark.kernels
def test_portable_build_matches_reference() -> None:
    """The build without AVX2 (RADIXSERVE_CPU_ISA=scalar), in a fresh process; a mixture's
    selected experts in one native call, as each expert's QuantLinears."""
    code = """
import torch
from radixserve.isa import cpu_isa
from radixserve.models.quant import B8_CODES, FORMATS, X8_CODES, ops
from test_quant import _close, _weights, q16_rows, q8_block_rows, q8_rows
assert cpu_isa() == "scalar", cpu_isa()
m = ops()
assert m is not None and m.__name__ == "radixserve_quant_scalar", m
assert not m.int_gemm  # QuantLinear uses the tiles there; qmatmul_gemm still computes
assert not m.packs  # the int8-x kernels read the file layout there
for fmt, f in FORMATS.items():
    k = 2 * f.block
    b, w = _weights(33, k, fmt, seed=0)
    assert torch.equal(m.dequant(b, f.code, k, torch.arange(33)), w)
    for rows in (1, 5, 20):
        x = torch.randn(rows, k)
        _close(m.qmatmul_small(x, b, f.code, k), q16_rows(x, fmt), w)
        _close(m.qmatmul_gemm(x, b, f.code, k), q16_rows(x, fmt), w)
        _close(m.qmatmul_tiled(x, b, f.code, k), x, w)
        if fmt in X8_CODES:
            _close(m.qmatmul_small(x, b, X8_CODES[fmt], k), q8_rows(x), w)
        if fmt in B8_CODES:
            _close(m.qmatmul_small(x, b, B8_CODES[fmt], k), q8_block_rows(x), w)
    got = m.qmatmul_tiled(x.bfloat16(), b, f.code, k)
    want = x.bfloat16().double() @ w.bfloat16().double().T
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 2**-7 * want.abs().max()
from radixserve.models.moe import QuantExperts, grouped_experts
from test_moe import _per_expert, _stacks
spec = [("gate", "q4_k", 256, 256), ("up", "q4_k", 256, 256), ("down", "q6_k", 256, 256)]
stacks = _stacks(spec, 3)  # a step's experts in one loop, each as its own QuantLinears
experts = QuantExperts(stacks["gate"], stacks["up"], stacks["down"], "int8")
x, ids = torch.randn(5, 256), torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
weights = torch.rand(5, 2)
want = grouped_experts(x, ids, weights, _per_expert(stacks), 256)
assert torch.equal(experts.mix(x, ids, weights), want)
print("ok")
"""
    env = {"RADIXSERVE_CPU_ISA": "scalar", "PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
           "PYTHONPATH": str(Path(__file__).parent)}  # fmt: skip
    if "TORCH_EXTENSIONS_DIR" in os.environ:  # the build cache the caller chose
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_unpermute_rows_inverts_llama_cpp_order() -> None:
    heads, per_head = 3, 8
    hf = torch.arange(heads * per_head * 2).view(heads * per_head, 2)
    # llama.cpp's converter: reshape(heads, 2, D/2, ...).swapaxes(1, 2)
    gguf = hf.reshape(heads, 2, per_head // 2, 2).transpose(1, 2).reshape(hf.shape)
    assert torch.equal(unpermute_rows(gguf, heads), hf)


# ---- the embedded SmolLM2 GGUF ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return resolve_model_path(None)


@pytest.mark.slow  # transformers dequantizes the whole 135M-parameter GGUF in Python (~18 s)
def test_gguf_weights_equal_transformers_reading_of_the_file(smollm2_path: Path) -> None:
    """Read natively (names mapped, q/k rows un-permuted, blocks in place in the file's
    memory map), every tensor dequantizes to exactly what transformers' own GGUF loader
    makes of the file, and so does the dequantized reading (--quantization none)."""
    from transformers import AutoModelForCausalLM

    gguf = gguf_source(smollm2_path)
    assert gguf is not None and gguf.suffix == ".gguf"
    config = load_config(smollm2_path)
    ours, dequantized = read_gguf_weights(gguf, config, torch.float32)
    plain, _ = read_gguf_weights(gguf, config, torch.float32, quantized=False)
    assert dequantized == {}  # every quantized tensor of the file has native kernels
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert set(ours) == set(hf) == set(plain)
    formats = {w.fmt for w in ours.values() if isinstance(w, QuantWeight)}
    assert formats == {"q4_1", "q8_0"}
    for name, w in ours.items():
        got = dequantize(w.blocks, w.fmt, w.in_features) if isinstance(w, QuantWeight) else w
        assert torch.equal(got, hf[name].float()), name
        assert torch.equal(plain[name], hf[name].float()), name


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path: Path) -> tuple:
    quantized, _ = load_model(smollm2_path, torch.float32)  # auto: the GGUF's own blocks
    plain, _ = load_model(smollm2_path, torch.float32, quantization="none")
    return quantized, plain


def test_embedded_model_runs_quantized_by_default(smollm2_pair: tuple) -> None:
    quantized, plain = smollm2_pair
    kinds = {type(m).__name__ for m in quantized.modules()}
    assert "QuantLinear" in kinds and "Linear" not in kinds
    assert isinstance(quantized.model.embed_tokens, QuantLinear)  # tied Q8_0 table
    assert not any(isinstance(m, QuantLinear) for m in plain.modules())


def test_kv_pool_is_sized_from_memory_left_after_the_weights(
    smollm2_pair: tuple, smollm2_path: Path
) -> None:
    """The quantized model's blocks are counted as in the file's mapping (the dequantized
    model's copies are not), and the pool's budget is what the OS has left minus them."""
    quantized, plain = smollm2_pair
    gguf = gguf_source(smollm2_path)
    assert gguf is not None
    mapped = file_mapped_bytes(quantized)
    assert 0.8 * gguf.stat().st_size < mapped <= gguf.stat().st_size
    assert file_mapped_bytes(plain) == 0
    config = EngineConfig(mem_fraction=0.5)
    tokens, rows, free = kv_capacity(config, 1000, 0, mapped)
    assert free <= psutil.virtual_memory().available - mapped + (64 << 20)  # (other processes)
    assert tokens == int(free * 0.5) // 1000 and rows is None
    # sliding-window layers (600 of each token's 1000 bytes): half the tokens the budget
    # holds at every layer's cost keep their rows, the full layers take the rest
    tokens, rows, free = kv_capacity(config, 400, 600, mapped)
    budget = int(free * 0.5)
    assert rows == budget // 2 // 1000 and tokens == (budget - rows * 600) // 400
    fixed = EngineConfig(max_total_tokens=4096)
    assert kv_capacity(fixed, 1000, 0, mapped)[:2] == (4096, None)
    assert kv_capacity(fixed, 400, 600, mapped)[:2] == (4096, None)  # a row per slot
    with pytest.raises(ValueError, match="max_swa_tokens"):
        kv_capacity(EngineConfig(max_swa_tokens=10**15), 400, 600, mapped)


def test_quantized_smollm2_logits_match_dequantized(smollm2_pair: tuple) -> None:
    """Same weights, activations rounded to int16 per 32-block by the quantized kernels: a
    40-token extend gives logits (|logit| up to ~33) within 2e-2 (9.0e-3 measured, 1.1e-3 mean;
    6.2e-3 for a single row, the decode kernel), and greedy decoding the same continuation."""
    quantized, plain = smollm2_pair
    ids = list(range(1000, 1040))
    got = extend(quantized, FlatBackend(), *_pool(quantized, ids), ids, 0)
    want = extend(plain, FlatBackend(), *_pool(plain, ids), ids, 0)
    diff = (got - want).abs()
    assert diff.max().item() < 2e-2 and diff.mean().item() < 3e-3, (diff.max(), diff.mean())
    prompt = [1, 504, 3458, 282, 4649, 314]  # "<|im_start|>The capital of France is"-like
    assert greedy_generate(quantized, prompt, 12, FlatBackend()) == greedy_generate(
        plain, prompt, 12, FlatBackend()
    )


def _pool(model: object, ids: list[int]) -> tuple:
    pool = make_pool(model, len(ids))  # type: ignore[arg-type]
    return pool, alloc_slots(pool, len(ids))


def test_int8_quantization_of_an_hf_checkpoint(tiny_model_dir: Path) -> None:
    q8, _ = load_model(tiny_model_dir, torch.float32, quantization="int8")
    ref, _ = load_model(tiny_model_dir, torch.float32, quantization="none")
    layers = [m for m in q8.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 2 * 4  # 2 layers x 4 linears
    assert {f.name for m in layers for f in m.formats} == {"q8_0"}
    ids = list(range(100, 120))
    got = extend(q8, FlatBackend(), *_pool(q8, ids), ids, 0)
    want = extend(ref, FlatBackend(), *_pool(ref, ids), ids, 0)
    rel = ((got - want).norm() / want.norm()).item()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    # int8 is close, not equal. (This random model's weights are huge, N(0, 0.5): measured
    # 6 % relative logit error, argmax agreement 19/20.)
    assert 0 < rel < 0.1 and agree >= 0.9, f"relative logit error {rel:.2e}, agreement {agree}"
    qkv = q8.model.layers[0].self_attn.qkv_proj
    w = torch.cat([ref.model.layers[0].self_attn.qkv_proj.weight])
    (part,) = qkv.parts
    assert torch.equal(part.blocks, quantize(w, "q8_0"))  # the documented scheme, nothing else


def test_bad_quantization_and_missing_gguf_are_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(tiny_model_dir, torch.float32, quantization="q3")
    with pytest.raises(ValueError, match="activations must be one of"):
        load_model(tiny_model_dir, torch.float32, activations="int4")
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_path("/nonexistent/model.gguf")


def test_without_native_kernels_auto_loads_dequantized() -> None:
    """native_ops=False (or no compiler): "auto" must not leave the model on the slow
    dequantize-every-call fallback."""
    before = native_ops_enabled()
    try:
        engine = Engine(dtype="float32", native_ops=False, max_total_tokens=64)
        assert ops() is None and kernels.resolve_impl(torch.empty(1, 1, 8)) == "cpu"
    finally:
        use_native_ops(before)  # the worker set the process-wide switch from the config
    model = engine.scheduler.worker.model
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_kv_cache_dtype_auto_is_fp16_under_quantized_weights(tiny_model_dir: Path) -> None:
    """auto: fp16 KV rows for the GGUF-quantized embedded model on a CPU computing in float32
    (the native kernels widen them on load; a bf16 CPU keeps its 2-byte compute dtype), the
    compute dtype for a float checkpoint; an explicit dtype wins; the narrow rows keep the
    greedy continuation of the float32 pool up to a near-tie: the two pools hold the same
    values, but on an AVX512-BF16 CPU only the bf16 pool takes the vdpbf16ps attention path
    (other summation order, bf16 softmax weights), which may flip a bf16 model's argmax where
    its top two tokens are within a bf16 rounding."""
    quantized = Engine(max_total_tokens=1024)
    exact_kv = Engine(max_total_tokens=1024, kv_cache_dtype="float32")
    plain = Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=256)
    compute = resolve_dtype("auto", "cpu")[0]
    try:
        want = torch.float16 if compute == torch.float32 else compute
        assert quantized.worker.pool.k[0].dtype == want
        assert exact_kv.worker.pool.k[0].dtype == torch.float32
        assert plain.worker.pool.k[0].dtype == torch.float32
        prompt = quantized.apply_chat_template([{"role": "user", "content": "Name three colours."}])
        params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
        a, b = (
            e.generate(prompt, params, return_logprob=True, top_logprobs_num=2)
            for e in (quantized, exact_kv)
        )
        ids_a, ids_b = a["output_ids"], b["output_ids"]
        assert len(ids_a) == len(ids_b) == 24
        same = next((i for i, (x, y) in enumerate(zip(ids_a, ids_b)) if x != y), 24)
        lp_a, lp_b = (r["meta_info"]["output_token_logprobs"][:same] for r in (a, b))
        assert all(abs(x[0] - y[0]) < 0.15 for x, y in zip(lp_a, lp_b)), (lp_a, lp_b)
        if compute == torch.float32 or not kernels.native.ops().bf16_dot:
            assert same == 24, (ids_a, ids_b)  # same kernels, same values: identical
        elif same < 24:  # a flip only where the float32 pool's top two nearly tie
            (top1, _, _), (top2, _, _) = b["meta_info"]["output_top_logprobs"][same]
            assert top1 - top2 < 0.25, (same, top1, top2)
    finally:
        for e in (quantized, exact_kv, plain):
            e.shutdown()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3", "smollm3"])
def test_native_layers_compute_the_module_path(
    arch: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A quantized float32 model runs each decoder layer as two native calls around
    attention (quant_cpu.cpp pre/post_attention): the module path's math and roundings, so
    the logits of a 300-token extend (the MLP in two row blocks) and of a following decode
    step (the one-row kernel) are identical, for Llama, Qwen2's qkv bias, and every other
    family's layer: q/k norms, Gemma's (1 + w) sandwich norms, GeGLU and sliding layers'
    own RoPE, partial rotary, layers without RoPE."""
    if arch == "llama":
        folder = tiny_model_dir
    elif arch == "qwen2":
        folder = tiny_qwen2(tmp_path / "qwen2", tiny_model_dir)
    else:
        folder = build_tiny_model(tmp_path / arch, family=arch)
    model, _ = load_model(folder, torch.float32, quantization="int8")
    if arch == "qwen2":
        natives = [layer.native for layer in model.model.layers]
        assert all(n is not None and n.qkv[3] is not None for n in natives)  # the bias goes in
    check_native_layers_are_the_module_path(model, list(range(100, 400)))


def check_native_layers_are_the_module_path(model: LlamaForCausalLM, ids: list[int]) -> None:
    """Every layer of `model` runs native, and the logits of an extend of `ids` and of a
    following decode step (of ids[0]) equal the module path's, bit for bit."""
    layers = list(model.model.layers)
    natives = [layer.native for layer in layers]
    assert all(n is not None for n in natives), "the model should run native layers"

    def run() -> torch.Tensor:
        pool, slots = _pool(model, [*ids, ids[0]])
        prefill = extend(model, FlatBackend(), pool, slots, ids, 0)
        decode = extend(model, FlatBackend(), pool, slots, ids[:1], len(ids))
        return torch.cat([prefill, decode])

    got = run()
    for layer in layers:
        layer.native = None
    want = run()
    for layer, n in zip(layers, natives):
        layer.native = n
    assert torch.equal(got, want), (got - want).abs().max()


def test_native_layers_stay_off_where_they_do_not_apply(tiny_model_dir: Path) -> None:
    """Plain (not quantized) and bf16 models keep the module path."""
    plain, _ = load_model(tiny_model_dir, torch.float32, quantization="none")
    bf16, _ = load_model(tiny_model_dir, torch.bfloat16, quantization="int8")
    for model in (plain, bf16):
        assert all(layer.native is None for layer in model.model.layers)


# ---- a GGUF laid out as llama.cpp's Q4_K_M --------------------------------------------


def write_q4_k_m_layout(path: Path, narrow: str = "q5_0") -> Path:
    """A tiny Llama GGUF with Q4_K_M's mix of types: q/k/o/gate/up Q4_K, v and down Q6_K, a
    tied Q6_K embedding, `narrow` in one layer's gate (llama.cpp's fallback for narrow rows
    is Q5_0), F32 norms; random blocks, the embedded tokenizer."""
    reader = gguf.GGUFReader(embedded_gguf())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    hidden, layers, heads, kv_heads, ffn = 256, 2, 4, 2, 512
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(1024)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    copy_tokenizer(reader, w)
    seed = iter(range(100))

    def add(name: str, rows: int, cols: int, fmt: str) -> None:
        blocks = random_blocks(rows, cols, fmt, next(seed))
        w.add_tensor(name, blocks, raw_dtype=GGML[fmt])

    add("token_embd.weight", vocab, hidden, "q6_k")
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    kv = kv_heads * hidden // heads
    for i in range(layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(b + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        add(b + "attn_q.weight", hidden, hidden, "q4_k")
        add(b + "attn_k.weight", kv, hidden, "q4_k")
        add(b + "attn_v.weight", kv, hidden, "q6_k")
        add(b + "attn_output.weight", hidden, hidden, "q4_k")
        add(b + "ffn_gate.weight", ffn, hidden, narrow if i == 1 else "q4_k")
        add(b + "ffn_up.weight", ffn, hidden, "q4_k")
        add(b + "ffn_down.weight", hidden, ffn, "q6_k")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.slow  # three GGUF files written and loaded: ~18 s
def test_files_of_int8_x_only_compute_in_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where every matrix rounds x to int8 (Q4_K / Q6_K, int8 activations), dtype auto is
    float32 even on a CPU with fast bf16: the layers run native, over an fp16 KV pool. A
    Q5_0 matrix (its x is int16), int16 activations, dequantized weights, TP or a GPU keep
    the usual choice."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(isa, "fast_cpu_bf16", lambda: True)
    all_k = resolve_model_path(str(write_q4_k_m_layout(tmp_path / "k.gguf", narrow="q4_k")))
    mixed = write_q4_k_m_layout(tmp_path / "mixed.gguf")
    assert matrix_formats(tmp_path / "k.gguf") == {"q4_k", "q6_k"}
    assert matrix_formats(mixed) == {"q4_k", "q5_0", "q6_k"}  # Q5_0's x is int16
    assert int8_x_only(all_k, "auto", "int8", 1, "cpu")
    assert not int8_x_only(all_k, "auto", "int16", 1, "cpu")
    assert not int8_x_only(all_k, "none", "int8", 1, "cpu")
    assert not int8_x_only(all_k, "auto", "int8", 2, "cpu")
    assert not int8_x_only(all_k, "auto", "int8", 1, "cuda:0")
    assert resolve_dtype("auto", "cpu", int8_x=True)[0] == torch.float32
    assert resolve_dtype("auto", "cpu")[0] == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu", int8_x=True)[0] == torch.bfloat16
    engine = Engine(str(tmp_path / "k.gguf"), max_total_tokens=256)
    try:
        worker = engine.worker
        assert worker.dtype == torch.float32
        assert all(layer.native is not None for layer in worker.model.model.layers)
        assert worker.pool.k[0].dtype == torch.float16
        out = engine.generate(input_ids=list(range(300, 320)),
                              sampling_params={"temperature": 0, "max_new_tokens": 4})  # fmt: skip
        assert len(out["output_ids"]) == 4
    finally:
        engine.shutdown()


def mapped_path(ptr: int) -> str | None:
    """The file this process has mapped at address `ptr` (/proc/self/maps), or None."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= ptr < end:
            return rest[4] if len(rest) == 5 else None
    return None


def resident_bytes(t: torch.Tensor) -> int:
    """Bytes of the pages spanned by `t` that are resident in this process (pagemap)."""
    page = mmap.PAGESIZE
    first = t.data_ptr() // page
    last = (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page


@pytest.mark.slow  # maps and reads a 64 MB file: ~5 s
def test_release_pages_drops_only_views_of_the_file(tmp_path: Path) -> None:
    """A view of the map loses its resident pages and reads back the same bytes; a copy
    outside the map is left alone (DONTNEED would zero anonymous memory)."""
    file = write_q4_k_m_layout(tmp_path / "tiny-q4_k_m.gguf")
    (down,) = [t for t in gguf_tensors(file).tensors if t.name == "blk.0.ffn_down.weight"]
    view = mapped(down.data)
    before = view.clone()
    assert resident_bytes(view) > 2 * mmap.PAGESIZE
    assert release_pages(file, view)
    assert resident_bytes(view) <= 2 * mmap.PAGESIZE
    assert torch.equal(view, before)  # read back from the page cache
    assert not release_pages(file, before)
    assert resident_bytes(before) > 0 and torch.equal(view, before)


@pytest.mark.slow  # a 1B-layout file written and loaded: ~11 s
def test_q4_k_m_layout_loads_every_projection_native_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every tensor of the file stays quantized (fused q/k/v and gate/up keep their parts of
    different formats), in place in the file's memory map but for the un-permuted q/k
    copies; the logits match the file dequantized to float32 (--quantization none) within
    the rounding of activations: int16, or int8 for the Q4_K and Q6_K parts (the default)."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    file = write_q4_k_m_layout(tmp_path / "tiny-q4_k_m.gguf")
    folder = resolve_model_path(str(file))
    assert not list(folder.glob("*.safetensors"))  # the converted folder holds no weights
    quantized, _ = load_model(folder, torch.float32, activations="int16")
    plain, _ = load_model(folder, torch.float32, quantization="none")
    layer = quantized.model.layers[1]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert [f.name for f in qkv.formats] == ["q4_k", "q4_k", "q6_k"]
    assert [f.name for f in gate_up.formats] == ["q5_0", "q4_k"]
    assert isinstance(quantized.model.embed_tokens, QuantLinear)  # tied: the head too
    in_file = [
        mapped_path(part.blocks.data_ptr()) == str(file)
        for m in (qkv, layer.self_attn.o_proj, gate_up, layer.mlp.down_proj)
        for part in m.parts
    ]
    assert in_file == [False, False, True, True, True, True, True]  # q, k un-permuted copies
    ids = list(range(300, 340))
    got = extend(quantized, FlatBackend(), *_pool(quantized, ids), ids, 0)
    want = extend(plain, FlatBackend(), *_pool(plain, ids), ids, 0)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 5e-3, rel  # 2.1e-3: the K-quants' x in 12-14 bits per 256-block
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
    int8, _ = load_model(folder, torch.float32)
    codes = [FORMATS["q4_k"].code, FORMATS["q4_k"].code, FORMATS["q6_k"].code]
    assert qkv.native_arg()[1] == codes
    codes8 = [PACKED_CODES["q4_k"], PACKED_CODES["q4_k"], PACKED_CODES["q6_k"]]
    assert int8.model.layers[1].self_attn.qkv_proj.native_arg()[1] == codes8
    # the packed parts' file pages were dropped from this process's memory at load
    v = int8.model.layers[1].self_attn.qkv_proj.parts[2].blocks
    assert mapped_path(v.data_ptr()) == str(file)
    assert resident_bytes(v) <= 2 * mmap.PAGESIZE  # at most its two partial end pages
    q5_0 = int8.model.layers[1].mlp.gate_up_proj.parts[0].blocks  # the one part read in place
    assert file_mapped_bytes(int8) == q5_0.numel()
    got8 = extend(int8, FlatBackend(), *_pool(int8, ids), ids, 0)
    rel8 = ((got8 - want).norm() / want.norm()).item()
    # 0.14 on these random weights: each Q4_K / Q6_K product's x rounded to 8 bits (a random
    # x gives 0.7 % relative error per product), compounded over the layers
    assert 5 * rel < rel8 < 0.2, (rel, rel8)
