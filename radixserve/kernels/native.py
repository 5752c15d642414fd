"""Native CPU attention (radixserve/csrc/attention_cpu.cpp): reads K/V from the KV pool by slot.

Ops (shapes as in kernels/__init__.py; the pool ops take one layer's pool tensors
k_cache / v_cache (num_slots, Hkv, D) and int64 slot indices instead of gathered K/V):
- pool_segment_attention(q (n,Hq,D), k_cache, v_cache, slots (L,), scale, prior) -> out, lse
- pool_private_attention(q (T,Hq,D), k_cache, v_cache, slots (S,), q_offsets (B+1,),
  kv_starts (B,), kv_lens (B,), scale, prior) -> out, lse; request b's queries are rows
  q_offsets[b]:q_offsets[b+1], its keys slots[kv_starts[b]:kv_starts[b]+kv_lens[b]]
  (bottom-right causal; `slots` may be a whole request-to-token table, of which only those
  runs are read). Decode is q_offsets == arange(B + 1).
  prior: None, or (out, lse) of the same query rows over other keys; the result is then the
  exact LSE merge of both, fused: the kernel starts its online softmax from that state.
  softcap: c > 0 caps every score s at c * tanh(s / c) (Gemma 2); 0 = none.
- segment_attention, private_attention, decode_attention, merge_states: the dense contract
  of kernels/__init__.py, run by the same kernels (dense K/V is a pool whose slots are
  0..L-1).

What the C++ does (details in its header comment): query rows of one KV head stacked GQA-
wise, K/V of a block of 64 keys loaded once for all of them (fp32 read in place; bf16 / fp16
converted once per block), online softmax, float32 accumulation; long key ranges split
across threads and merged by log-sum-exp; N-way merge in one pass. The AVX-512 build, on a
CPU with AVX512-BF16, computes Q.K^T and P.V of bf16 queries against a bf16 pool with many
rows per KV head (shared segments) with vdpbf16ps, the weights P rounded to bf16 (module
attribute `bf16_dot`).

Build: radixserve/native_build.py (torch's extension builder, -fopenmp, one module per
ISA). The ISA (`build_isa`, from radixserve/isa.py) picks the flags and the module name:
"avx512" (the avx2 flags, AVX-512F/BW/VL/DQ and the vdpbf16ps path), "avx2" (-mavx2 -mfma
-mf16c) or "scalar" (portable C++, no vector flags; never chosen by "auto", which then takes
the torch path). RADIXSERVE_CPU_ISA=scalar selects the portable
build on an AVX2 machine (tests); ATEN_CPU_CAPABILITY=avx2 is seen through torch. `ops()`
returns None when the build fails (no compiler) or native ops are off
(EngineConfig.native_ops): callers then use the torch path ("cpu"), logged.

Unsupported inputs (head dim not a multiple of 8, other dtypes) run the torch path per call.
"""

from __future__ import annotations

from types import ModuleType

import torch

from radixserve.isa import cpu_isa
from radixserve.kernels import cpu, reference
from radixserve.native_build import CSRC, build, native_module

SOURCE = CSRC / "attention_cpu.cpp"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def build_isa() -> str:
    """The build for this CPU: "avx512", "avx2" or "scalar" (portable C++).

    `radixserve.isa.cpu_isa()`: torch's capability (ATEN_CPU_CAPABILITY honoured), FMA and
    F16C from /proc/cpuinfo, lowered by RADIXSERVE_CPU_ISA=avx2|scalar. The avx512 build is
    the avx2 one with 32 vector registers (4-row decode tiles) plus the vdpbf16ps score path,
    used where the CPU has AVX512-BF16."""
    return cpu_isa()


@native_module
def ops() -> ModuleType | None:
    """The compiled module for `build_isa()`, or None when native ops are off or it cannot be
    built (logged)."""
    return build("radixserve_attention_cpu", SOURCE, build_isa())


def auto_ok() -> bool:
    """Whether "auto" should pick these kernels: a vector ISA and a successful build."""
    return build_isa() != "scalar" and ops() is not None


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the C++ kernels take these tensors (else the torch path runs the call)."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and k_cache.dtype in DTYPES
        and q.shape[-1] % 8 == 0
        and k_cache.stride(-1) == 1
        and ops() is not None
    )


def _offsets(lens: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)
    torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0, out=out[1:])
    return out


State = tuple[torch.Tensor, torch.Tensor]  # out (rows, Hq, D), lse (rows, Hq) float32


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return cache.index_select(0, slots)  # (S, Hkv, D) copy, for the torch fallback only


def merge_two(prior: State | None, state: State) -> State:
    """The LSE merge of a prior state and a new one (torch path of the fused merge)."""
    if prior is None:
        return state
    return cpu.merge_states(torch.stack([prior[0], state[0]]), torch.stack([prior[1], state[1]]))


def _prior(prior: State | None) -> dict[str, torch.Tensor]:
    return {} if prior is None else {"prior_out": prior[0], "prior_lse": prior[1]}


def _torch_ops(softcap: float) -> ModuleType:
    """The torch path for tensors the C++ kernels do not take: PyTorch's flash attention, or
    the reference where scores are capped (the flash kernel has no cap)."""
    return reference if softcap else cpu


