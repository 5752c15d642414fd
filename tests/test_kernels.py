"""Attention ops: every implementation against kernels/reference.py (the oracle).

Tolerances (max |diff|, out and lse alike):
- fp32: 1e-5 absolute. Both sides accumulate in fp32 in different orders; values are O(1)
  (out: averages of randn rows) or O(10) (lse), so rounding stays ~1e-6.
- bf16 / fp16 (same inputs on both sides): out |diff| <= LOW_ATOL + LOW_RTOL * |ref|. The fast
  paths round the softmax weights P to the input dtype before the P @ V product (rel 2^-9 in
  bf16, 2^-11 in fp16) and the output once more; the reference keeps P in fp32 and rounds
  only the output: together up to ~2 ulps of |out| <= ~4. lse stays fp32 from exact bf16
  products: LOW_LSE_ATOL. Observed on 200 random cases: out 0.0156 (= 2 bf16 ulps at 2..4),
  lse 5.4e-5.
- native (kernels/native.py) keeps P in fp32 and rounds only the output, like the reference:
  it passes the same bounds with room to spare (observed fp32 ~1e-6; bf16 out 1 ulp).
- Triton runs in the interpreter (TRITON_INTERPRET=1) on CPU, fp32 and fp16 only (its bf16
  is broken), small shapes to stay fast.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import run_under_triton_interpreter

from radixserve import kernels
from radixserve.kernels import cpu, native, reference

FP32_ATOL = 1e-5
LOW_ATOL, LOW_RTOL, LOW_LSE_ATOL = 1e-2, 2e-2, 2e-4
ROOT = Path(__file__).resolve().parent.parent


def assert_state_close(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """Compare (out, lse) pairs: shapes, dtypes, -inf positions exactly; values per tolerance."""
    (o, lse), (o_ref, lse_ref) = got, want
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape, (o.shape, o_ref.shape, lse.shape)
    assert o.dtype == o_ref.dtype and lse.dtype == torch.float32, (o.dtype, o_ref.dtype, lse.dtype)
    if o.dtype == torch.float32:
        torch.testing.assert_close(o, o_ref, atol=FP32_ATOL, rtol=0)
        torch.testing.assert_close(lse, lse_ref, atol=FP32_ATOL, rtol=0)
    else:
        torch.testing.assert_close(o.float(), o_ref.float(), atol=LOW_ATOL, rtol=LOW_RTOL)
        torch.testing.assert_close(lse, lse_ref, atol=LOW_LSE_ATOL, rtol=0)


def rand(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype)


def qkv(gen: torch.Generator, n: int, seq: int, hkv: int, group: int, d: int, dtype: torch.dtype):
    q = rand(gen, n, hkv * group, d, dtype=dtype)  # (n, Hq, D)
    return q, rand(gen, seq, hkv, d, dtype=dtype), rand(gen, seq, hkv, d, dtype=dtype)


# --------------------------------------------------------------------------- random shapes
def segment_cases(count: int, seed: int, max_n: int = 70, max_len: int = 300) -> list[tuple]:
    """(n, L, Hkv, group, D): the extremes first, then seeded random draws."""
    rng = random.Random(seed)
    cases = [
        (1, 1, 3, 3, 64),
        (max_n, max_len, 3, 3, 64),
        (max_n, 1, 1, 8, 32),
        (1, max_len, 2, 1, 32),
    ]
    for _ in range(count - len(cases)):
        cases.append(
            (rng.randint(1, max_n), rng.randint(1, max_len), rng.choice([1, 2, 3]),
             rng.choice([1, 3, 8]), rng.choice([32, 64]))
        )  # fmt: skip
    return cases


def private_cases(count: int, seed: int, max_q: int = 70, max_len: int = 300) -> list[tuple]:
    """(q_lens, kv_lens, Hkv, group, D) mixing decode (q_len 1), extends with and without a
    prefix (kv_len == q_len), zero-query requests and runs of equal-shaped requests."""
    rng = random.Random(seed)
    fixed = [
        ([1] * 5, [7, 1, 300, 40, 2], 3, 3, 64),  # decode, varied lengths (runs of one)
        ([1] * 6, [50] * 6, 3, 3, 64),  # decode, equal lengths: one batched call
        ([12, 12, 12], [12, 12, 12], 1, 8, 32),  # prefill from scratch: empty prefix
        ([9, 9, 1, 0, 30], [40, 40, 80, 17, 30], 2, 1, 64),  # mixed, one request without queries
        ([70], [300], 3, 3, 32),  # long extend after a long prefix
    ]
    cases = list(fixed)
    for _ in range(count - len(fixed)):
        b = rng.randint(1, 6)
        q_lens = [rng.choice([1, 1, rng.randint(1, max_q)]) for _ in range(b)]
        kv_lens = [min(max_len, ql + rng.choice([0, rng.randint(0, max_len)])) for ql in q_lens]
        kv_lens = [max(k, q) for k, q in zip(kv_lens, q_lens, strict=False)]
        cases.append(
            (q_lens, kv_lens, rng.choice([1, 3]), rng.choice([1, 3, 8]), rng.choice([32, 64]))
        )
    return cases


def merge_inputs(gen: torch.Generator, n_parts: int, t: int, hq: int, d: int, dtype: torch.dtype):
    """Parts with some -inf rows: part 0 is -inf on row 0, every part is -inf on (row 1, head 0)."""
    outs = rand(gen, n_parts, t, hq, d, dtype=dtype)
    lses = rand(gen, n_parts, t, hq) * 4
    lses[0, 0] = float("-inf")
    lses[:, min(1, t - 1), 0] = float("-inf")
    return outs, lses


# --------------------------------------------------------------------------- CPU fast paths
FAST_IMPLS = ["cpu", "native"]  # the torch path and the native kernels, same dense contract
FAST_DTYPES = [(torch.float32, "fp32"), (torch.bfloat16, "bf16"), (torch.float16, "fp16")]


def fast_module(impl: str) -> ModuleType:
    if impl == "native" and native.ops() is None:
        pytest.skip("native attention kernels cannot be built here")
    return {"cpu": cpu, "native": native}[impl]


def fast_dtype_cases() -> list:
    """(impl, dtype) pairs: fp16 only for native (the torch path is tested in fp32 / bf16)."""
    return [
        pytest.param(impl, dt, id=f"{impl}-{name}")
        for impl in FAST_IMPLS
        for dt, name in FAST_DTYPES
        if impl == "native" or dt != torch.float16
    ]


@pytest.mark.parametrize(("impl", "dtype"), fast_dtype_cases())
def test_fast_segment_matches_reference(impl: str, dtype: torch.dtype) -> None:
    ops = fast_module(impl)
    gen = torch.Generator().manual_seed(1)
    for n, seq, hkv, group, d in segment_cases(24, seed=1):
        q, k, v = qkv(gen, n, seq, hkv, group, d, dtype)
        scale = d**-0.5
        assert_state_close(
            ops.segment_attention(q, k, v, scale), reference.segment_attention(q, k, v, scale)
        )


@pytest.mark.parametrize(("impl", "dtype"), fast_dtype_cases())
def test_fast_private_matches_reference(impl: str, dtype: torch.dtype) -> None:
    ops = fast_module(impl)
    gen = torch.Generator().manual_seed(2)
    for q_lens, kv_lens, hkv, group, d in private_cases(24, seed=2):
        q, _, _ = qkv(gen, sum(q_lens), 0, hkv, group, d, dtype)
        _, k, v = qkv(gen, 0, sum(kv_lens), hkv, group, d, dtype)
        got = ops.private_attention(q, k, v, q_lens, kv_lens, 0.3)
        assert_state_close(got, reference.private_attention(q, k, v, q_lens, kv_lens, 0.3))


def padded_decode_case(
    gen: torch.Generator, kv_lens: list[int], length: int, hkv: int, group: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Hq, D) and k/v (B, length, Hkv, D) whose padding is large garbage (finite, as the
    contract asks): any weight on it would show."""
    q, _, _ = qkv(gen, len(kv_lens), 0, hkv, group, 64, dtype)
    _, k, v = qkv(gen, 0, len(kv_lens) * length, hkv, group, 64, dtype)
    k, v = k.view(len(kv_lens), length, hkv, 64), v.view(len(kv_lens), length, hkv, 64)
    for b, n in enumerate(kv_lens):
        k[b, n:], v[b, n:] = 1e4, -1e4
    return q, k, v


