"""CPU fast path for the attention ops, built on PyTorch's fused CPU flash-attention kernel.

`torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
attn_mask=None, scale=None) -> (out, lse)` takes q (B, H, Lq, D) and k/v (B, Hk, Lk, D)
(arbitrary strides; Hk may divide H: native GQA), fp32/bf16/fp16, and returns out with q's
dtype and shape plus lse (B, H, Lq) float32, natural log. Its quirks, which shape this module:
- `is_causal` aligns top-left, so it is only used on square blocks (Lq == Lk), where top-left
  and bottom-right alignment coincide; never an explicit O(Lq * Lk) mask.
- Lk == 0 crashes the process (SIGFPE); empty inputs are answered here without calling it.
- A fully masked row yields lse 0 (not -inf); no call here can produce such a row.

Shared-segment attention is GQA-stacked the Hydragen way: every query row of every request
under one KV head becomes one row of a single (n * group, D) matrix, so the segment's K/V is
read once for all of them.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """Validate (rows, Hq, D) / (keys, Hkv, D) shapes; return (Hkv, group)."""
    assert q.dim() == 3 and k.dim() == 3, f"q {tuple(q.shape)}, k {tuple(k.shape)}: want 3-D"
    assert k.shape == v.shape, f"k {tuple(k.shape)} != v {tuple(v.shape)}"
    assert q.shape[2] == k.shape[2], f"head dim differs: q {q.shape[2]}, k {k.shape[2]}"
    assert q.dtype == k.dtype == v.dtype, f"dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    assert q.device.type == "cpu", f"the cpu impl needs CPU tensors, got {q.device}"
    hq, hkv = q.shape[1], k.shape[1]
    assert hq % hkv == 0, f"q heads {hq} not a multiple of kv heads {hkv}"
    return hkv, hq // hkv


def _no_keys(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Result for rows that see no key: out 0, lse -inf (what the reference returns)."""
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32)
    return torch.zeros_like(q), lse


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, Hq, D) against one shared segment k/v (L, Hkv, D), no mask.

    Returns out (n, Hq, D) in q's dtype and lse (n, Hq) float32. Reads, never writes, inputs.
    """
    hkv, group = _check_qkv(q, k, v)
    n, hq, d = q.shape
    if n == 0 or k.shape[0] == 0:
        return _no_keys(q)
    # Stack the group: row i * group + j of KV head h is query head h * group + j of row i.
    qs = q.view(n, hkv, group, d).transpose(0, 1)  # (Hkv, n, group, D)
    qs = qs.reshape(1, hkv, n * group, d)  # (1, Hkv, n*group, D), a small copy
    ks = k.transpose(0, 1).unsqueeze(0)  # (1, Hkv, L, D), strided view: no copy
    vs = v.transpose(0, 1).unsqueeze(0)
    out, lse = _flash(qs, ks, vs, 0.0, False, scale=scale)  # (1,Hkv,n*g,D), (1,Hkv,n*g)
    out = out.view(hkv, n, group, d).transpose(0, 1).reshape(n, hq, d)  # (n, Hq, D)
    lse = lse.view(hkv, n, group).transpose(0, 1).reshape(n, hq)  # (n, Hq)
    return out, lse


@dataclass(frozen=True)
class _Run:
    """`count` consecutive requests with equal (q_len, kv_len), starting at rows q0 / k0."""

    count: int
    q_len: int
    kv_len: int
    q0: int
    k0: int


def _runs(q_lens: list[int], kv_lens: list[int]) -> Iterator[_Run]:
    """Group consecutive requests of equal shape: each run is one batched kernel call, because
    equal-length requests laid end to end form a regular (count, len, ...) strided view."""
    i, q0, k0 = 0, 0, 0
    while i < len(q_lens):
        j = i
        while j + 1 < len(q_lens) and (q_lens[j + 1], kv_lens[j + 1]) == (q_lens[i], kv_lens[i]):
            j += 1
        count = j - i + 1
        yield _Run(count, q_lens[i], kv_lens[i], q0, k0)
        q0, k0 = q0 + count * q_lens[i], k0 + count * kv_lens[i]
        i = j + 1


def _decode_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: _Run, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per request (it sees all kv_len keys): q (count, Hq, D), k/v (count*kv, Hkv, D).

    The group of each request is stacked as the query rows of its KV head: no mask, no copy."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qs = q.view(b, hkv, hq // hkv, d)  # (B, Hkv, group, D): a pure view
    ks = k.view(b, r.kv_len, hkv, d).transpose(1, 2)  # (B, Hkv, kv_len, D) strided view
    vs = v.view(b, r.kv_len, hkv, d).transpose(1, 2)
    out, lse = _flash(qs, ks, vs, 0.0, False, scale=scale)  # (B,Hkv,group,D), (B,Hkv,group)
    return out.reshape(b, hq, d), lse.reshape(b, hq)


def _extend_run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: _Run, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_len > 1 queries per request, the last q_len of its kv_len keys (bottom-right causal).

    Split so that no mask is materialized:
        keys  |<---- prefix = kv_len - q_len ---->|<------ q_len ------>|
        part  |  1: no mask, GQA-stacked rows     | 2: square, causal   |
    and merge the two partial states by LSE (exact)."""
    b, ql, kl = r.count, r.q_len, r.kv_len
    hq, d = q.shape[1], q.shape[2]
    hkv = k.shape[1]
    group, prefix = hq // hkv, kl - ql
    q4 = q.view(b, ql, hq, d)
    k4 = k.view(b, kl, hkv, d)  # (B, kv_len, Hkv, D)
    v4 = v.view(b, kl, hkv, d)
    kb = k4[:, prefix:].transpose(1, 2)  # (B, Hkv, q_len, D)
    vb = v4[:, prefix:].transpose(1, 2)
    # Native GQA here: causal rows cannot be stacked across heads under one top-left mask.
    ob, lb = _flash(q4.transpose(1, 2), kb, vb, 0.0, True, scale=scale)  # (B,Hq,ql,D),(B,Hq,ql)
    ob = ob.transpose(1, 2).reshape(b * ql, hq, d)
    lb = lb.transpose(1, 2).reshape(b * ql, hq)
    if prefix == 0:
        return ob, lb
    qs = q.view(b, ql, hkv, group, d).permute(0, 2, 1, 3, 4)  # (B, Hkv, ql, group, D)
    qs = qs.reshape(b, hkv, ql * group, d)  # (B, Hkv, ql*group, D)
    kp = k4[:, :prefix].transpose(1, 2)  # (B, Hkv, prefix, D)
    vp = v4[:, :prefix].transpose(1, 2)
    op, lp = _flash(qs, kp, vp, 0.0, False, scale=scale)  # (B,Hkv,ql*g,D), (B,Hkv,ql*g)
    op = op.view(b, hkv, ql, group, d).permute(0, 2, 1, 3, 4).reshape(b * ql, hq, d)
    lp = lp.view(b, hkv, ql, group).permute(0, 2, 1, 3).reshape(b * ql, hq)
    return merge_states(torch.stack([op, ob]), torch.stack([lp, lb]))


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: list[int], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per request against its own padded keys, in ONE kernel call.

    q (B, Hq, D); k/v (B, L, Hkv, D), any strides with a unit last stride; request b sees
    k[b, :kv_lens[b]] (1 <= kv_lens[b] <= L) and the padding after it is masked with an
    additive -inf (no mask at all when nothing is padded), so it must be finite. Each
    request's group of query heads is stacked as the query rows of its KV head: no copy of q."""
    b, hq, d = q.shape
    assert k.dim() == 4 and k.shape == v.shape, f"k {tuple(k.shape)}, v {tuple(v.shape)}: want 4-D"
    assert k.shape[0] == b == len(kv_lens), f"{b} queries, k {tuple(k.shape)}, {len(kv_lens)} lens"
    _check_qkv(q, k[0], v[0])
    length, hkv = k.shape[1], k.shape[2]
    assert all(1 <= n <= length for n in kv_lens), f"need 1 <= kv_len <= {length}: {kv_lens}"
    qs = q.reshape(b, hkv, hq // hkv, d)  # (B, Hkv, group, D)
    mask = _padding_mask(tuple(kv_lens), length, q.dtype)
    out, lse = _flash(qs, k.transpose(1, 2), v.transpose(1, 2), 0.0, False,
                      attn_mask=mask, scale=scale)  # fmt: skip
    return out.reshape(b, hq, d), lse.reshape(b, hq)


@functools.lru_cache(maxsize=4)
def _padding_mask(kv_lens: tuple[int, ...], length: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Additive (B, 1, 1, L) mask, -inf past each kv_len; None when no row is padded. Every
    layer of a step asks for the same one, so it is built once per step."""
    if min(kv_lens) == length:
        return None
    pos = torch.arange(length)
    mask = torch.zeros(len(kv_lens), 1, 1, length, dtype=dtype)  # broadcast over heads
    mask.masked_fill_(pos >= torch.tensor(kv_lens)[:, None, None, None], float("-inf"))
    return mask


def _check_lens(q: torch.Tensor, k: torch.Tensor, q_lens: list[int], kv_lens: list[int]) -> None:
    assert len(q_lens) == len(kv_lens), f"{len(q_lens)} q_lens vs {len(kv_lens)} kv_lens"
    assert sum(q_lens) == q.shape[0], f"sum(q_lens)={sum(q_lens)} != q rows {q.shape[0]}"
    assert sum(kv_lens) == k.shape[0], f"sum(kv_lens)={sum(kv_lens)} != k rows {k.shape[0]}"
    bad = [
        (i, a, b) for i, (a, b) in enumerate(zip(q_lens, kv_lens, strict=False)) if not 0 <= a <= b
    ]
    assert not bad, f"need 0 <= q_len <= kv_len; (request, q_len, kv_len) violating: {bad[:4]}"


def private_attention(
    q: torch.Tensor,  # (T, Hq, D), requests concatenated
    k: torch.Tensor,  # (S, Hkv, D), requests concatenated
    v: torch.Tensor,
    q_lens: list[int],
    kv_lens: list[int],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, its q_len queries are the last q_len positions of its kv_len keys
    (bottom-right causal). Returns out (T, Hq, D) in q's dtype, lse (T, Hq) float32.

    Raises AssertionError unless 0 <= q_len <= kv_len for every request. Requests are
    processed in runs of equal (q_len, kv_len), one kernel call per run (see `_runs`); decode
    steps of mixed lengths are faster through `decode_attention` on a padded grid."""
    _check_qkv(q, k, v)
    _check_lens(q, k, q_lens, kv_lens)
    runs = list(_runs(q_lens, kv_lens))
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    for r in runs:
        if r.q_len == 0:
            continue
        qr = q[r.q0 : r.q0 + r.count * r.q_len]  # (count*q_len, Hq, D)
        kr = k[r.k0 : r.k0 + r.count * r.kv_len]  # (count*kv_len, Hkv, D)
        vr = v[r.k0 : r.k0 + r.count * r.kv_len]
        attend = _decode_run if r.q_len == 1 else _extend_run
        parts.append(attend(qr, kr, vr, r, scale))
    if not parts:
        return _no_keys(q)
    if len(parts) == 1:
        return parts[0]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def merge_states(
    outs: torch.Tensor,  # (N, T, Hq, D)
    lses: torch.Tensor,  # (N, T, Hq) float32; -inf marks "no contribution"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact N-way log-sum-exp merge in four fused ops (no loop over N):
        L = logsumexp_j L_j,   w_j = exp(L_j - L),   O = sum_j w_j O_j.
    Where every L_j is -inf (no part contributed), L stays -inf and is replaced by 0 before
    the subtraction, so w_j = exp(-inf) = 0 and O = 0 exactly, with no inf - inf."""
    assert outs.dim() == 4 and lses.shape == outs.shape[:3], (
        f"outs {tuple(outs.shape)} / lses {tuple(lses.shape)}: want (N,T,H,D) / (N,T,H)"
    )
    assert lses.dtype == torch.float32, f"lses must be float32, got {lses.dtype}"
    lse = torch.logsumexp(lses, dim=0)  # (T, Hq)
    w = torch.exp(lses - lse.masked_fill(lse == float("-inf"), 0.0))  # (N, T, Hq)
    out = (w.unsqueeze(-1) * outs).sum(0)  # (T, Hq, D) float32 (type promotion, no copy)
    return out.to(outs.dtype), lse
