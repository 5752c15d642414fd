"""Sliding-window attention from the causal kernels: a layer whose queries see only the last
`window` positions (themselves included), exact, in at most two pool-kernel calls.

A query at position p sees keys at positions [p - W + 1, p] (W = window), as transformers'
sliding mask. The kernels know only bottom-right causal blocks, so each request's queries
(positions p0 .. L - 1, L = its sequence length) are cut into blocks they can run exactly:

    head   the queries at positions < W: one causal block over keys [0, min(L, W));
    chunk  C <= W queries [a, a + C), a >= W: row a + i needs keys [a + i - W + 1, a + i]
           recent: keys [a + C - W, a + C), bottom-right causal: row a + i sees
                   [a + C - W, a + i] (all of row a + C - 1's window);
           old:    rows a .. a + C - 2 also need keys [a + i - W + 1, a + C - W), the last
                   C - 1 - i of the C - 1 keys [a - W + 1, a + C - W): with both the rows
                   and the keys in reverse order, a square causal block.

The recent blocks cover every query row once, in row order (one `pool_private_attention`
call); the old blocks (gathered rows, reversed) run first, and their (out, lse) enters the
recent call as its `prior`, merged exactly by log-sum-exp. These blocks read no shared
segment: each request reads only its own window.

A decode step's one query per request sees the last W keys, all of them, so the tree
backend attends shared K/V inside every member's window once for all (`windowed`: the step
as the layer sees it, each sequence cut to its window); a shared prefix older than the
window is never read by the layer.

Where the pool keeps sliding layers' rows apart (`ForwardBatch.swa_kv_indices`), every
step of a sliding layer runs over those rows; else a step whose sequences all fit in the
window attends as a full layer does (`slides`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import with_sinks
from radixserve.attention.slots import SlotPlan, slot_plan
from radixserve.core.batch import ForwardBatch


@dataclass(frozen=True)
class WindowPlan:
    recent: SlotPlan  # over q's rows in order
    old_rows: torch.Tensor  # (n,) int64 rows of q, reversed within each chunk
    old: SlotPlan | None  # over q[old_rows]; None when no chunk has old keys


class _Blocks:
    """Causal blocks being collected: each its key slots and its number of queries."""

    def __init__(self) -> None:
        self.slots: list[torch.Tensor] = []
        self.q_lens: list[int] = []

    def add(self, slots: torch.Tensor, q_len: int) -> None:
        self.slots.append(slots)
        self.q_lens.append(q_len)


def slides(batch: ForwardBatch, window: int) -> bool:
    """Whether a layer with this window runs the step as a sliding layer: over its own rows,
    or because some query's window leaves out a key. Else it attends as a full layer."""
    return batch.swa_kv_indices is not None or max(batch.seq_lens, default=0) > window


def windowed(batch: ForwardBatch, w: int) -> ForwardBatch:
    """A decode step as a layer with window `w` sees it: each request's keys are the last `w`
    positions of its sequence, in the layer's rows (the pool's sliding rows, or the slots),
    and its path keeps the nodes inside them; a node the window starts inside becomes the
    part of it inside, named by (node, where the window cuts it), so members cut alike still
    share it. Plan it as any step (attention/tree_plan.py); nothing is copied from the pool."""
    assert batch.is_decode, f"windowed steps are decode steps: {batch.extend_lens}"
    seqs = batch.kv_indices if batch.swa_kv_indices is None else batch.swa_kv_indices
    ids: dict[tuple[int, int], int] = {}
    paths: list[list[tuple[int, int]]] = []
    for path, length in zip(batch.paths, batch.seq_lens, strict=True):
        lo, pos, cut = max(0, length - w), 0, []
        for node, n in path:
            skip = min(n, max(0, lo - pos))  # the node's tokens before the window
            if skip < n:
                cut.append((ids.setdefault((node, skip), len(ids)), n - skip))
            pos += n
        paths.append(cut)
    return ForwardBatch(
        input_ids=batch.input_ids,
        positions=batch.positions,
        out_cache_loc=batch.sliding_out_loc,
        seq_lens=[min(length, w) for length in batch.seq_lens],
        extend_lens=batch.extend_lens,
        kv_indices=[s[max(0, s.numel() - w) :] for s in seqs],
        paths=paths,
        kv_pool=batch.kv_pool,
    )


def sliding_attention(
    q: torch.Tensor,  # (T, Hq, D)
    k: torch.Tensor,  # (T, Hkv, D) the new tokens'
    v: torch.Tensor,
    layer: int,
    batch: ForwardBatch,
    window: int,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A sliding layer's step (`slides`): write the new K/V and attend each query's window,
    request by request -> (T, Hq, D) (sinks, if any, applied to the merged window)."""
    pool = batch.kv_pool
    pool.write(layer, batch.sliding_out_loc, k, v)
    plan = batch.window_plans.get(window)
    if plan is None:
        plan = batch.window_plans[window] = _plan(batch, window)
    assert isinstance(plan, WindowPlan), type(plan)
    out, lse = window_attention(plan, q, pool.k[layer], pool.v[layer], scale, softcap)
    return with_sinks(out, lse, sinks)


def _plan(batch: ForwardBatch, w: int) -> WindowPlan:
    """Blocks over the sliding rows (or the slots) of every request (module docstring)."""
    recent, old = _Blocks(), _Blocks()
    old_rows: list[torch.Tensor] = []
    row = 0  # the first query row of the current request
    seqs = batch.kv_indices if batch.swa_kv_indices is None else batch.swa_kv_indices
    for kv, q_len in zip(seqs, batch.extend_lens, strict=True):
        length = kv.numel()
        p0 = length - q_len  # the first query's position
        head = max(0, min(w, length) - p0)
        if head:
            recent.add(kv[: min(w, length)], head)
        for a in range(p0 + head, length, w):
            c = min(w, length - a)
            recent.add(kv[a + c - w : a + c], c)
            if c > 1:
                old.add(kv[a - w + 1 : a + c - w].flip(0), c - 1)
                first = row + a - p0  # row of position a
                old_rows.append(torch.arange(first + c - 2, first - 1, -1))
        row += q_len
    device = batch.kv_pool.k[0].device
    rows = torch.cat(old_rows).to(device) if old_rows else torch.zeros(0, dtype=torch.int64)
    old_plan = slot_plan(old.slots, old.q_lens, device) if old_rows else None
    return WindowPlan(slot_plan(recent.slots, recent.q_lens, device), rows, old_plan)


def window_attention(
    plan: WindowPlan,
    q: torch.Tensor,  # (T, Hq, D)
    kc: torch.Tensor,  # (num_slots, Hkv, D) one layer's pool keys
    vc: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row over its window's keys -> out (T, Hq, D), lse (T, Hq) float32."""
    prior = None
    if plan.old is not None:
        qs = q.index_select(0, plan.old_rows)
        o, lse = plan.old.attend(qs, kc, vc, scale, softcap=softcap)
        out = q.new_zeros(q.shape)  # rows without old keys: an empty state (lse -inf)
        lses = q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32)
        prior = out.index_copy_(0, plan.old_rows, o), lses.index_copy_(0, plan.old_rows, lse)
    return plan.recent.attend(q, kc, vc, scale, prior, softcap)
