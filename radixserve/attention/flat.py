"""Flat attention: each request attends its whole KV path on its own (the baseline)."""

from __future__ import annotations

import torch

from radixserve import kernels
from radixserve.attention.base import AttentionBackend
from radixserve.engine.batch import ForwardBatch


class FlatBackend(AttentionBackend):
    name = "flat"

    def plan(self, batch: ForwardBatch) -> None:
        batch.attn_plan = torch.cat(batch.kv_indices)  # (sum seq_lens,) slots, request-major

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
        slots = batch.attn_plan
        assert isinstance(slots, torch.Tensor)
        # index_select, not k[slots]: the row gather is ~5x faster than advanced indexing on CPU.
        k_all = pool.k[layer].index_select(0, slots)  # (sum seq_lens, Hkv, D)
        v_all = pool.v[layer].index_select(0, slots)
        out, _ = kernels.private_attention(
            q, k_all, v_all, batch.extend_lens, batch.seq_lens, scale
        )
        return out
