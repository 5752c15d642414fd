"""Packed allowed-token masks: the format a grammar state hands to the sampler.

A mask over a vocabulary of V tokens is a uint8 tensor (ceil(V / 8),) on the CPU: token t is
allowed iff bit (t % 8) of byte (t // 8) is set -- little-endian bit order, as
numpy.packbits(..., bitorder="little"). Bits past V are zero. Masks are cached per automaton
state (V / 8 bytes: 6 KiB for a 49k vocabulary) and expanded for the whole batch at once by
one gather from a 256-entry table: into flags (`unpack_token_masks`), or straight into an
additive logit bias of 0 / -inf (`token_mask_bias`) -- about half the cost of unpacking then
masked_fill (measured, batch 16 x 49k vocabulary on CPU). The sampler's CPU path adds the
same 0 / -inf straight from the packed bytes (`mask_logits_`, radixserve/csrc/sample_cpu.cpp:
64 x 49152 logits 24-36 -> 3.7-5.8 ms, AVX2 EPYC, loaded machine); this is its fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

# _BITS[b, k] == bool(b >> k & 1): the 8 token flags one mask byte stands for.
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # (256, 8)
# _BIAS[b, k]: 0.0 where _BITS[b, k] (allowed), -inf elsewhere. x + 0.0 == x exactly.
_BIAS = torch.zeros(256, 8).masked_fill_(~_BITS, float("-inf"))  # (256, 8) float32


def packed_width(vocab_size: int) -> int:
    return (vocab_size + 7) // 8


def pack_token_mask(allowed: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Ids of the allowed tokens (any order, duplicates allowed) -> packed mask
    (ceil(V / 8),) uint8 (see module docstring). numpy: ~1 ms for a 48k-id list, where the
    same in torch took tens of ms on this CPU (states are packed on first visit, mid-step)."""
    ids = np.asarray(allowed, dtype=np.int64)  # (A,)
    assert ids.size == 0 or (0 <= ids.min() and ids.max() < vocab_size), (
        f"allowed ids outside [0, {vocab_size}): min {ids.min()}, max {ids.max()}"
    )
    flags = np.zeros(packed_width(vocab_size) * 8, dtype=np.bool_)  # (W * 8,)
    flags[ids] = True
    return torch.from_numpy(np.packbits(flags, bitorder="little"))  # (W,) uint8


def unpack_token_masks(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed masks (R, ceil(V / 8)) uint8 -> allowed flags (R, V) bool, on packed.device."""
    return _expand(_BITS, packed, vocab_size)


def token_mask_bias(packed: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed masks (R, ceil(V / 8)) uint8 -> bias (R, V) of `dtype`: 0 allowed, -inf not."""
    return _expand(_BIAS.to(dtype), packed, vocab_size)


def _expand(table: torch.Tensor, packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Look each mask byte up in `table` (256, 8): (R, W) -> (R, V), row r, token t read from
    table[packed[r, t // 8], t % 8]."""
    assert packed.dim() == 2 and packed.dtype == torch.uint8, (
        f"packed masks must be (R, W) uint8, got {tuple(packed.shape)} {packed.dtype}"
    )
    assert packed.shape[1] == packed_width(vocab_size), (
        f"mask width {packed.shape[1]} does not fit vocab {vocab_size}"
    )
    out = table.to(packed.device)[packed.long()]  # (R, W, 8): out[r, w, k] is token 8 w + k
    return out.view(packed.shape[0], -1)[:, :vocab_size]  # (R, V)
