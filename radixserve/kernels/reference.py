"""Readable torch reference for the attention ops: the oracle every fast path is tested against.

All math in float32; outputs cast back to the query dtype, LSE stays float32. With `softcap`
c > 0 every score s (after the scale) becomes c * tanh(s / c) before the softmax (Gemma 2).
"""

from __future__ import annotations

import torch


def _attend(
    q: torch.Tensor,  # (n, q_heads, head_dim)
    k: torch.Tensor,  # (L, kv_heads, head_dim)
    v: torch.Tensor,  # (L, kv_heads, head_dim)
    scale: float,
    mask: torch.Tensor | None,  # (n, L) bool, True = may attend; None = all
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # (L, q_heads, D)
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale  # (q_heads, n, L)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (q_heads, n)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: all zero
    out = torch.einsum("hnl,lhd->nhd", p, vf)
    return out.to(q.dtype), lse.transpose(0, 1).contiguous()


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, Hq, D) against one shared segment k/v (L, Hkv, D), no mask -> (n, Hq, D), (n, Hq)."""
    return _attend(q, k, v, scale, None, softcap)


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
    outs, lses = [], []
    q0 = k0 = 0
    for ql, kl in zip(q_lens, kv_lens):
        qi = torch.arange(ql)[:, None] + (kl - ql)
        mask = torch.arange(kl)[None, :] <= qi
        o, lse = _attend(q[q0 : q0 + ql], k[k0 : k0 + kl], v[k0 : k0 + kl], scale, mask, softcap)
        outs.append(o)
        lses.append(lse)
        q0, k0 = q0 + ql, k0 + kl
    return torch.cat(outs), torch.cat(lses)


def decode_attention(
    q: torch.Tensor,  # (B, Hq, D), one query per request
    k: torch.Tensor,  # (B, L, Hkv, D), request b's keys padded to L
    v: torch.Tensor,
    kv_lens: list[int],
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's query attends k[b, :kv_lens[b]]; the padding after it is never read."""
    parts = [
        _attend(q[b : b + 1], k[b, :n], v[b, :n], scale, None, softcap)
        for b, n in enumerate(kv_lens)
    ]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def merge_states(
    outs: torch.Tensor,  # (N, T, Hq, D)
    lses: torch.Tensor,  # (N, T, Hq) float32; -inf marks "no contribution"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact N-way log-sum-exp merge: O = sum_j exp(L_j - L) O_j, L = logsumexp_j L_j."""
    lse = torch.logsumexp(lses, dim=0)  # (T, Hq)
    w = torch.exp(lses - lse[None]).nan_to_num(0.0)  # (N, T, Hq)
    out = (w[..., None] * outs.float()).sum(0)
    return out.to(outs.dtype), lse


def key_runs(
    slots: torch.Tensor,  # (S,) int64
    kv_starts: torch.Tensor,  # (B,) int64
    kv_lens: torch.Tensor,  # (B,) int64
) -> torch.Tensor:
    """slots[kv_starts[b] : kv_starts[b] + kv_lens[b]] for every b, concatenated: the keys of
    a pool op's requests as one slot list (the gathering fallbacks read it)."""
    lens = kv_lens.to(slots.device)
    ends = lens.cumsum(0)
    shift = kv_starts.to(slots.device) - (ends - lens)  # run b's slot index minus its output's
    total = int(ends[-1]) if lens.numel() else 0
    return slots[torch.repeat_interleave(shift, lens) + torch.arange(total, device=slots.device)]
