"""A decode step of the same samples as the step before continues that step's batch
(`ForwardBatch.follows`): its inputs and its attention plan are updated, not built; when
samples leave, the step's batch is made from its samples' kept state. Each decode batch
here is checked against the batch and plan built entry by entry for the same step, on the
tree and the flat backend, with samples that share prefixes and finish at different steps
(the run is broken and starts again)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from helpers import keep_every_segment

from radixserve import Engine
from radixserve.attention.slots import SlotPlan
from radixserve.attention.tree import TreeBackend
from radixserve.attention.tree_plan import TreePlan
from radixserve.core.batch import BatchBuilder, ForwardBatch, TableRows


def built(batch: ForwardBatch) -> ForwardBatch:
    """The same step's batch made by BatchBuilder from its per-request lists."""
    entries = BatchBuilder()
    for r, slots in enumerate(batch.kv_indices):
        ids, pos = batch.input_ids[r : r + 1].tolist(), batch.positions[r : r + 1].tolist()
        entries.add(ids, pos, slots.clone(), batch.paths[r])
    return entries.build(batch.kv_pool)


def same_slot_plans(a: SlotPlan, b: SlotPlan) -> None:
    """The same keys per request; `a`, continued, read in the request-to-token table."""
    assert a.in_table, "a continued decode step's plan reads the table"
    assert torch.equal(a.q_offsets, b.q_offsets)
    assert len(a.keys()) == len(b.keys())
    assert all(torch.equal(x, y) for x, y in zip(a.keys(), b.keys(), strict=True))


def same_plans(a: object, b: object) -> None:
    if isinstance(a, SlotPlan):
        assert isinstance(b, SlotPlan)
        same_slot_plans(a, b)
        return
    assert isinstance(a, TreePlan) and isinstance(b, TreePlan), (type(a), type(b))
    assert [s.nodes for s in a.segments] == [s.nodes for s in b.segments]
    for sa, sb in zip(a.segments, b.segments, strict=True):
        assert torch.equal(sa.slots, sb.slots) and torch.equal(sa.q_rows, sb.q_rows)
        assert (sa.level, sa.requests) == (sb.level, sb.requests)
        assert torch.equal(sa.merge_rows, sb.merge_rows)
    assert (a.num_levels, a.num_merge_rows, a.in_place) == (
        b.num_levels,
        b.num_merge_rows,
        b.in_place,
    )
    assert isinstance(a.private, SlotPlan) and isinstance(b.private, SlotPlan)
    same_slot_plans(a.private, b.private)


@pytest.mark.parametrize("backend", ["tree", "flat"])
def test_continued_decode_steps_equal_built_ones(tiny_model_dir: Path, backend: str) -> None:
    engine = Engine(
        str(tiny_model_dir), dtype="float32", max_total_tokens=4096, attention_backend=backend
    )
    sched = engine.scheduler
    worker_backend = sched.worker.backend
    plan = worker_backend.plan
    continued: list[int] = []
    made: list[int] = []
    shared: list[tuple[int, int]] = []  # (samples, kept segments) of continued tree plans

    def checked_plan(batch: ForwardBatch) -> None:
        plan(batch)
        if not isinstance(batch.kv_indices, TableRows):  # a prefill: built entry by entry
            return
        if batch.follows is None:  # a decode step made from its samples
            made.append(batch.num_requests)
        else:
            continued.append(batch.num_requests)
        fresh = built(batch)
        for name in ("input_ids", "positions", "out_cache_loc"):
            assert torch.equal(getattr(batch, name), getattr(fresh, name)), name
        assert batch.seq_lens == fresh.seq_lens and batch.extend_lens == fresh.extend_lens
        assert all(torch.equal(x, y) for x, y in zip(batch.kv_indices, fresh.kv_indices))
        fresh.follows = None
        plan(fresh)
        same_plans(batch.attn_plan, fresh.attn_plan)
        if isinstance(batch.attn_plan, TreePlan):
            shared.append((batch.num_requests, len(batch.attn_plan.segments)))

    worker_backend.plan = checked_plan  # type: ignore[method-assign]
    system = list(range(300, 400))  # long enough that the tree backend keeps it shared
    prompts = [system + [1000 + i, 2000 + i] for i in range(6)]
    params = [{"temperature": 0, "max_new_tokens": 6 + 3 * i, "ignore_eos": True} for i in range(6)]
    with contextlib.ExitStack() as stack:
        if isinstance(worker_backend, TreeBackend):
            stack.enter_context(keep_every_segment(worker_backend))
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert isinstance(outs, list)
    assert [len(o["output_ids"]) for o in outs] == [6 + 3 * i for i in range(6)]
    # six samples for 5 steps, then one fewer every 3 steps: runs of each size, each run's
    # first step made from its samples
    assert max(continued) == 6 and min(continued) == 1, continued
    assert made == [6, 5, 4, 3, 2, 1], made
    if backend == "tree":
        # the system prompt, read once for all the samples
        assert shared and all(kept >= 1 for n, kept in shared if n >= 2), shared
