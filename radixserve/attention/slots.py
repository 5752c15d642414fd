"""`SlotPlan`: attention over K/V named by slot in the pool, request by request, in one
`kernels.pool_private_attention` call (the kernels that read the pool in place take it
as it is; the others gather). Flat and tree attention read private parts through it, and
sliding-window layers their blocks (attention/window.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve import kernels
from radixserve.core.batch import ForwardBatch, TableRows, cat_slots


@dataclass(frozen=True)
class SlotPlan:
    """Request r's keys are slots[kv_starts[r]:][:kv_lens[r]] of the pool, its queries rows
    q_offsets[r]:q_offsets[r+1]; the kernel reads those pool rows in place.

    `slots` is either the requests' keys concatenated or, `in_table`, the request-to-token
    table itself (flattened): each request's keys are then a run of its table row, which
    already holds every position's slot, so a decode step's plan is the step before's with
    each length one more, and nothing per step is copied."""

    slots: torch.Tensor  # (S,) int64: keys concatenated in position order, or a flat table
    q_offsets: torch.Tensor  # (B + 1,) int64 cumulative q_lens
    kv_starts: torch.Tensor  # (B,) int64
    kv_lens: torch.Tensor  # (B,) int64
    in_table: bool = False

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
            q, kc, vc, self.slots, self.q_offsets, self.kv_starts, self.kv_lens, scale, prior,
            softcap,
        )  # fmt: skip

    def keys(self) -> list[torch.Tensor]:
        """Each request's key slots (views of `slots`), for checks."""
        runs = zip(self.kv_starts.tolist(), self.kv_lens.tolist(), strict=True)
        return [self.slots[a : a + n] for a, n in runs]

    def grown(self, new: torch.Tensor) -> SlotPlan:
        """The plan of the next decode step: each request's one query (q_offsets unchanged)
        also reads its new token's slot new[r] ((B,) int64), after its other keys. A table
        plan reads it from the table, where the step's allocation wrote it."""
        b = new.numel()
        assert self.q_offsets.numel() == b + 1, f"{self.q_offsets.numel() - 1} requests, {b} slots"
        if self.in_table:
            return dataclasses.replace(self, kv_lens=self.kv_lens + 1)
        old, dev = self.slots, self.slots.device
        kv_starts = self.kv_starts + torch.arange(b, device=dev)
        ends = kv_starts + self.kv_lens  # each request's last key: its new token's
        earlier = torch.ones(old.numel() + b, dtype=torch.bool, device=dev)
        earlier[ends] = False
        slots = torch.empty(old.numel() + b, dtype=old.dtype, device=dev)
        slots.masked_scatter_(earlier, old)
        slots[ends] = new.to(dev)
        return SlotPlan(slots, self.q_offsets, kv_starts, self.kv_lens + 1)


def slot_plan(slots: Sequence[torch.Tensor], q_lens: list[int], device: torch.device) -> SlotPlan:
    """Request r: keys slots[r] ((kv_len_r,) int64, position order), its queries the next
    q_lens[r] rows of q, bottom-right causal as `kernels.private_attention`."""
    cat = cat_slots(slots)
    kv_lens = torch.tensor([s.numel() for s in slots], dtype=torch.int64)
    kv_starts = kv_lens.cumsum(0) - kv_lens
    q_offsets = _offsets(q_lens, device)
    return SlotPlan(cat.to(device), q_offsets, kv_starts.to(device), kv_lens.to(device))


def table_plan(batch: ForwardBatch, starts: list[int]) -> SlotPlan | None:
    """Request r's keys from position starts[r] on, read in the request-to-token table: when
    the batch names its slots by table row (`TableRows`) and the kernels read a pool on the
    table's device in place; else None."""
    kv, pool_k = batch.kv_indices, batch.kv_pool.k[0]
    if not isinstance(kv, TableRows) or kv.table.device != pool_k.device:
        return None
    if not kernels.reads_pool_in_place(pool_k):
        return None
    first = torch.tensor(starts, dtype=torch.int64)
    lens = torch.tensor(kv.lens, dtype=torch.int64) - first
    kv_starts = kv.rows_tensor * kv.table.stride(0) + first
    q_offsets = _offsets(batch.extend_lens, pool_k.device)
    return SlotPlan(kv.table.view(-1), q_offsets, kv_starts, lens, in_table=True)


def _offsets(lens: list[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    return out.to(device)