# ---------------------------------------------------------------------------- pool ops
def pool_segment_attention(
    q: torch.Tensor,  # (n, Hq, D)
    k_cache: torch.Tensor,  # (num_slots, Hkv, D)
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # (L,) int64
    scale: float,
    prior: State | None = None,
    softcap: float = 0.0,
) -> State:
    """q against the segment's keys k_cache[slots], no mask -> (n, Hq, D), (n, Hq) float32,
    merged with `prior` when given."""
    if not supports(q, k_cache):
        k, v = _gather(k_cache, slots), _gather(v_cache, slots)
        dense = _torch_ops(softcap).segment_attention
        return merge_two(prior, dense(q, k, v, scale, **_cap(softcap)))
    mod = ops()
    assert mod is not None
    out, lse = mod.segment_attention(
        q, k_cache, v_cache, slots, scale, **_prior(prior), softcap=softcap
    )
    return out, lse


def pool_private_attention(
    q: torch.Tensor,  # (T, Hq, D), requests concatenated
    k_cache: torch.Tensor,  # (num_slots, Hkv, D)
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # (S,) int64, holding each request's keys in position order
    q_offsets: torch.Tensor,  # (B + 1,) int64, q rows of request b: [q_offsets[b], ..[b+1])
    kv_starts: torch.Tensor,  # (B,) int64, its keys: slots[kv_starts[b]:][:kv_lens[b]]
    kv_lens: torch.Tensor,  # (B,) int64
    scale: float,
    prior: State | None = None,
    softcap: float = 0.0,
) -> State:
    """Bottom-right causal attention per request -> (T, Hq, D), (T, Hq) float32, merged with
    `prior` when given."""
    if not supports(q, k_cache):
        keys = reference.key_runs(slots, kv_starts, kv_lens)
        k, v = _gather(k_cache, keys), _gather(v_cache, keys)
        dense = _torch_ops(softcap).private_attention
        q_lens = q_offsets.diff().tolist()
        state = dense(q, k, v, q_lens, kv_lens.tolist(), scale, **_cap(softcap))
        return merge_two(prior, state)
    mod = ops()
    assert mod is not None
    out, lse = mod.private_attention(
        q, k_cache, v_cache, slots, q_offsets, kv_starts, kv_lens, scale, **_prior(prior),
        softcap=softcap,
    )  # fmt: skip
    return out, lse


def _cap(softcap: float) -> dict[str, float]:
    """The keyword of a capped call (the flash path, never capped, takes none)."""
    return {"softcap": softcap} if softcap else {}


# ---------------------------------------------------------------------------- dense ops
def _rows(k: torch.Tensor) -> torch.Tensor:
    """k (L, Hkv, D) as a pool: the same tensor when its last stride is 1."""
    return k if k.stride(-1) == 1 else k.contiguous()


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, Hq, D) against one shared segment k/v (L, Hkv, D), no mask -> (n, Hq, D), (n, Hq)."""
    cpu._check_qkv(q, k, v)
    slots = torch.arange(k.shape[0], dtype=torch.int64)
    return pool_segment_attention(q, _rows(k), _rows(v), slots, scale, softcap=softcap)


def private_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense private attention (kernels/__init__.py contract) on the native kernels."""
    cpu._check_qkv(q, k, v)
    cpu._check_lens(q, k, q_lens, kv_lens)
    slots = torch.arange(k.shape[0], dtype=torch.int64)
    kv_off = _offsets(kv_lens)
    return pool_private_attention(
        q, _rows(k), _rows(v), slots, _offsets(q_lens), kv_off[:-1], kv_off.diff(), scale,
        softcap=softcap,
    )  # fmt: skip


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: list[int], scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Padded-grid decode (kernels/__init__.py contract): the grid (B, L, Hkv, D) is read as a
    pool of B * L rows; request b's slots are b * L + [0, kv_len); padding is never read."""
    b, length = k.shape[0], k.shape[1]
    assert k.dim() == 4 and k.shape == v.shape, f"k {tuple(k.shape)}, v {tuple(v.shape)}: want 4-D"
    assert b == q.shape[0] == len(kv_lens), f"{q.shape[0]} queries, k {tuple(k.shape)}, {kv_lens}"
    cpu._check_qkv(q, k[0], v[0])
    assert all(1 <= n <= length for n in kv_lens), f"need 1 <= kv_len <= {length}: {kv_lens}"
    kc = k.reshape(b * length, *k.shape[2:])  # (B*L, Hkv, D): a view for a padded grid
    vc = v.reshape(b * length, *v.shape[2:])
    slots = torch.arange(b * length, dtype=torch.int64)  # row b's keys start at b * L
    q_off = torch.arange(b + 1, dtype=torch.int64)
    starts = q_off[:-1] * length
    lens = torch.tensor(kv_lens, dtype=torch.int64)
    return pool_private_attention(q, kc, vc, slots, q_off, starts, lens, scale, softcap=softcap)


def merge_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact N-way LSE merge in one pass per row (kernels/__init__.py contract)."""
    assert outs.dim() == 4 and lses.shape == outs.shape[:3], (
        f"outs {tuple(outs.shape)} / lses {tuple(lses.shape)}: want (N,T,H,D) / (N,T,H)"
    )
    assert lses.dtype == torch.float32, f"lses must be float32, got {lses.dtype}"
    if outs.device.type != "cpu" or outs.dtype not in DTYPES or ops() is None:
        return cpu.merge_states(outs, lses)
    out, lse = ops().merge_states(outs, lses)  # type: ignore[union-attr]
    return out, lse
