"""Rotary position embeddings: the tables a decoder indexes by position, and their use.

A table has one row per position p < max_position_embeddings, (P, 2, R) with R = rotary_dim
(the first R dims of each head rotate, the rest pass through, as HF's partial rotary):
    row p = [[cos | cos], [-sin | sin]] of p * inv_freq     (inv_freq: (R / 2,))
Scalings change inv_freq (linear, llama3, yarn) or pick it per position (longrope) and may
scale cos/sin (longrope's and yarn's attention factor), as transformers does; everything is
computed in float32 and then cast, so bf16 models round cos/sin as HF does.

longrope: transformers' model picks the short or the long factors by the length of the
sequence its forward call sees; here position p uses the long ones iff p >= the original
context (p + 1 tokens exceed it), so cached K never changes. That is HF's forward fed one
token at a time, and HF's generate for every sequence within the original context. Past it
they differ: HF's Phi-3 generate drops its cache the moment a sequence crosses the original
context and recomputes all of it with the long factors, and one HF forward over a prompt
longer than the original context rotates all of it by the long factors, where the rows
below the original context here keep the short ones.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from radixserve.models import native
from radixserve.models.config import Rope


def inv_freq(rope: Rope, long: bool = False) -> Tensor:
    """(rotary_dim / 2,) float32 inverse frequencies with the scaling applied (`long`: the
    long factors of a longrope scaling)."""
    d = rope.rotary_dim
    base = rope.theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    s = rope.scaling
    if s is None:
        return 1.0 / base
    if s.type == "longrope":
        factors = torch.tensor(s.long_factor if long else s.short_factor, dtype=torch.float32)
        return 1.0 / (factors * base)
    freq = 1.0 / base
    if s.type == "linear":
        return freq / s.factor
    if s.type == "yarn":
        return _yarn(freq, base, rope)
    # llama3: keep high frequencies (short wavelengths), divide low ones by `factor`, and
    # interpolate smoothly in between (wavelengths measured against the original context).
    old_ctx = s.original_max_position_embeddings
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_ctx / s.low_freq_factor, freq / s.factor, freq)
    smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < old_ctx / s.high_freq_factor) & ~(wavelen > old_ctx / s.low_freq_factor)
    return torch.where(medium, smoothed, scaled)


def _yarn(freq: Tensor, base: Tensor, rope: Rope) -> Tensor:
    """YaRN: frequency i keeps its own value (extrapolation) below the ramp's low bound, is
    divided by `factor` (interpolation) above its high bound, and blends linearly between;
    the bounds are the dims where a wavelength fits `beta_fast` / `beta_slow` rotations into
    the original context (transformers' op order, float32)."""
    s, d = rope.scaling, rope.rotary_dim
    assert s is not None and s.type == "yarn", s

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return d * math.log(turns) / (2 * math.log(rope.theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # no empty ramp
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # (R/2,) the share of each frequency left unscaled
    return 1.0 / (s.factor * base) * (1 - keep) + freq * keep


def rope_table(
    rope: Rope, positions: int, dtype: torch.dtype, device: torch.device | str
) -> Tensor:
    """(positions, 2, rotary_dim) table (see the module docstring), in `dtype` on `device`."""
    pos = torch.arange(positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq(rope))  # (P, R/2)
    s = rope.scaling
    if s is not None and s.type == "longrope":
        long = pos >= s.original_max_position_embeddings
        freqs[long] = torch.outer(pos[long], inv_freq(rope, long=True))
    scale = s.attention_factor if s is not None else 1.0
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    table = torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)
    return table.to(device=device, dtype=dtype)  # (P, 2, R)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE (HF/NeoX layout): x (T, H, D), cos = [cos | cos] and sin = [-sin | sin]
    (T, 1, D) -> new (T, H, D) contiguous. Per element the same products and sum as HF's
    x * cos + rotate_half(x) * sin (x2 * -sin == -x2 * sin exactly), in four ops."""
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)  # [x2 | x1]
    return x * cos + swapped * sin


def apply_partial_rope(x: Tensor, cos_sin: Tensor) -> Tensor:
    """RoPE on the first R dims of x (T, H, D) with table rows cos_sin (T, 2, R); the other
    D - R dims pass through -> new (T, H, D) contiguous."""
    r = cos_sin.shape[-1]
    rotated = apply_rope(x[..., :r].contiguous(), cos_sin[:, None, 0], cos_sin[:, None, 1])
    if r == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., r:]), dim=-1)


def rope_qk(qkv: Tensor, cos_sin: Tensor, q_heads: int, kv_heads: int) -> tuple[Tensor, Tensor]:
    """RoPE on the q and k heads of a fused projection qkv (T, >= (Hq + Hkv) * D) with table
    rows cos_sin (T, 2, D) -> q (T, Hq, D) contiguous, k (T, Hkv, D). Full rotary only.

    bf16 / float32 rows on CPU go through the fused native op (same rounding, one call)."""
    if native.applies(qkv) and (fused := native.ops()) is not None:
        q, k = fused.rope_qk(qkv, cos_sin, q_heads, kv_heads)
        return q, k
    t, d = qkv.shape[0], cos_sin.shape[-1]
    # q and k rotated in one pass: their columns are adjacent in the fused projection.
    qk = qkv[:, : (q_heads + kv_heads) * d].view(t, q_heads + kv_heads, d)
    qk = apply_rope(qk, cos_sin[:, None, 0], cos_sin[:, None, 1])  # (T, Hq + Hkv, D)
    # Backends get a contiguous q; k only goes into the pool, so a view does.
    return qk[:, :q_heads].contiguous(), qk[:, q_heads:]
