"""Native CPU attention kernels (kernels/native.py, radixserve/csrc/attention_cpu.cpp)
against kernels/reference.py, reading K/V from a pool by slot.

Every case draws a pool bigger than the keys and a random permutation of its slots, so rows
are read out of order; the reference runs on the same rows gathered (pool[slots]).

Tolerances (max |diff| against the reference on the same inputs, out and lse alike):
- fp32 pool: FP32_ATOL = 1e-5 absolute. Both accumulate in fp32 in other orders, and the
  kernel's exp is a polynomial within ~2 ulp; observed on these cases: out 4.8e-6, lse 3.8e-6.
- bf16 / fp16 pool: both sides compute in fp32 from the same stored values and round the
  output once, so out differs by at most ~1 ulp of |out| <= ~4: LOW_ATOL + LOW_RTOL * |ref|
  (2^-7 + 2^-7 |ref|; observed worst 0.47 of that bound in bf16 (0.0078 = 1 ulp at 1..2),
  0.06 in fp16); lse stays fp32 from exactly converted values: LOW_LSE_ATOL = 2e-5
  (observed 5.7e-6). On a CPU with AVX512-BF16 the bf16 cases with >= 12 rows per KV head
  (70 x 65, 40 x 2500) take the vdpbf16ps path, which also rounds the softmax weights to
  bf16 before P.V (as torch's bf16 flash attention does): worst seen 0.33 of the bound.
Shapes cover GQA 9/3, 4/1 and 8/8; q_len 1 and > 1 (causal); 1-key, odd and long keys (more
than one 64-key block, and long enough to be split across threads and merged); empty
segments, requests without queries, batches without requests; head dims 8..128 and one
that is not a multiple of 8 (torch path).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radixserve import kernels
from radixserve.kernels import native, reference

ROOT = Path(__file__).resolve().parent.parent
FP32_ATOL = 1e-5
LOW_ATOL, LOW_RTOL, LOW_LSE_ATOL = 2**-7, 2**-7, 2e-5
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]
GQA = [(3, 3), (1, 4), (8, 1)]  # (Hkv, group): SmolLM2 9/3, 4/1, MHA 8/8


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if native.ops() is None:
        pytest.skip("native attention kernels cannot be built here (no compiler?)")


def close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (o, lse), (o_ref, lse_ref) = got, want
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype, (o.shape, o_ref.shape, o.dtype)
    assert lse.shape == lse_ref.shape and lse.dtype == torch.float32, (lse.shape, lse.dtype)
    if o.dtype == torch.float32:
        torch.testing.assert_close(o, o_ref, atol=FP32_ATOL, rtol=0)
    else:
        torch.testing.assert_close(o.float(), o_ref.float(), atol=LOW_ATOL, rtol=LOW_RTOL)
    atol = FP32_ATOL if o.dtype == torch.float32 else LOW_LSE_ATOL
    torch.testing.assert_close(lse, lse_ref, atol=atol, rtol=0)  # -inf positions must match


def runs(kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_starts, kv_lens) of requests whose keys lie one after another."""
    off = native._offsets(kv_lens)
    return off[:-1], off.diff()


class Pool:
    """One layer's K/V pool (num_slots, Hkv, D) with randn rows, and slots drawn from it."""

    def __init__(self, seed: int, rows: int, hkv: int, d: int, dtype: torch.dtype) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        size = 1 + rows + self.rng.randint(0, 50)
        self.k = torch.randn(size, hkv, d, generator=self.gen).to(dtype)
        self.v = torch.randn(size, hkv, d, generator=self.gen).to(dtype)
        self.free = list(range(1, size))
        self.rng.shuffle(self.free)  # a random permutation: rows are read out of order

    def take(self, n: int) -> torch.Tensor:
        out, self.free = self.free[:n], self.free[n:]
        return torch.tensor(out, dtype=torch.int64)

    def queries(self, n: int, hq: int) -> torch.Tensor:
        return torch.randn(n, hq, self.k.shape[2], generator=self.gen).to(self.k.dtype)


