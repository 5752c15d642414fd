"""`SlotPlan`: attention over K/V named by slot in the pool, request by request, in one
`kernels.pool_private_attention` call (the kernels that read the pool in place take it
as it is; the others gather). Flat and tree attention read private parts through it, and
sliding-window layers their blocks (attention/window.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve import kernels
from radixserve.core.batch import cat_slots


@dataclass(frozen=True)
class SlotPlan:
    """Request r's keys are slots[kv_offsets[r]:kv_offsets[r+1]] of the pool, its queries rows
    q_offsets[r]:q_offsets[r+1]; the kernel reads those pool rows in place."""

    slots: torch.Tensor  # (S,) int64, requests concatenated, position order
    q_offsets: torch.Tensor  # (B + 1,) int64 cumulative q_lens
    kv_offsets: torch.Tensor  # (B + 1,) int64 cumulative kv_lens

    def attend(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        scale: float,
        prior: tuple[torch.Tensor, torch.Tensor] | None = None,
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q (T, Hq, D) against one layer's pool k/v (num_slots, Hkv, D) -> (T, Hq, D), (T, Hq);
        merged with `prior` (out, lse of the same rows over other keys) when given."""
        return kernels.pool_private_attention(
            q, kc, vc, self.slots, self.q_offsets, self.kv_offsets, scale, prior, softcap
        )

    def grown(self, new: torch.Tensor) -> SlotPlan:
        """The plan of the next decode step: each request's one query (q_offsets unchanged)
        also reads its new token's slot new[r] ((B,) int64), after its other keys."""
        b, old = new.numel(), self.slots
        assert self.q_offsets.numel() == b + 1, f"{self.q_offsets.numel() - 1} requests, {b} slots"
        kv_offsets = self.kv_offsets + torch.arange(b + 1, device=old.device)
        ends = kv_offsets[1:] - 1  # each request's last key: its new token's
        earlier = torch.ones(old.numel() + b, dtype=torch.bool, device=old.device)
        earlier[ends] = False
        slots = torch.empty(old.numel() + b, dtype=old.dtype, device=old.device)
        slots.masked_scatter_(earlier, old)
        slots[ends] = new.to(old.device)
        return SlotPlan(slots, self.q_offsets, kv_offsets)


def slot_plan(slots: Sequence[torch.Tensor], q_lens: list[int], device: torch.device) -> SlotPlan:
    """Request r: keys slots[r] ((kv_len_r,) int64, position order), its queries the next
    q_lens[r] rows of q, bottom-right causal as `kernels.private_attention`."""
    cat = cat_slots(slots)
    kv_lens = [s.numel() for s in slots]
    return SlotPlan(cat.to(device), _offsets(q_lens, device), _offsets(kv_lens, device))


def _offsets(lens: list[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out.to(device)