DECODE_CASES = [  # (kv_lens, padded length L, Hkv, group)
    ([20 + (7 * i) % 41 for i in range(20)], 60, 3, 3),  # mixed lengths, SmolLM2 heads
    ([33] * 5, 33, 3, 3),  # nothing padded: no mask at all
    ([1, 300, 7], 310, 1, 8),  # GQA 8, a one-key request, padding past the longest
    ([5, 2], 5, 2, 1),  # MHA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["reference", *FAST_IMPLS])
def test_decode_attention_matches_private(impl: str, dtype: torch.dtype) -> None:
    """decode_attention on a padded grid == private_attention on the same keys concatenated
    (the reference oracle), and gives the padding no weight."""
    gen = torch.Generator().manual_seed(3)
    mod = reference if impl == "reference" else fast_module(impl)
    for kv_lens, length, hkv, group in DECODE_CASES:
        q, k, v = padded_decode_case(gen, kv_lens, length, hkv, group, dtype)
        got = mod.decode_attention(q, k, v, kv_lens, 0.125)
        flat_k = torch.cat([k[b, :n] for b, n in enumerate(kv_lens)])
        flat_v = torch.cat([v[b, :n] for b, n in enumerate(kv_lens)])
        want = reference.private_attention(q, flat_k, flat_v, [1] * len(kv_lens), kv_lens, 0.125)
        assert_state_close(got, want)


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_fast_decode_rejects_bad_lengths(impl: str) -> None:
    ops = fast_module(impl)
    gen = torch.Generator().manual_seed(7)
    q, k, v = padded_decode_case(gen, [3, 4], 4, 3, 3, torch.float32)
    with pytest.raises(AssertionError, match="need 1 <= kv_len <= 4"):
        ops.decode_attention(q, k, v, [0, 4], 0.125)  # a row with no key
    with pytest.raises(AssertionError, match="need 1 <= kv_len <= 4"):
        ops.decode_attention(q, k, v, [3, 5], 0.125)
    with pytest.raises(AssertionError, match="2 queries"):
        ops.decode_attention(q, k, v, [3], 0.125)


@pytest.mark.parametrize(("impl", "dtype"), fast_dtype_cases())
@pytest.mark.parametrize("n_parts", [1, 2, 3, 5])
def test_fast_merge_matches_reference(n_parts: int, impl: str, dtype: torch.dtype) -> None:
    ops = fast_module(impl)
    gen = torch.Generator().manual_seed(4 + n_parts)
    outs, lses = merge_inputs(gen, n_parts, 11, 9, 64, dtype)
    out, lse = ops.merge_states(outs, lses)
    assert_state_close((out, lse), reference.merge_states(outs, lses))
    assert lse[1, 0] == float("-inf") and bool((out[1, 0] == 0).all()), "no-contribution row"
    assert torch.isfinite(lse[0]).all() == (n_parts > 1), "row 0 is -inf only when part 0 is alone"


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_fast_empty_inputs(impl: str) -> None:
    """L == 0 (the flash op would SIGFPE) and n == 0 are answered without calling it."""
    ops = fast_module(impl)
    gen = torch.Generator().manual_seed(5)
    q, k, v = qkv(gen, 4, 0, 3, 3, 64, torch.float32)
    out, lse = ops.segment_attention(q, k, v, 0.125)
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())
    assert_state_close((out, lse), reference.segment_attention(q, k, v, 0.125))
    q0, k1, v1 = qkv(gen, 0, 5, 3, 3, 64, torch.float32)
    assert ops.segment_attention(q0, k1, v1, 0.125)[0].shape == (0, 9, 64)
    out, lse = ops.private_attention(q0, k1, v1, [0], [5], 0.125)
    assert out.shape == (0, 9, 64) and lse.shape == (0, 9)


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_fast_rejects_bad_lengths(impl: str) -> None:
    ops = fast_module(impl)
    gen = torch.Generator().manual_seed(6)
    q, k, v = qkv(gen, 3, 2, 1, 1, 32, torch.float32)
    with pytest.raises(AssertionError, match="q_len <= kv_len"):
        ops.private_attention(q, k, v, [3], [2], 0.1)
    with pytest.raises(AssertionError, match="sum\\(kv_lens\\)"):
        ops.private_attention(q, k, v, [3], [4], 0.1)


