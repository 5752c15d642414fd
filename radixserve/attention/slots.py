"""`SlotPlan`: attention over K/V named by slot in the pool, request by request, in one
`kernels.pool_private_attention` call (the kernels that read the pool in place take it
as it is; the others gather). Flat and tree attention read private parts through it, and
sliding-window layers their blocks (attention/window.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve import kernels


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


def slot_plan(slots: list[torch.Tensor], q_lens: list[int], device: torch.device) -> SlotPlan:
    """Request r: keys slots[r] ((kv_len_r,) int64, position order), its queries the next
    q_lens[r] rows of q, bottom-right causal as `kernels.private_attention`."""
    cat = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    kv_lens = [s.numel() for s in slots]
    return SlotPlan(cat.to(device), _offsets(q_lens, device), _offsets(kv_lens, device))


def _offsets(lens: list[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out.to(device)