# --------------------------------------------------------------------------- segment
SEGMENT_CASES = [  # (n queries, L keys, D)
    (1, 1, 64),
    (5, 7, 64),
    (4, 64, 64),  # exactly one block
    (70, 65, 64),  # one block + 1 key; 210 rows: transposed-K path
    (3, 301, 32),  # odd, several blocks; few rows: dot-product path
    (1, 3000, 64),  # long: split across threads, merged
    (40, 2500, 128),
    (9, 130, 8),
    (17, 77, 24),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hkv", "group"), GQA, ids=["gqa9/3", "gqa4/1", "mha8/8"])
def test_pool_segment_matches_reference(hkv: int, group: int, dtype: torch.dtype) -> None:
    for i, (n, length, d) in enumerate(SEGMENT_CASES):
        pool = Pool(i, length, hkv, d, dtype)
        slots, q = pool.take(length), pool.queries(n, hkv * group)
        got = native.pool_segment_attention(q, pool.k, pool.v, slots, d**-0.5)
        close(got, reference.segment_attention(q, pool.k[slots], pool.v[slots], d**-0.5))


@pytest.mark.parametrize("store", [torch.float16, torch.bfloat16])
def test_narrow_pool_under_float32_queries(store: torch.dtype) -> None:
    """A pool stored in fp16 / bf16 (kv_cache_dtype) read by float32 queries: rows are widened
    exactly on load, so the result is the float32 attention over the rounded K/V."""
    for i, (q_lens, kv_lens) in enumerate([([1], [4000]), ([1] * 3, [64, 65, 129]), ([70], [300])]):
        pool = Pool(200 + i, sum(kv_lens), 3, 64, store)
        slots, q = pool.take(sum(kv_lens)), pool.queries(sum(q_lens), 9).float()
        k, v = pool.k[slots].float(), pool.v[slots].float()
        qo = native._offsets(q_lens)
        close(native.pool_private_attention(q, pool.k, pool.v, slots, qo, *runs(kv_lens), 0.3),
              reference.private_attention(q, k, v, q_lens, kv_lens, 0.3))  # fmt: skip
        close(native.pool_segment_attention(q, pool.k, pool.v, slots, 0.3),
              reference.segment_attention(q, k, v, 0.3))  # fmt: skip


# --------------------------------------------------------------------------- private
PRIVATE_CASES = [  # (q_lens, kv_lens, D)
    ([1], [1], 64),  # one key
    ([1] * 5, [7, 1, 300, 40, 2], 64),  # decode, odd lengths
    ([1] * 3, [64, 65, 129], 64),  # block edges
    ([1], [4000], 64),  # batch-1 long decode: split across threads
    ([12, 12], [12, 12], 32),  # prefill from scratch (kv_len == q_len)
    ([9, 9, 1, 0, 30], [40, 40, 80, 17, 30], 64),  # mixed, one request without queries
    ([70], [300], 64),  # extend after a prefix
    ([350], [2100], 64),  # > 1024 rows (GQA 9/3): several row blocks, and long keys
    ([5, 1], [1500, 3], 16),
    ([0, 0], [3, 0], 64),  # no queries at all
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hkv", "group"), GQA, ids=["gqa9/3", "gqa4/1", "mha8/8"])
def test_pool_private_matches_reference(hkv: int, group: int, dtype: torch.dtype) -> None:
    for i, (q_lens, kv_lens, d) in enumerate(PRIVATE_CASES):
        pool = Pool(100 + i, sum(kv_lens), hkv, d, dtype)
        slots, q = pool.take(sum(kv_lens)), pool.queries(sum(q_lens), hkv * group)
        got = native.pool_private_attention(
            q, pool.k, pool.v, slots, native._offsets(q_lens), *runs(kv_lens), 0.3
        )
        want = reference.private_attention(q, pool.k[slots], pool.v[slots], q_lens, kv_lens, 0.3)
        close(got, want)


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_keys_read_in_a_table(impl: str, restore_impl: None) -> None:
    """Requests whose keys are runs of the rows of a request-to-token table, out of order,
    with gaps and sharing a row's start, give what the same keys concatenated give."""
    kernels.set_impl(impl)
    pool = Pool(11, 600, 3, 64, torch.float32)
    table = pool.take(600).view(4, 150)
    rows, firsts, lens = [2, 0, 2, 3], [0, 10, 0, 149], [150, 7, 40, 1]
    starts = torch.tensor([r * 150 + a for r, a in zip(rows, firsts, strict=True)])
    q_lens = [1, 3, 40, 1]
    q, q_off = pool.queries(sum(q_lens), 9), native._offsets(q_lens)
    got = kernels.pool_private_attention(
        q, pool.k, pool.v, table.view(-1), q_off, starts, torch.tensor(lens), 0.2
    )
    keys = [table[r, a : a + n] for r, a, n in zip(rows, firsts, lens, strict=True)]
    flat = torch.cat(keys)
    want = kernels.pool_private_attention(q, pool.k, pool.v, flat, q_off, *runs(lens), 0.2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    close(got, reference.private_attention(q, pool.k[flat], pool.v[flat], q_lens, lens, 0.2))


CAP = 0.8  # below most scores here (randn rows, scale d ** -0.5): the cap changes them


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_capped_scores_match_reference(dtype: torch.dtype) -> None:
    """softcap c: every score s becomes c * tanh(s / c) (Gemma 2), on every path of the
    kernel (dot-product and transposed-K tiles, the bf16 vdpbf16ps path, threads split and
    merged), for segments and causal private parts, merged with a capped prior."""
    for i, (n, length, d) in enumerate(SEGMENT_CASES):
        pool = Pool(300 + i, length, 3, d, dtype)
        slots, q = pool.take(length), pool.queries(n, 9)
        k, v = pool.k[slots], pool.v[slots]
        got = native.pool_segment_attention(q, pool.k, pool.v, slots, d**-0.5, softcap=CAP)
        close(got, reference.segment_attention(q, k, v, d**-0.5, softcap=CAP))
        if length > 1:  # (one key: any score gets all the weight)
            plain = reference.segment_attention(q, k, v, d**-0.5)
            assert (got[1] - plain[1]).abs().max() > 0.1  # the cap is not a no-op here
    for i, (q_lens, kv_lens, d) in enumerate(PRIVATE_CASES):
        pool = Pool(400 + i, sum(kv_lens), 3, d, dtype)
        slots, q = pool.take(sum(kv_lens)), pool.queries(sum(q_lens), 9)
        qo = native._offsets(q_lens)
        prior = native.pool_segment_attention(q, pool.k, pool.v, slots[:5], 0.3, softcap=CAP)
        got = native.pool_private_attention(
            q, pool.k, pool.v, slots, qo, *runs(kv_lens), 0.3, prior=prior, softcap=CAP
        )
        k, v = pool.k[slots], pool.v[slots]
        own = reference.private_attention(q, k, v, q_lens, kv_lens, 0.3, softcap=CAP)
        want = reference.merge_states(
            torch.stack([prior[0], own[0]]), torch.stack([prior[1], own[1]])
        )
        close(got, want)


def test_soft_capped_calls_of_other_impls_run_on_the_reference(restore_impl: None) -> None:
    """PyTorch's flash kernel has no cap: under the "cpu" impl a capped call runs on the
    reference, an uncapped one stays on the flash kernel."""
    pool = Pool(8, 300, 3, 64, torch.float32)
    slots, q = pool.take(300), pool.queries(4, 9)
    kv = runs([100, 50, 1, 149])
    kernels.set_impl("cpu")
    assert not kernels.reads_pool_in_place(q)
    got = kernels.pool_decode_attention(q, pool.k, pool.v, slots, *kv, 0.125, softcap=CAP)
    kernels.set_impl("native")
    close(got, kernels.pool_decode_attention(q, pool.k, pool.v, slots, *kv, 0.125, softcap=CAP))
    uncapped = kernels.pool_decode_attention(q, pool.k, pool.v, slots, *kv, 0.125)
    assert (got[0] - uncapped[0]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", ["native", "reference"])
def test_prior_state_is_merged(impl: str, dtype: torch.dtype, restore_impl: None) -> None:
    """pool ops given prior = (out, lse) of the same rows over other keys return attention over
    both key sets: shared segment -> its requests' private parts (decode, extend, long keys
    split across threads: only the first chunk may start from the prior), and rows whose
    prior is empty (lse -inf)."""
    kernels.set_impl(impl)
    q_lens, own = [1, 5, 1, 1], [3, 40, 3000, 1]
    shared = 700
    pool = Pool(9, shared + sum(own), 3, 64, dtype)
    seg, mine = pool.take(shared), pool.take(sum(own))
    q = pool.queries(sum(q_lens), 9)
    prior = kernels.pool_segment_attention(q, pool.k, pool.v, seg, 0.2)  # (T, Hq, D), (T, Hq)
    prior[1][-1] = float("-inf")  # the last request: no shared part after all
    prior[0][-1] = 0.0
    q_off, kv_off = native._offsets(q_lens), native._offsets(own)
    got = kernels.pool_private_attention(q, pool.k, pool.v, mine, q_off, *runs(own), 0.2, prior)
    starts = kv_off.tolist()
    for r, (a, b) in enumerate(zip(starts, starts[1:], strict=False)):
        keys = mine[a:b] if r == len(own) - 1 else torch.cat([seg, mine[a:b]])
        rows = slice(int(q_off[r]), int(q_off[r + 1]))
        want = reference.private_attention(
            q[rows], pool.k[keys], pool.v[keys], [q_lens[r]], [keys.numel()], 0.2
        )
        close((got[0][rows], got[1][rows]), want)
    twice = kernels.pool_segment_attention(q, pool.k, pool.v, seg[:5], 0.2, prior=prior)
    both = torch.cat([seg, seg[:5]])
    want = reference.segment_attention(q[:-1], pool.k[both], pool.v[both], 0.2)
    close((twice[0][:-1], twice[1][:-1]), want)


def test_pool_ops_through_dispatch(restore_impl: None) -> None:
    """kernels.pool_* route to the native kernels; with another impl they gather first."""
    pool = Pool(7, 400, 3, 64, torch.float32)
    slots, q = pool.take(400), pool.queries(4, 9)
    kv = runs([100, 50, 1, 249])
    results = {}
    for impl in ("native", "reference"):
        kernels.set_impl(impl)
        assert kernels.reads_pool_in_place(q) == (impl == "native")
        results[impl] = (
            kernels.pool_decode_attention(q, pool.k, pool.v, slots, *kv, 0.125),
            kernels.pool_segment_attention(q, pool.k, pool.v, slots[:37], 0.125),
        )
    for got, want in zip(results["native"], results["reference"], strict=True):
        close(got, want)


@pytest.fixture
def restore_impl() -> Iterator[None]:
    before = kernels.get_impl()
    yield
    kernels.set_impl(before)


def test_threads_agree() -> None:
    """1 thread (no split) and 2 threads (keys split, merged by LSE) agree to fp32 rounding."""
    pool = Pool(3, 3000, 3, 64, torch.float32)
    slots, q = pool.take(3000), pool.queries(1, 9)
    q_off, kv = torch.tensor([0, 1]), runs([3000])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.pool_private_attention(q, pool.k, pool.v, slots, q_off, *kv, 0.125)
        torch.set_num_threads(2)
        two = native.pool_private_attention(q, pool.k, pool.v, slots, q_off, *kv, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(one, two, atol=2e-6, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_row_does_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """A one-token request (a decode row, or one position of a speculative draft) gets the
    same bits beside other requests as alone: its keys are split into the same chunks
    whatever else the op holds (here 1500 keys, split alone, beside 15 more decode rows and
    a 300-token prefill)."""
    pool = Pool(5, 1500 + 15 * 700 + 300, 3, 64, dtype)
    lens = [1500] + [700] * 15 + [300]
    slots = pool.take(sum(lens))
    q_lens = [1] * 16 + [300]
    q = pool.queries(sum(q_lens), 9)
    alone = native.pool_private_attention(
        q[:1], pool.k, pool.v, slots[:1500], native._offsets([1]), *runs([1500]), 0.125
    )
    batch = native.pool_private_attention(
        q, pool.k, pool.v, slots, native._offsets(q_lens), *runs(lens), 0.125
    )
    assert torch.equal(batch[0][:1], alone[0]) and torch.equal(batch[1][:1], alone[1])


def test_head_dim_not_multiple_of_8_uses_torch_path() -> None:
    pool = Pool(4, 50, 3, 20, torch.float32)
    slots, q = pool.take(50), pool.queries(6, 9)
    assert not native.supports(q, pool.k)
    got = native.pool_segment_attention(q, pool.k, pool.v, slots, 0.2)
    close(got, reference.segment_attention(q, pool.k[slots], pool.v[slots], 0.2))


def test_empty() -> None:
    pool = Pool(5, 10, 3, 64, torch.float32)
    q = pool.queries(4, 9)
    out, lse = native.pool_segment_attention(q, pool.k, pool.v, pool.take(0), 0.1)
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())
    out, lse = native.pool_segment_attention(q[:0], pool.k, pool.v, pool.take(5), 0.1)
    assert out.shape == (0, 9, 64) and lse.shape == (0, 9)
    zero, none = torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    out, lse = native.pool_private_attention(
        q[:0], pool.k, pool.v, pool.take(0), zero, none, none, 0.1
    )
    assert out.shape == (0, 9, 64) and lse.shape == (0, 9)


def test_rejects_bad_input() -> None:
    pool = Pool(6, 10, 3, 64, torch.float32)
    q, ops = pool.queries(2, 9), native.ops()
    assert ops is not None
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.segment_attention(q, pool.k, pool.v, torch.tensor([1, pool.k.shape[0]]), 0.1)
    two, start = torch.tensor([0, 2]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="need 0 <= q_len <= kv_len"):
        ops.private_attention(q, pool.k, pool.v, pool.take(1), two, start, torch.tensor([1]), 0.1)
    with pytest.raises(RuntimeError, match="q_off must run"):
        one = torch.tensor([0, 1])
        ops.private_attention(q, pool.k, pool.v, pool.take(3), one, start, torch.tensor([2]), 0.1)
    with pytest.raises(RuntimeError, match=r"keys \[1, 4\) outside the 3 slots"):
        ops.private_attention(q, pool.k, pool.v, pool.take(3), two, two[1:] - 1, two[1:] + 1, 0.1)
    with pytest.raises(RuntimeError, match="slot out of range"):  # a slot the run reads
        bad = torch.tensor([0, pool.k.shape[0]])
        ops.private_attention(q, pool.k, pool.v, bad, two, start, two[1:], 0.1)
    with pytest.raises(RuntimeError, match="k/v dtypes differ"):
        ops.segment_attention(q, pool.k, pool.v.half(), pool.take(2), 0.1)


# --------------------------------------------------------------------------- builds and ISA
# The build is chosen once per process (cached), so the other builds run in a child process
# (this file as a script) with the environment set; the parent checks what it printed.
def run_child_checks() -> None:
    """Child: which build "auto" / "native" resolve to, then the shape sweep on that build."""
    q = torch.zeros(1, 9, 64)
    print(f"isa {native.build_isa()} auto {kernels.resolve_impl(q)}", flush=True)
    kernels.set_impl("native")
    ops = native.ops()
    assert ops is not None and kernels.resolve_impl(q) == "native"
    for dtype in (torch.float32, torch.bfloat16):
        for hkv, group in GQA:
            test_pool_segment_matches_reference(hkv, group, dtype)
            test_pool_private_matches_reference(hkv, group, dtype)
        test_soft_capped_scores_match_reference(dtype)
    print(f"ok build {ops.isa}", flush=True)


def child(env: dict[str, str]) -> list[str]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child-checks"], env={**os.environ, **env}, cwd=ROOT,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout.split()


@pytest.mark.kernels
def test_portable_build_matches_reference() -> None:
    """RADIXSERVE_CPU_ISA=scalar: the portable build (no vector flags); "auto" keeps the
    torch path there, set_impl("native") runs the portable kernels."""
    out = child({"RADIXSERVE_CPU_ISA": "scalar"})
    assert out[:4] == ["isa", "scalar", "auto", "cpu"] and out[-3:] == ["ok", "build", "scalar"]


def test_bf16_dot_path_where_the_cpu_has_it() -> None:
    """The AVX-512 build turns the vdpbf16ps path on exactly where the CPU has AVX512-BF16
    (the bf16 cases above then run it); the AVX2 and portable builds never have it."""
    has = torch.cpu._is_avx512_bf16_supported()
    assert native.ops().bf16_dot == (has and native.build_isa() == "avx512")


@pytest.mark.kernels
def test_avx2_capped_environment() -> None:
    """ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (what CI uses to mimic an AVX2-only
    CPU) selects the avx2 build wherever the CPU has AVX2 + FMA + F16C."""
    if native.build_isa() == "scalar":
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    out = child({"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert out[:4] == ["isa", "avx2", "auto", "native"] and out[-3:] == ["ok", "build", "avx2"]


if __name__ == "__main__" and sys.argv[1:] == ["--child-checks"]:
    run_child_checks()
