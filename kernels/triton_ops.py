"""Host wrappers for the Triton attention kernels (kernels/triton_kernels.py).

Same signatures and contract as kernels/reference.py. Each wrapper validates shapes and
dtypes with messages, allocates the outputs, and launches. Runs on CUDA tensors, or on CPU
tensors when TRITON_INTERPRET=1 was set before this module was first imported (the
interpreter; fp32/fp16 only there, its bf16 is broken). Importing this module imports triton.
"""

from __future__ import annotations

import math

import torch
import triton
from radixserve.kernels import triton_kernels as tk

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """Kernels assume a unit stride on the last (head-dim) axis; other strides are free."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate (rows, Hq, D) / (keys, Hkv, D); return the GQA group size Hq // Hkv."""
    assert q.dim() == 3 and k.dim() == 3, f"q {tuple(q.shape)}, k {tuple(k.shape)}: want 3-D"
    assert k.shape == v.shape, f"k {tuple(k.shape)} != v {tuple(v.shape)}"
    assert q.shape[2] == k.shape[2], f"head dim differs: q {q.shape[2]}, k {k.shape[2]}"
    assert q.dtype == k.dtype == v.dtype, f"dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    assert q.dtype in _DTYPES, f"unsupported dtype {q.dtype}; want one of {_DTYPES}"
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
        "BLOCK_N": 32,
        "BLOCK_D": max(16, triton.next_power_of_2(q.shape[2])),
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
    }


def _outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # (rows, Hq, D)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # (rows, Hq)
    return out, lse


def _no_keys(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    return torch.zeros_like(q), lse


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, Hq, D) against one shared segment k/v (L, Hkv, D), no mask -> (n, Hq, D), (n, Hq)."""
    group = _check_qkv(q, k, v)
    n, seg_len = q.shape[0], k.shape[0]
    if n == 0 or seg_len == 0:
        return _no_keys(q)
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    out, lse = _outputs(q)
    meta = _meta(q, n * group)
    grid = (triton.cdiv(n * group, meta["BLOCK_M"]), k.shape[1])
    tk.segment_fwd_kernel[grid](
        q, k, v, out, lse, n, seg_len, scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        GROUP=group, **meta,
    )  # fmt: skip
    return out, lse


def _prefix_sums(lens: list[int], device: torch.device) -> torch.Tensor:
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    assert starts[-1] < 2**31, f"{starts[-1]} rows overflow the kernels' int32 offsets"
    return torch.tensor(starts, dtype=torch.int32, device=device)  # (B + 1,)


def private_attention(
    q: torch.Tensor,  # (T, Hq, D), requests concatenated
    k: torch.Tensor,  # (S, Hkv, D), requests concatenated
    v: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request: its q_len queries are the LAST q_len positions of its kv_len keys
    (bottom-right causal). Raises AssertionError unless 0 <= q_len <= kv_len per request."""
    group = _check_qkv(q, k, v)
    assert len(q_lens) == len(kv_lens), f"{len(q_lens)} q_lens vs {len(kv_lens)} kv_lens"
    assert sum(q_lens) == q.shape[0], f"sum(q_lens)={sum(q_lens)} != q rows {q.shape[0]}"
    assert sum(kv_lens) == k.shape[0], f"sum(kv_lens)={sum(kv_lens)} != k rows {k.shape[0]}"
    bad = [
        (i, a, b) for i, (a, b) in enumerate(zip(q_lens, kv_lens, strict=False)) if not 0 <= a <= b
    ]
    assert not bad, f"need 0 <= q_len <= kv_len; (request, q_len, kv_len) violating: {bad[:4]}"
    if q.shape[0] == 0:
        return _no_keys(q)
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    out, lse = _outputs(q)
    max_rows = max(q_lens) * group
    meta = _meta(q, max_rows)
    grid = (triton.cdiv(max_rows, meta["BLOCK_M"]), k.shape[1], len(q_lens))
    tk.private_fwd_kernel[grid](
        q, k, v, out, lse,
        _prefix_sums(q_lens, q.device), _prefix_sums(kv_lens, q.device),
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        GROUP=group, **meta,
    )  # fmt: skip
    return out, lse


def decode_attention(
    q: torch.Tensor,  # (B, Hq, D), one query per request
    k: torch.Tensor,  # (B, L, Hkv, D), request b's keys padded to L
    v: torch.Tensor,
    kv_lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's query attends k[b, :kv_lens[b]]: the valid rows are packed request-major
    and run through the private kernel (one query per request is its decode case)."""
    assert k.dim() == 4 and k.shape == v.shape and k.shape[0] == q.shape[0] == len(kv_lens), (
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, {len(kv_lens)} kv_lens"
    )
    lens = torch.tensor(kv_lens, device=k.device)
    valid = torch.arange(k.shape[1], device=k.device)[None, :] < lens[:, None]  # (B, L)
    return private_attention(q, k[valid], v[valid], [1] * len(kv_lens), kv_lens, scale)


def merge_states(
    outs: torch.Tensor,  # (N, T, Hq, D)
    lses: torch.Tensor,  # (N, T, Hq) float32; -inf marks "no contribution"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact N-way log-sum-exp merge: O = sum_j exp(L_j - L) O_j, L = logsumexp_j L_j."""
    assert outs.dim() == 4 and lses.shape == outs.shape[:3], (
        f"outs {tuple(outs.shape)} / lses {tuple(lses.shape)}: want (N,T,H,D) / (N,T,H)"
    )
    assert lses.dtype == torch.float32, f"lses must be float32, got {lses.dtype}"
    assert outs.device == lses.device, f"devices differ: {outs.device}, {lses.device}"
    n_parts, t, hq, d = outs.shape
    rows = t * hq
    out = torch.empty((t, hq, d), dtype=outs.dtype, device=outs.device)  # contiguous
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
