"""Attention ops for tree-structured (Hydragen) attention, with one dispatch point.

Public ops (shapes: n/T query rows, L/S key rows, Hq query heads, Hkv KV heads, D head dim;
Hq % Hkv == 0; q/k/v share a dtype; LSE is float32 natural-log of the scaled scores):

- segment_attention(q (n,Hq,D), k (L,Hkv,D), v (L,Hkv,D), scale) -> out (n,Hq,D), lse (n,Hq)
- private_attention(q (T,Hq,D), k (S,Hkv,D), v, q_lens, kv_lens, scale) -> out, lse
- decode_attention(q (B,Hq,D), k (B,L,Hkv,D), v, kv_lens, scale) -> out (B,Hq,D), lse (B,Hq)
- merge_states(outs (N,T,Hq,D), lses (N,T,Hq)) -> out (T,Hq,D), lse (T,Hq)

Pool ops: the same attention with K/V named by slot in one layer's KV pool tensors
k_cache / v_cache (num_slots, Hkv, D) instead of gathered (slots: int64 indices, offsets:
int64 (B + 1,) cumulative counts starting at 0):
- pool_segment_attention(q (n,Hq,D), k_cache, v_cache, slots (L,), scale) -> out, lse
- pool_private_attention(q (T,Hq,D), k_cache, v_cache, slots (S,), q_offsets, kv_starts,
  kv_lens, scale) -> out (T,Hq,D), lse (T,Hq); request b: queries q[q_offsets[b]:q_offsets[b+1]],
  keys slots[kv_starts[b]:kv_starts[b]+kv_lens[b]], bottom-right causal as private_attention.
  The runs may leave gaps: `slots` may be a whole request-to-token table, read only there.
- pool_decode_attention(q (B,Hq,D), k_cache, v_cache, slots (S,), kv_starts, kv_lens, scale):
  one query per request (pool_private_attention with q_offsets = arange(B + 1))
Every attention op takes `softcap` (default 0, none): with c > 0 each score s (after the
scale) becomes c * tanh(s / c) before the softmax, as Gemma 2's layers do. The "native" and
"reference" impls cap; under the others a capped call runs on the reference (logged once).
The cap is per score, so the LSE merge of capped parts stays exact.

Each pool op takes an optional `prior` = (out, lse) of the same query rows over other keys
and then returns the exact LSE merge of that state and its own (a shared segment's result
passed to the private part, say): the "native" and "triton" impls fuse it (their online
softmax starts from the prior state, no stacked buffers), the others run merge_states.
The "native" and "triton" impls read the rows in place; the others gather them
(index_select) and run their dense op. `reads_pool_in_place` says which, so callers keep
their own gather path (with reused scratch buffers) for the others.

Outputs are new tensors (out in q's / outs' dtype); inputs are never modified. A row that sees
no key (L == 0, or every merged part -inf) gets out 0 and lse -inf.

Implementations, chosen in ONE place with `set_impl` (process-wide; a ModelWorker sets it
from EngineConfig.attention_kernels when it starts, benchmarks and tests call it directly) and
logged once per resolved choice (logger "radixserve.kernels"):
- "reference": readable torch (kernels/reference.py), the oracle.
- "cpu": PyTorch's fused CPU flash-attention kernel, GQA-stacked (kernels/cpu.py).
- "native": our C++ CPU kernels reading K/V from the pool in place (kernels/native.py), built
  on first use for the CPU's ISA; "cpu" stands in (logged) when they cannot be built.
- "triton": Triton kernels (kernels/triton_ops.py), imported lazily; CUDA tensors, or CPU
  tensors under TRITON_INTERPRET=1 (tests only).
- "auto" (default): "triton" when the tensors are on CUDA and triton imports; on CPU
  "native" when the CPU has AVX2 + FMA + F16C and the kernels build, else "cpu".
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from radixserve.config import ATTENTION_KERNELS as IMPLS
from radixserve.kernels import cpu, native, reference

__all__ = [
    "IMPLS",
    "decode_attention",
    "get_impl",
    "merge_states",
    "pool_decode_attention",
    "pool_private_attention",
    "pool_segment_attention",
    "private_attention",
    "reads_pool_in_place",
    "resolve_impl",
    "segment_attention",
    "set_impl",
]

logger = logging.getLogger("radixserve.kernels")

State = tuple[torch.Tensor, torch.Tensor]  # out (rows, Hq, D), lse (rows, Hq) float32
_impl = "auto"
_logged: set[tuple[str, str]] = set()  # (requested, resolved) pairs already logged
CAPPING = ("native", "reference")  # the impls whose kernels cap scores


def set_impl(name: str) -> None:
    """Select the implementation of every public op (process-wide). Raises ValueError for an
    unknown name; "triton" raises ImportError at the first op call if triton is missing."""
    global _impl
    if name not in IMPLS:
        raise ValueError(f"unknown kernel impl {name!r}; choose one of {IMPLS}")
    _impl = name


def get_impl() -> str:
    """The selected implementation name (possibly "auto"; see `resolve_impl`)."""
    return _impl


@functools.cache
def _triton_available() -> bool:
    """Whether triton imports (checked once: a failed import is not retried per call)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(t: torch.Tensor) -> str:
    """The concrete implementation the ops use for tensors like `t` under the current choice.

    May build the native kernels (first call only; cached on disk afterwards)."""
    if _impl == "native":
        return "native" if native.ops() is not None else "cpu"  # build failure: logged there
    if _impl != "auto":
        return _impl
    if t.is_cuda:
        return "triton" if _triton_available() else "cpu"
    return "native" if native.auto_ok() else "cpu"


