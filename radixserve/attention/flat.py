"""Flat attention: each request attends its whole KV path on its own (the baseline).

Both backends read each request's *private* keys (flat: all of them) through a plan built
once per step by `private_plan`:
- `SlotPlan` (kernels that read the pool in place, `kernels.reads_pool_in_place`: the
  native CPU and the Triton kernels): each layer passes the pool tensors and the step's
  slot list to ONE `kernels.pool_private_attention` call; nothing is gathered, no scratch.
  A batch whose slots are rows of the request-to-token table (decode steps) passes the
  table itself, with each request's row and length (`table_plan`): nothing is copied per
  step.
- `PaddedPlan` (decode steps, other kernels): each layer gathers every request's keys
  straight from the pool into one padded (B, L) grid and makes ONE
  `kernels.decode_attention` call.
- `GatherPlan` (extends, or decode lengths too uneven to pad): each layer gathers the keys
  concatenated and calls `kernels.private_attention` (one kernel call per run of equal
  lengths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixserve import kernels
from radixserve.attention.base import AttentionBackend, with_sinks
from radixserve.attention.slots import SlotPlan, slot_plan, table_plan
from radixserve.attention.window import slides, sliding_attention
from radixserve.core.batch import ForwardBatch, cat_slots

# Decode steps use the padded grid while its cells are at most this many times the real keys
# (`benchmarks/bench_backend.py --pad-sweep`; numbers in docs/benchmarks.md).
PAD_MAX_WASTE = 2.0


@dataclass(frozen=True)
class GatherPlan:
    """Slots to gather per layer, and the step's scratch rows to gather them into.

    The scratch is reused by every layer of the step: allocating a fresh (S, Hkv, D) copy per
    layer made the kernel fault in new pages each time (measured 10x slower at S = 135k)."""

    slots: torch.Tensor  # (S,) int64, requests concatenated
    q_lens: list[int]
    kv_lens: list[int]  # per request; sum == S
    k_buf: torch.Tensor  # (S, Hkv, D), pool dtype; contents only valid inside one forward
    v_buf: torch.Tensor

    def attend(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float,
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """q (T, Hq, D) against one layer's pool k/v (num_slots, Hkv, D) -> (T, Hq, D), (T, Hq).

        index_select, not kc[slots]: the row gather is ~5x faster than advanced indexing."""
        torch.index_select(kc, 0, self.slots, out=self.k_buf)
        torch.index_select(vc, 0, self.slots, out=self.v_buf)
        return kernels.private_attention(
            q, self.k_buf, self.v_buf, self.q_lens, self.kv_lens, scale, softcap
        )


@dataclass(frozen=True)
class PaddedPlan:
    """Decode: request b's keys are row b of a (B, L) grid of pool slots; padding points at
    the pool's scratch slot 0 and is masked by the kernel."""

    grid: torch.Tensor  # (B * L,) int64 slots, row-major
    kv_lens: list[int]
    k_buf: torch.Tensor  # (B, L, Hkv, D) scratch, reused by every layer of the step
    v_buf: torch.Tensor

    def attend(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, scale: float,
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """q (B, Hq, D) against one layer's pool k/v (num_slots, Hkv, D) -> (B, Hq, D), (B, Hq)."""
        torch.index_select(kc, 0, self.grid, out=self.k_buf.view(-1, *kc.shape[1:]))
        torch.index_select(vc, 0, self.grid, out=self.v_buf.view(-1, *vc.shape[1:]))
        return kernels.decode_attention(q, self.k_buf, self.v_buf, self.kv_lens, scale, softcap)


PrivatePlan = GatherPlan | PaddedPlan | SlotPlan


def private_plan(
    slots: Sequence[torch.Tensor],
    q_lens: list[int],
    pool_k: torch.Tensor,
    pad_max_waste: float = PAD_MAX_WASTE,
) -> PrivatePlan:
    """How each layer of a step reads the requests' private keys.

    slots[r]: (kv_len_r,) int64 pool slots of request r's private keys in position order,
    its q_lens[r] queries being the last of them; pool_k: one layer's pool keys (shape,
    dtype and device of the scratch buffers). Kernels that read the pool in place get a
    SlotPlan; otherwise decode steps pad while the grid has at most `pad_max_waste` cells per
    real key (0: never) and everything else gathers concatenated."""
    kv_lens = [s.numel() for s in slots]
    dev, dt, row = pool_k.device, pool_k.dtype, pool_k.shape[1:]
    if kernels.reads_pool_in_place(pool_k):
        return slot_plan(slots, q_lens, dev)
    longest = max(kv_lens, default=0)
    if all(n == 1 for n in q_lens) and len(slots) * longest <= pad_max_waste * sum(kv_lens):
        grid = torch.nn.utils.rnn.pad_sequence(list(slots), batch_first=True, padding_value=0)
        shape = (len(slots), longest, *row)
        return PaddedPlan(
            grid.flatten().to(dev),
            kv_lens,
            torch.empty(shape, dtype=dt, device=dev),
            torch.empty(shape, dtype=dt, device=dev),
        )
    cat = cat_slots(slots).to(dev)
    shape = (cat.numel(), *row)
    return GatherPlan(
        cat,
        list(q_lens),
        kv_lens,
        torch.empty(shape, dtype=dt, device=dev),
        torch.empty(shape, dtype=dt, device=dev),
    )


class FlatBackend(AttentionBackend):
    """Per request, one attention over its whole sequence; shared prefixes are read once per
    request. `forward` mutates the pool (the new K/V) and the plan's scratch buffers."""

    name = "flat"

    def __init__(self, pad_max_waste: float = PAD_MAX_WASTE) -> None:
        self.pad_max_waste = pad_max_waste

    def plan(self, batch: ForwardBatch) -> None:
        before = None if batch.follows is None else batch.follows.attn_plan
        if isinstance(before, SlotPlan):  # the step before's, one key longer per request
            batch.attn_plan = before.grown(batch.out_cache_loc)
            return
        in_table = table_plan(batch, [0] * batch.num_requests)
        batch.attn_plan = in_table or private_plan(
            batch.kv_indices, batch.extend_lens, batch.kv_pool.k[0], self.pad_max_waste
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if window and slides(batch, window):
            return sliding_attention(q, k, v, layer, batch, window, scale, softcap, sinks)
        pool = batch.kv_pool
        pool.write(layer, batch.out_cache_loc, k, v)
        plan = batch.attn_plan
        assert isinstance(plan, PrivatePlan), f"plan() not run for this batch: {type(plan)}"
        out, lse = plan.attend(q, pool.k[layer], pool.v[layer], scale, softcap=softcap)
        return with_sinks(out, lse, sinks)
