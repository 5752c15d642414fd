"""Flat attention: each request attends its whole KV path on its own (the baseline)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve import kernels
from radixserve.attention.base import AttentionBackend
from radixserve.engine.batch import ForwardBatch


@dataclass(frozen=True)
class GatherPlan:
    """Slots to gather per layer, and the step's scratch rows to gather them into.

    The scratch is reused by every layer of the step: allocating a fresh (S, Hkv, D) copy per
    layer made the kernel fault in new pages each time (measured 10x slower at S = 135k)."""

    slots: torch.Tensor  # (S,) int64
    k_buf: torch.Tensor  # (S, Hkv, D), pool dtype; contents only valid inside one forward
    v_buf: torch.Tensor

    @staticmethod
    def make(slots: torch.Tensor, pool_k: torch.Tensor) -> GatherPlan:
        shape = (slots.numel(), *pool_k.shape[1:])
        dev, dt = pool_k.device, pool_k.dtype
        slots = slots.to(dev)
        return GatherPlan(
            slots,
            torch.empty(shape, dtype=dt, device=dev),
            torch.empty(shape, dtype=dt, device=dev),
        )

    def gather(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `slots` of one layer's k/v (num_slots, Hkv, D) -> the scratch (S, Hkv, D).

        index_select, not k[slots]: the row gather is ~5x faster than advanced indexing."""
        torch.index_select(k, 0, self.slots, out=self.k_buf)
        torch.index_select(v, 0, self.slots, out=self.v_buf)
        return self.k_buf, self.v_buf


class FlatBackend(AttentionBackend):
    """Per request, one attention over its whole sequence; shared prefixes are read once per
    request. `forward` mutates the pool (the new K/V) and the plan's scratch buffers."""

    name = "flat"

    def plan(self, batch: ForwardBatch) -> None:
        slots = torch.cat(batch.kv_indices)  # (sum seq_lens,) request-major
        batch.attn_plan = GatherPlan.make(slots, batch.kv_pool.k[0])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        pool = batch.kv_pool
        pool.write(layer, batch.out_cache_loc, k, v)
        plan = batch.attn_plan
        assert isinstance(plan, GatherPlan), f"plan() not run for this batch: {type(plan)}"
        k_all, v_all = plan.gather(pool.k[layer], pool.v[layer])  # (sum seq_lens, Hkv, D)
        out, _ = kernels.private_attention(
            q, k_all, v_all, batch.extend_lens, batch.seq_lens, scale
        )
        return out
