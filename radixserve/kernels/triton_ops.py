"""Host wrappers for the Triton attention kernels (kernels/triton_kernels.py).

Same signatures and contract as kernels/reference.py, plus the pool ops of kernels/__init__.py
(K/V read from the pool in place by slot; a `prior` state resumed inside the kernel). Each
wrapper validates shapes and dtypes with messages, allocates the outputs, and launches,
without reading anything back from the device (no host sync). Runs on CUDA tensors, or on
CPU tensors when TRITON_INTERPRET=1 was set before this module was first imported (the
interpreter; fp32/fp16 only there, its bf16 is broken). Importing this module imports triton.

Split-K: where a launch would have too few programs to keep the GPU's memory system busy
(a shared segment read by one tile of stacked queries, a decode batch of a few requests),
each request's keys are cut into `splits` runs, each program writes a partial state, and one
merge pass combines them (with the prior, if any): `pick_splits`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from radixserve.kernels import triton_kernels as tk

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
State = tuple[torch.Tensor, torch.Tensor]  # out (rows, Hq, D), lse (rows, Hq) float32
MIN_SPLIT_KEYS = 256  # a split streams at least this many keys (else its merge costs more)
MAX_SPLITS = 32
PROGRAMS_PER_SM = 4  # programs in flight per multiprocessor that saturate its loads


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """Kernels assume a unit stride on the last (head-dim) axis; other strides are free."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate (rows, Hq, D) / (keys, Hkv, D); return the GQA group size Hq // Hkv."""
    assert q.dim() == 3 and k.dim() == 3, f"q {tuple(q.shape)}, k {tuple(k.shape)}: want 3-D"
    assert k.shape == v.shape, f"k {tuple(k.shape)} != v {tuple(v.shape)}"
    assert q.shape[2] == k.shape[2], f"head dim differs: q {q.shape[2]}, k {k.shape[2]}"
    assert q.dtype in _DTYPES, f"unsupported dtype {q.dtype}; want one of {_DTYPES}"
    assert k.dtype == v.dtype, f"k/v dtypes differ: {k.dtype}, {v.dtype}"
    assert q.device == k.device == v.device, f"devices differ: {q.device}, {k.device}"
    assert q.shape[1] % k.shape[1] == 0, f"q heads {q.shape[1]} % kv heads {k.shape[1]} != 0"
    return q.shape[1] // k.shape[1]