def reads_pool_in_place(t: torch.Tensor) -> bool:
    """Whether the pool_* ops read K/V rows in place for tensors like `t` (else they gather)."""
    return resolve_impl(t) in ("native", "triton")


def _module(t: torch.Tensor, softcap: float = 0.0) -> ModuleType:
    name = resolve_impl(t)
    if softcap and name not in CAPPING:
        if (name, "reference") not in _logged:
            _logged.add((name, "reference"))
            logger.info("soft-capped attention runs on the reference kernels (not %s)", name)
        name = "reference"
    if (_impl, name) not in _logged:
        _logged.add((_impl, name))
        logger.info("attention kernels: %s (requested %r, tensors on %s)", name, _impl, t.device)
    if name == "reference":
        return reference
    if name == "cpu":
        return cpu
    if name == "native":
        return native
    from radixserve.kernels import triton_ops  # lazy: triton is an optional dependency

    return triton_ops


def _cap(softcap: float) -> dict[str, float]:
    """The keyword of a capped call: only the capping impls take it (`_module` sends every
    capped call to one of them)."""
    return {"softcap": softcap} if softcap else {}


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, Hq, D) against one shared segment k/v (L, Hkv, D), no mask -> (n, Hq, D), (n, Hq)."""
    return _module(q, softcap).segment_attention(q, k, v, scale, **_cap(softcap))


def private_attention(
    q: torch.Tensor,  # (T, Hq, D), requests concatenated
    k: torch.Tensor,  # (S, Hkv, D), requests concatenated
    v: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: its q_len queries are the LAST q_len positions of its kv_len keys
    (bottom-right causal alignment): query i sees keys 0 .. kv_len - q_len + i."""
    mod = _module(q, softcap)
    return mod.private_attention(q, k, v, q_lens, kv_lens, scale, **_cap(softcap))