# --------------------------------------------------------------------------- decomposition
@pytest.mark.parametrize("impl", ["reference", *FAST_IMPLS])
def test_decomposition_segment(impl: str) -> None:
    """Attention over concat(K_1..K_m) == merge of the per-part attentions (fp32 1e-5)."""
    ops = reference if impl == "reference" else fast_module(impl)
    gen = torch.Generator().manual_seed(7)
    for sizes in ([300], [1, 299], [128, 5, 77, 1], [40] * 6):
        q, k, v = qkv(gen, 23, sum(sizes), 3, 3, 64, torch.float32)
        whole = ops.segment_attention(q, k, v, 0.125)
        parts = [
            ops.segment_attention(q, kj, vj, 0.125)
            for kj, vj in zip(k.split(sizes), v.split(sizes), strict=False)
        ]
        merged = ops.merge_states(
            torch.stack([o for o, _ in parts]), torch.stack([s for _, s in parts])
        )
        assert_state_close(merged, whole)


@pytest.mark.parametrize("impl", FAST_IMPLS)
def test_decomposition_tree_decode(impl: str) -> None:
    """Tree decode (shared segment + private causal part, merged) == flat over the whole path."""
    ops = fast_module(impl)
    gen = torch.Generator().manual_seed(8)
    b, prefix, own = 6, 97, [1, 4, 30, 2, 2, 9]  # own: private keys incl. the current token
    q, shared_k, shared_v = qkv(gen, b, prefix, 3, 3, 64, torch.float32)
    _, own_k, own_v = qkv(gen, 0, sum(own), 3, 3, 64, torch.float32)
    seg = ops.segment_attention(q, shared_k, shared_v, 0.125)
    priv = ops.private_attention(q, own_k, own_v, [1] * b, own, 0.125)
    tree = ops.merge_states(torch.stack([seg[0], priv[0]]), torch.stack([seg[1], priv[1]]))
    paths_k = torch.cat([torch.cat([shared_k, kj]) for kj in own_k.split(own)])
    paths_v = torch.cat([torch.cat([shared_v, vj]) for vj in own_v.split(own)])
    flat = reference.private_attention(
        q, paths_k, paths_v, [1] * b, [prefix + n for n in own], 0.125
    )
    assert_state_close(tree, flat)


