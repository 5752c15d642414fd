"""Packed allowed-token masks: the format a grammar state hands to the sampler.

A mask over a vocabulary of V tokens is a uint8 tensor (ceil(V / 8),) on the CPU: token t is
allowed iff bit (t % 8) of byte (t // 8) is set -- little-endian bit order, as
numpy.packbits(..., bitorder="little"). Bits past V are zero. Masks are cached per automaton
state (V / 8 bytes: 6 KiB for a 49k vocabulary) and unpacked for the whole batch at once with
a 256-entry table, one gather for all rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# _BITS[b, k] == bool(b >> k & 1): the 8 token flags one mask byte stands for.
_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()  # (256, 8)


def packed_width(vocab_size: int) -> int:
    return (vocab_size + 7) // 8


def pack_token_mask(allowed: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Ids of the allowed tokens -> packed mask (ceil(V / 8),) uint8 (see module docstring)."""
    ids = torch.tensor(list(allowed), dtype=torch.int64)  # (A,)
    assert ids.numel() == 0 or (0 <= int(ids.min()) and int(ids.max()) < vocab_size), (
        f"allowed ids outside [0, {vocab_size}): min {int(ids.min())}, max {int(ids.max())}"
    )
    flags = torch.zeros(packed_width(vocab_size) * 8, dtype=torch.bool)  # (W * 8,)
    flags[ids] = True
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.int32)  # bit k of a byte
    # (W, 8) flags -> (W,) bytes; each sum is < 256, so uint8 holds it exactly.
    return (flags.view(-1, 8).to(torch.int32) * weights).sum(dim=1).to(torch.uint8)


def unpack_token_masks(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed masks (R, ceil(V / 8)) uint8 -> allowed flags (R, V) bool, on packed.device."""
    assert packed.dim() == 2 and packed.dtype == torch.uint8, (
        f"packed masks must be (R, W) uint8, got {tuple(packed.shape)} {packed.dtype}"
    )
    assert packed.shape[1] == packed_width(vocab_size), (
        f"mask width {packed.shape[1]} does not fit vocab {vocab_size}"
    )
    table = _BITS.to(packed.device)  # (256, 8)
    flags = table[packed.long()]  # (R, W, 8): flags[r, w, k] is token 8 w + k
    return flags.view(packed.shape[0], -1)[:, :vocab_size]  # (R, V)