def decode_attention(
    q: torch.Tensor,  # (B, Hq, D), one query per request
    k: torch.Tensor,  # (B, L, Hkv, D), request b's keys padded to L
    v: torch.Tensor,
    kv_lens: list[int],
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode over a padded grid: request b's query sees k[b, :kv_lens[b]] (1 <= kv_len <= L);
    what lies past kv_lens[b] gets no weight but must be finite (implementations may mask
    rather than skip it). One call for a whole decode batch of mixed lengths."""
    return _module(q, softcap).decode_attention(q, k, v, kv_lens, scale, **_cap(softcap))


def merge_states(
    outs: torch.Tensor,  # (N, T, Hq, D)
    lses: torch.Tensor,  # (N, T, Hq) float32; -inf marks "no contribution"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact N-way log-sum-exp merge: O = sum_j exp(L_j - L) O_j, L = logsumexp_j L_j."""
    return _module(outs).merge_states(outs, lses)


def pool_segment_attention(
    q: torch.Tensor,  # (n, Hq, D)
    k_cache: torch.Tensor,  # (num_slots, Hkv, D) one layer's pool
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # (L,) int64, the segment's keys
    scale: float,
    prior: State | None = None,  # (n, Hq, D), (n, Hq) float32
    softcap: float = 0.0,
) -> State:
    """segment_attention over k_cache[slots] / v_cache[slots] -> (n, Hq, D), (n, Hq), merged
    with `prior` when given."""
    mod = _module(q, softcap)
    if mod is not reference and reads_pool_in_place(q):
        return mod.pool_segment_attention(q, k_cache, v_cache, slots, scale, prior, **_cap(softcap))
    k, v = k_cache.index_select(0, slots), v_cache.index_select(0, slots)  # (L, Hkv, D)
    return _merged(mod, prior, mod.segment_attention(q, k, v, scale, **_cap(softcap)))


def pool_private_attention(
    q: torch.Tensor,  # (T, Hq, D), requests concatenated
    k_cache: torch.Tensor,  # (num_slots, Hkv, D) one layer's pool
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # (S,) int64, holding each request's keys in position order
    q_offsets: torch.Tensor,  # (B + 1,) int64
    kv_starts: torch.Tensor,  # (B,) int64
    kv_lens: torch.Tensor,  # (B,) int64
    scale: float,
    prior: State | None = None,  # (T, Hq, D), (T, Hq) float32
    softcap: float = 0.0,
) -> State:
    """private_attention with request b's keys slots[kv_starts[b]:][:kv_lens[b]] and queries
    q[q_offsets[b]:q_offsets[b + 1]] -> (T, Hq, D), (T, Hq), merged with `prior`."""
    mod = _module(q, softcap)
    if mod is not reference and reads_pool_in_place(q):
        return mod.pool_private_attention(
            q, k_cache, v_cache, slots, q_offsets, kv_starts, kv_lens, scale, prior,
            **_cap(softcap),
        )  # fmt: skip
    keys = reference.key_runs(slots, kv_starts, kv_lens)
    k, v = k_cache.index_select(0, keys), v_cache.index_select(0, keys)  # (S, Hkv, D)
    q_lens = q_offsets.diff().tolist()
    state = mod.private_attention(q, k, v, q_lens, kv_lens.tolist(), scale, **_cap(softcap))
    return _merged(mod, prior, state)


def pool_decode_attention(
    q: torch.Tensor,  # (B, Hq, D), one query per request
    k_cache: torch.Tensor,  # (num_slots, Hkv, D) one layer's pool
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # (S,) int64
    kv_starts: torch.Tensor,  # (B,) int64
    kv_lens: torch.Tensor,  # (B,) int64; every request has >= 1 key
    scale: float,
    prior: State | None = None,  # (B, Hq, D), (B, Hq) float32
    softcap: float = 0.0,
) -> State:
    """Decode: request b's query attends its keys slots[kv_starts[b]:][:kv_lens[b]]."""
    q_offsets = torch.arange(q.shape[0] + 1, dtype=torch.int64, device=kv_lens.device)
    return pool_private_attention(
        q, k_cache, v_cache, slots, q_offsets, kv_starts, kv_lens, scale, prior, softcap
    )


def _merged(mod: ModuleType, prior: State | None, state: State) -> State:
    if prior is None:
        return state
    return mod.merge_states(torch.stack([prior[0], state[0]]), torch.stack([prior[1], state[1]]))