# --------------------------------------------------------------------------- dispatch
@pytest.fixture
def restore_impl() -> Iterator[None]:
    before = kernels.get_impl()
    yield
    kernels.set_impl(before)


def test_dispatch_selects_and_logs_once(
    restore_impl: None, caplog: pytest.LogCaptureFixture
) -> None:
    gen = torch.Generator().manual_seed(9)
    q, k, v = qkv(gen, 5, 33, 3, 3, 64, torch.float32)
    with pytest.raises(ValueError, match="unknown kernel impl"):
        kernels.set_impl("fast")
    kernels.set_impl("auto")
    want = "native" if native.auto_ok() else "cpu"  # AVX2 + FMA + F16C and a compiler
    assert kernels.get_impl() == "auto" and kernels.resolve_impl(q) == want
    kernels._logged.clear()
    with caplog.at_level(logging.INFO, logger="radixserve.kernels"):
        got = kernels.segment_attention(q, k, v, 0.125)
        kernels.private_attention(q, k[:30], v[:30], [1] * 5, [6] * 5, 0.125)
    assert [r.getMessage() for r in caplog.records].count(
        f"attention kernels: {want} (requested 'auto', tensors on cpu)"
    ) == 1, caplog.text
    chosen = native if want == "native" else cpu
    assert torch.equal(got[0], chosen.segment_attention(q, k, v, 0.125)[0]), f"auto -> {want}"
    kernels.set_impl("reference")
    assert kernels.resolve_impl(q) == "reference"
    assert_state_close(kernels.segment_attention(q, k, v, 0.125), got)