def _meta(q: torch.Tensor, rows_per_tile: int) -> dict[str, object]:
    """Compile-time tile sizes: tl.dot needs every dim >= 16; fp32 dots stay IEEE (no TF32)
    so the fp32 results match the reference to 1e-5."""
    block_m = 16 if rows_per_tile <= 16 else (32 if rows_per_tile <= 32 else 64)
    return {
        "HEAD_DIM": q.shape[2],
        "BLOCK_M": block_m,
        "BLOCK_N": 32 if q.device.type != "cuda" else 64,
        "BLOCK_D": max(16, triton.next_power_of_2(q.shape[2])),
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def pick_splits(programs: int, keys_per_request: int, device: torch.device) -> int:
    """How many runs to cut each request's keys into: enough programs for PROGRAMS_PER_SM per
    multiprocessor, each run at least MIN_SPLIT_KEYS keys, a power of two (each value is a
    compiled variant). 1 off CUDA (the interpreter's tests pass `splits` themselves)."""
    if device.type != "cuda" or programs <= 0:
        return 1
    want = PROGRAMS_PER_SM * _multiprocessors(device.index or 0) // programs
    fit = min(want, keys_per_request // MIN_SPLIT_KEYS, MAX_SPLITS)
    return 1 if fit < 2 else 1 << (fit.bit_length() - 1)


def _no_keys(q: torch.Tensor) -> State:
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    return torch.zeros_like(q, memory_format=torch.contiguous_format), lse


def _attend(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (rows, Hkv, D): dense keys, or a pool layer when `slots` is given
    v: torch.Tensor,
    slots: torch.Tensor | None,  # (S,) int64 pool slots, requests concatenated
    starts: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,  # on q's device: q
    # prefix sums (B + 1,), kv starts (B,), kv lens (B,); None: one request of q.shape[0]
    # queries and `keys` keys
    max_q_len: int,  # an upper bound on any request's q_len (sizes the grid)
    keys: int,  # total keys over all requests (sizes the splits)
    scale: float,
    causal: bool,
    prior: State | None,
    splits: int | None,
) -> State:
    group = _check_qkv(q, k, v)
    n_req = 1 if starts is None else starts[0].numel() - 1
    if q.shape[0] == 0 or n_req == 0:
        return _no_keys(q)
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    meta = _meta(q, max_q_len * group)
    tiles = triton.cdiv(max_q_len * group, meta["BLOCK_M"])
    if splits is None:
        splits = pick_splits(tiles * k.shape[1] * n_req, keys // n_req, q.device)
    fused = prior if splits == 1 else None  # resumed inside the kernel
    if splits == 1:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (T, Hq, D)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        o_strides, l_strides = (0, *out.stride()[:2]), (0, *lse.stride())
    else:  # the kernel writes parts [0, splits); a prior is the last part of the merge
        parts = splits + (prior is not None)
        out = torch.empty((parts, *q.shape), dtype=torch.float32, device=q.device)
        lse = torch.empty((parts, *q.shape[:2]), dtype=torch.float32, device=q.device)
        o_strides, l_strides = out.stride()[:3], lse.stride()
        if prior is not None:
            out[splits], lse[splits] = prior
    p_o, p_l = (_row_major(fused[0]), fused[1]) if fused is not None else (q, lse)  # unread if not
    q_start, k_start, k_len = starts if starts is not None else (lse, lse, lse)  # SINGLE: unread
    tk.attend_fwd_kernel[(tiles, k.shape[1], n_req * splits)](
        q, k, v, slots if slots is not None else q_start, q_start, k_start, k_len, p_o, p_l,
        out, lse,
        q.shape[0], keys, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        p_o.stride(0), p_o.stride(1), p_l.stride(-2), p_l.stride(-1), *o_strides, *l_strides,
        GROUP=group, CAUSAL=causal, INDEXED=slots is not None, HAS_PRIOR=fused is not None,
        SPLITS=splits, SINGLE=starts is None, **meta,
    )  # fmt: skip
    if splits == 1:
        return out, lse
    return _merge(out, lse, q.dtype)


def _prefix_sums(lens: list[int], device: torch.device) -> torch.Tensor:
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    return torch.tensor(starts, dtype=torch.int64, device=device)  # (B + 1,)


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, splits: int | None = None
) -> State:
    """q (n, Hq, D) against one shared segment k/v (L, Hkv, D), no mask -> (n, Hq, D), (n, Hq)."""
    _check_qkv(q, k, v)
    if k.shape[0] == 0:
        return _no_keys(q)
    return _attend(q, k, v, None, None, q.shape[0], k.shape[0], scale, False, None, splits)


def private_attention(
    q: torch.Tensor,  # (T, Hq, D), requests concatenated
    k: torch.Tensor,  # (S, Hkv, D), requests concatenated
    v: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
    splits: int | None = None,
) -> State:
    """Per request: its q_len queries are the LAST q_len positions of its kv_len keys
    (bottom-right causal). Raises AssertionError unless 0 <= q_len <= kv_len per request."""
    _check_qkv(q, k, v)
    assert len(q_lens) == len(kv_lens), f"{len(q_lens)} q_lens vs {len(kv_lens)} kv_lens"
    assert sum(q_lens) == q.shape[0], f"sum(q_lens)={sum(q_lens)} != q rows {q.shape[0]}"
    assert sum(kv_lens) == k.shape[0], f"sum(kv_lens)={sum(kv_lens)} != k rows {k.shape[0]}"
    bad = [
        (i, a, b) for i, (a, b) in enumerate(zip(q_lens, kv_lens, strict=False)) if not 0 <= a <= b
    ]
    assert not bad, f"need 0 <= q_len <= kv_len; (request, q_len, kv_len) violating: {bad[:4]}"
    kv_off = _prefix_sums(kv_lens, q.device)
    starts = _prefix_sums(q_lens, q.device), kv_off[:-1], kv_off.diff()
    longest = max(q_lens, default=0)
    return _attend(q, k, v, None, starts, longest, k.shape[0], scale, True, None, splits)


def decode_attention(
    q: torch.Tensor,  # (B, Hq, D), one query per request
    k: torch.Tensor,  # (B, L, Hkv, D), request b's keys padded to L
    v: torch.Tensor,
    kv_lens: list[int],
    scale: float,
) -> State:
    """Request b's query attends k[b, :kv_lens[b]]: the valid rows are packed request-major
    and run through the private kernel (one query per request is its decode case)."""
    assert k.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0] == len(kv_lens), (
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, {len(kv_lens)} kv_lens"
    )
    lens = torch.tensor(kv_lens, device=k.device)
    valid = torch.arange(k.shape[1], device=k.device)[None, :] < lens[:, None]  # (B, L)
    return private_attention(q, k[valid], v[valid], [1] * len(kv_lens), kv_lens, scale)


def pool_segment_attention(
    q: torch.Tensor,  # (n, Hq, D)
    k_cache: torch.Tensor,  # (num_slots, Hkv, D) one layer's pool
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # (L,) int64, the segment's keys
    scale: float,
    prior: State | None = None,
    splits: int | None = None,
) -> State:
    """segment_attention over k_cache[slots] / v_cache[slots], read in place, resumed from
    `prior` when given."""
    n, seg_len = q.shape[0], slots.numel()
    if seg_len == 0:
        return prior if prior is not None else _no_keys(q)
    return _attend(q, k_cache, v_cache, slots, None, n, seg_len, scale, False, prior, splits)


def pool_private_attention(
    q: torch.Tensor,  # (T, Hq, D), requests concatenated
    k_cache: torch.Tensor,  # (num_slots, Hkv, D) one layer's pool
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # (S,) int64, holding each request's keys in position order
    q_offsets: torch.Tensor,  # (B + 1,) int64, on q's device
    kv_starts: torch.Tensor,  # (B,) int64
    kv_lens: torch.Tensor,  # (B,) int64
    scale: float,
    prior: State | None = None,
    splits: int | None = None,
) -> State:
    """private_attention with request b's keys slots[kv_starts[b]:][:kv_lens[b]] read in
    place; the grid is sized by the bound T - B + 1 on any q_len and the splits by the
    slots' count (no host sync)."""
    n_req = q_offsets.numel() - 1
    if n_req == 0:
        return prior if prior is not None else _no_keys(q)
    longest = max(q.shape[0] - n_req + 1, 1)
    return _attend(
        q, k_cache, v_cache, slots, (q_offsets, kv_starts, kv_lens), longest, slots.numel(),
        scale, True, prior, splits,
    )  # fmt: skip


def merge_states(
    outs: torch.Tensor,  # (N, T, Hq, D)
    lses: torch.Tensor,  # (N, T, Hq) float32; -inf marks "no contribution"
) -> State:
    """Exact N-way log-sum-exp merge: O = sum_j exp(L_j - L) O_j, L = logsumexp_j L_j."""
    assert outs.dim() == 4 and lses.shape == outs.shape[:3], (
        f"outs {tuple(outs.shape)} / lses {tuple(lses.shape)}: want (N,T,H,D) / (N,T,H)"
    )
    assert lses.dtype == torch.float32, f"lses must be float32, got {lses.dtype}"
    assert outs.device == lses.device, f"devices differ: {outs.device}, {lses.device}"
    return _merge(outs, lses, outs.dtype)


def _merge(outs: torch.Tensor, lses: torch.Tensor, dtype: torch.dtype) -> State:
    """merge_states with the output in `dtype`."""
    n_parts, t, hq, d = outs.shape
    rows = t * hq
    out = torch.empty((t, hq, d), dtype=dtype, device=outs.device)  # contiguous
    lse = torch.empty((t, hq), dtype=torch.float32, device=outs.device)
    if rows == 0:
        return out, lse
    flat_o = _row_major(outs.reshape(n_parts, rows, d))  # (N, T*Hq, D)
    flat_l = lses.reshape(n_parts, rows).contiguous()  # (N, T*Hq): kernel assumes unit row stride
    block_r = 16
    grid = (triton.cdiv(rows, block_r),)
    tk.merge_kernel[grid](
        flat_o, flat_l, out, lse, n_parts, rows,
        flat_o.stride(0), flat_o.stride(1), flat_l.stride(0),
        HEAD_DIM=d, BLOCK_R=block_r, BLOCK_D=max(16, triton.next_power_of_2(d)),
    )  # fmt: skip
    return out, lse
