"""Decode steps from fixed buffers, padded to a bucket of batch sizes.

A captured CUDA graph replays the same kernels on the same addresses: every tensor a decode
step reads must live in a buffer made once, and the batch size must be one of a few. So a
decode step of B requests (B <= the largest bucket) runs as a step of N rows, N the
smallest bucket >= B, from that bucket's buffers:

    input_ids, positions, out_cache_loc    (N,) int64: rows 0..B-1 the step's, then padding
    kv_starts, kv_lens                     (N,) int64: each row's keys in `slots`
    q_offsets                              (N + 1,) arange: one query per row
    slots                                  the request-to-token table, flat: the table
                                           itself where it is on the model's device, else
                                           a copy of the rows read, row b in row b

Each buffer is made once for the largest bucket; a bucket of N rows reads its first N.

A padding row is token 0 at position 0, writes its K/V to the pool's scratch slot 0 and
reads that one key through the table's last row, which no request is given (all slot 0:
kvcache/pool.py ReqToTokenPool). Its output is computed and never read: the logits rows of
a step are rows 0..B-1. Every row's attention reads only its own keys, and no layer mixes
rows, so the real rows' results are those of the unpadded step (up to how a matmul of N
rows sums; greedy tokens the same, tested).

A step fits when it decodes (one query per request) on the table's rows, reads the pool in
place, and its plan is private keys only (flat attention, or tree attention that keeps no
shared segment this step); a pool with sliding-window rows never does. Other steps run as
they are.

Capturing and replaying the graph is not done here (no GPU has run this): the buckets are
what capture needs, and on a CPU they only add the padding rows' work, so they are off by
default (`EngineConfig.decode_buckets`).
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from radixserve import kernels
from radixserve.attention.slots import SlotPlan
from radixserve.attention.tree_plan import TreePlan
from radixserve.core.batch import ForwardBatch, TableRows

BUCKET_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


class DecodeBuckets:
    """Buffers for steps of up to `max_batch` rows on `device`; a bucket of N rows reads
    their first N entries, so every bucket's tensors keep their addresses from step to step.
    `copy_table`: the request-to-token table is not on `device` (a GPU's, the scheduler's
    table on the host), so the rows a step reads are copied to the device."""

    def __init__(self, max_batch: int, device: torch.device, copy_table: bool) -> None:
        assert max_batch >= 1, f"max_batch {max_batch}"
        self.sizes = [n for n in BUCKET_SIZES if n < max_batch] + [max_batch]
        self.device, self.copy_table = device, copy_table

        def zeros() -> torch.Tensor:
            return torch.zeros(max_batch, dtype=torch.int64, device=device)

        self.input_ids, self.positions, self.out_cache_loc = zeros(), zeros(), zeros()
        self.kv_starts, self.kv_lens = zeros(), zeros()
        self.q_offsets = torch.arange(max_batch + 1, device=device)
        self.table_copy: torch.Tensor | None = None  # (max_batch, width): rows read, copied

    def bucket(self, b: int) -> int | None:
        """The bucket size a step of b rows pads to; None when b is over the largest."""
        i = bisect.bisect_left(self.sizes, b)
        return self.sizes[i] if i < len(self.sizes) else None

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether the step, planned, runs from a bucket (module docstring)."""
        kv = batch.kv_indices
        if not isinstance(kv, TableRows) or batch.swa_kv_indices is not None:
            return False
        if not batch.is_decode or self.bucket(batch.num_requests) is None:
            return False
        if not kernels.reads_pool_in_place(batch.kv_pool.k[0]):
            return False
        plan = batch.attn_plan
        if isinstance(plan, TreePlan):
            return not plan.segments and isinstance(plan.private, SlotPlan)
        return isinstance(plan, SlotPlan)

    def pad(self, batch: ForwardBatch) -> ForwardBatch:
        """The step as its bucket's N rows, the batch's first, then padding; its attention
        plan reads the bucket's buffers. Call only for a step that `fits`."""
        kv = batch.kv_indices
        assert isinstance(kv, TableRows), "a step that fits names its slots by table row"
        b, n = batch.num_requests, self.bucket(batch.num_requests)
        assert n is not None, f"{b} rows: over the largest bucket {self.sizes[-1]}"
        table, pad_row = kv.table, kv.table.shape[0] - 1
        _fill(self.input_ids[:n], batch.input_ids, 0)
        _fill(self.positions[:n], batch.positions, 0)
        _fill(self.out_cache_loc[:n], batch.out_cache_loc, 0)
        _fill(self.kv_lens[:n], torch.tensor(kv.lens, dtype=torch.int64), 1)
        rows = torch.full((n,), pad_row, dtype=torch.int64)
        rows[:b] = kv.rows_tensor
        if not self.copy_table:  # read the table in place
            self.kv_starts[:n].copy_(rows * table.stride(0))
            slots = table.view(-1)
        else:  # each row read, up to the longest run, into the copy's row b
            if self.table_copy is None or self.table_copy.shape[1] != table.shape[1]:
                shape = (self.kv_starts.numel(), table.shape[1])
                self.table_copy = torch.zeros(shape, dtype=torch.int64, device=self.device)
            longest = max(kv.lens)
            self.table_copy[:n, :longest].copy_(table[rows, :longest], non_blocking=True)
            self.kv_starts[:n].copy_(self.q_offsets[:n] * table.shape[1])
            slots = self.table_copy.view(-1)
        plan = SlotPlan(slots, self.q_offsets[: n + 1], self.kv_starts[:n], self.kv_lens[:n], True)
        before = batch.attn_plan
        attn_plan = (
            dataclasses.replace(before, private=plan) if isinstance(before, TreePlan) else plan
        )
        pads = n - b
        lens = [*kv.lens, *[1] * pads]
        return ForwardBatch(
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            out_cache_loc=self.out_cache_loc[:n],
            seq_lens=lens,
            extend_lens=[1] * n,
            kv_indices=TableRows(table, [*kv.rows, *[pad_row] * pads], lens, rows),
            paths=[*batch.paths, *[[]] * pads],
            kv_pool=batch.kv_pool,
            attn_plan=attn_plan,
        )


def _fill(buf: torch.Tensor, values: torch.Tensor, pad: int) -> None:
    """buf[:len(values)] = values, the rest `pad`, in place."""
    b = values.numel()
    buf[:b].copy_(values, non_blocking=True)
    buf[b:].fill_(pad)