# --------------------------------------------------------------------------- triton (interpreter)
# The checks below run in a child process under TRITON_INTERPRET=1 (this file run as a
# script, helpers.run_under_triton_interpreter); the parent asserts that the child passed
# every check. Small shapes: the interpreter runs each program in Python.
TRITON_DTYPES = (torch.float32, torch.float16)  # the interpreter's bf16 is broken


def check_triton_segment(tops: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    for n, seq, hkv, group, d in segment_cases(6, seed=10, max_n=20, max_len=70):
        q, k, v = qkv(gen, n, seq, hkv, group, d, dtype)
        assert_state_close(
            tops.segment_attention(q, k, v, 0.2), reference.segment_attention(q, k, v, 0.2)
        )


def check_triton_private(tops: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    cases = (
        [
            ([1, 1, 1], [5, 40, 1], 3, 3, 64),  # decode
            ([7, 7], [7, 7], 1, 8, 32),  # empty prefix, GQA 8
            ([9, 1, 0, 20], [30, 33, 4, 47], 2, 1, 64),  # mixed, a zero-query request
        ]
        + private_cases(9, seed=11, max_q=20, max_len=60)[5:]
    )
    for q_lens, kv_lens, hkv, group, d in cases:
        q, _, _ = qkv(gen, sum(q_lens), 0, hkv, group, d, dtype)
        _, k, v = qkv(gen, 0, sum(kv_lens), hkv, group, d, dtype)
        got = tops.private_attention(q, k, v, q_lens, kv_lens, 0.3)
        assert_state_close(got, reference.private_attention(q, k, v, q_lens, kv_lens, 0.3))


def check_triton_decode(tops: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(14)
    for kv_lens, length, hkv, group in DECODE_CASES[1:]:
        q, k, v = padded_decode_case(gen, kv_lens, length, hkv, group, dtype)
        assert_state_close(
            tops.decode_attention(q, k, v, kv_lens, 0.2),
            reference.decode_attention(q, k, v, kv_lens, 0.2),
        )


def check_triton_merge(tops: ModuleType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    for n_parts in (1, 3):
        outs, lses = merge_inputs(gen, n_parts, 7, 9, 64, dtype)
        out, lse = tops.merge_states(outs, lses)
        assert_state_close((out, lse), reference.merge_states(outs, lses))
        assert lse[1, 0] == float("-inf") and bool((out[1, 0] == 0).all())


def check_triton_through_dispatch(tops: ModuleType, dtype: torch.dtype) -> None:
    """set_impl("triton") routes the public ops to the Triton wrappers; tree == flat."""
    gen = torch.Generator().manual_seed(13)
    kernels.set_impl("triton")
    q, k, v = qkv(gen, 4, 19, 3, 3, 64, dtype)
    assert kernels.resolve_impl(q) == "triton"
    seg = kernels.segment_attention(q, k, v, 0.125)
    assert_state_close(seg, tops.segment_attention(q, k, v, 0.125))
    priv = kernels.private_attention(q, k[:12], v[:12], [1] * 4, [3] * 4, 0.125)
    got = kernels.merge_states(torch.stack([seg[0], priv[0]]), torch.stack([seg[1], priv[1]]))
    flat_k = torch.cat([torch.cat([k, kj]) for kj in k[:12].split(3)])
    flat_v = torch.cat([torch.cat([v, vj]) for vj in v[:12].split(3)])
    assert_state_close(
        got, reference.private_attention(q, flat_k, flat_v, [1] * 4, [22] * 4, 0.125)
    )


def check_triton_random_trees(tops: ModuleType, dtype: torch.dtype) -> None:
    """The GPU script's own tree check (benchmarks/gpu_check.py), small: pool slots read in
    place, segments resuming the previous state, split-K off / forced / automatic."""
    from gpu_check import check_random_trees

    worst = check_random_trees("cpu", dtype, cases=2, max_len=24, max_requests=4, seed=5)
    assert worst["cases"] == 2


TRITON_CHECKS = (
    check_triton_random_trees,
    check_triton_segment,
    check_triton_private,
    check_triton_decode,
    check_triton_merge,
    check_triton_through_dispatch,
)


def run_triton_checks() -> None:
    """Child side: every check for every dtype; prints one "ok" line per passed check."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    from radixserve.kernels import triton_ops

    for dtype in TRITON_DTYPES:
        for check in TRITON_CHECKS:
            check(triton_ops, dtype)
            print(f"ok {check.__name__} {dtype}", flush=True)


@pytest.mark.slow  # the Triton kernels under the interpreter, in a subprocess (~8 s)
def test_triton_interpreter() -> None:
    out = run_under_triton_interpreter(__file__, "--triton-checks", timeout=300)
    oks = [line for line in out.splitlines() if line.startswith("ok ")]
    assert len(oks) == len(TRITON_CHECKS) * len(TRITON_DTYPES), out


# --------------------------------------------------------------------------- benchmark smoke
BENCH_POSITIVE = (
    "tree_ms", "flat_ms", "speedup", "tree_bound_ms", "flat_bound_ms", "roofline_speedup",
    "speedup_of_roofline", "tree_frac_of_bound", "flat_frac_of_bound",
)  # fmt: skip


def test_bench_tree_attention_quick(tmp_path: Path) -> None:
    name = "bench_tree_attention_under_test"
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks/bench_tree_attention.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[name] = bench  # dataclasses look their module up while the file executes
    before = kernels.get_impl()
    try:
        spec.loader.exec_module(bench)
        bench.main(["--quick", "--json", str(tmp_path / "r.json")])
    finally:
        del sys.modules[name]
    assert kernels.get_impl() == before, "the benchmark restores the kernel choice"
    report = json.loads((tmp_path / "r.json").read_text())
    impls = ["native", "cpu"] if native.auto_ok() else ["cpu"]
    assert report["impls"] == impls and len(report["results"]) == 3 * len(impls)
    assert report["dtype"] in ("fp32", "bf16")  # the model's dtype on this CPU
    narrow_kv = report["dtype"] == "fp32" and native.auto_ok()  # the engine's kv dtype "auto"
    assert report["kv_dtype"] == ("fp16" if narrow_kv else report["dtype"])
    assert all(
        report["roofline"][k] > 0 for k in ("read_GBps", "copy_GBps", "matmul_GFLOPs_float32")
    )
    tol = FP32_ATOL if report["dtype"] == "fp32" else LOW_ATOL + LOW_RTOL * 4  # |out| <= ~4
    for r in report["results"]:
        for key in BENCH_POSITIVE:
            assert r[key] > 0, (key, r)
        assert r["flat_bytes"] > r["tree_bytes"] > 0 and r["flops"] > 0
        assert r["max_abs_diff_tree_vs_flat"] <= tol, r


# PaddedPlan vs GatherPlan are the torch path's ways to read private keys; the native
# kernels read them by slot (SlotPlan), so the sweep runs with the torch kernels selected.
PAD_SWEEP = (
    "import runpy, sys; from radixserve import kernels; kernels.set_impl('cpu'); "
    "path = sys.argv[1]; sys.argv = [path, '--pad-sweep', '--batch', '4', '--repeat', '1']; "
    "runpy.run_path(path, run_name='__main__')"
)


def test_bench_backend_pad_sweep_quick(tmp_path: Path) -> None:
    """The sweep behind PAD_MAX_WASTE runs and prints one timed row per length range."""
    script = str(ROOT / "benchmarks" / "bench_backend.py")
    proc = subprocess.run(
        [sys.executable, "-c", PAD_SWEEP, script], cwd=tmp_path, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.strip().startswith("4 ")]
    assert len(rows) == 6, proc.stdout
    for row in rows:
        padded_ms, gather_ms = (float(x) for x in row[1].split())
        assert padded_ms > 0 and gather_ms > 0, row


if __name__ == "__main__" and sys.argv[1:] == ["--triton-checks"]:
    run_triton_checks()
