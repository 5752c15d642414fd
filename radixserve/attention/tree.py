"""Tree attention: K/V shared by several requests of a step is attended once for all of them.

How a step's plan is made: attention/tree_plan.py.

Per layer: write the new K/V, ONE private_attention call for the whole batch, one
segment_attention per kept segment (queries of all its requests stacked, K/V read once), then
one merge_states over the rows that have any shared part. With kernels that read the pool in
place (`kernels.reads_pool_in_place`) segments and private parts are passed as slot lists
into the pool and the merge is fused: segments run in plan order, each starting from its
rows' running (out, lse) state (the pool ops' `prior`), and the private part last, from the
state of all of them; no merge buffer, no merge pass. Otherwise a segment whose slots are
not one range is gathered first. Attention sinks apply once, to each row's merged (out, lse)
(attention/base.py `with_sinks`), never to a part.
"""

from __future__ import annotations

import dataclasses

import torch

from radixserve import kernels
from radixserve.attention.base import AttentionBackend, with_sinks
from radixserve.attention.slots import SlotPlan
from radixserve.attention.tree_plan import SharedSegment, TreePlan, build_plan
from radixserve.attention.window import slides, sliding_attention, windowed
from radixserve.core.batch import ForwardBatch


class TreeBackend(AttentionBackend):
    """Hydragen-style attention over the radix tree (see module docstring).

    `plan(batch)` sets `batch.attn_plan` to a TreePlan and touches no K/V. `forward` writes the
    new K/V at `batch.out_cache_loc` of `layer` (mutates the pool), then reads only slots of
    the batch's kv_indices. Raises AssertionError when the paths are not consistent with
    kv_indices (a node with two lengths or two sets of slots, a path past prefix_len).
    """

    name = "tree"

    def __init__(
        self,
        min_requests: int = 2,
        min_tokens: int = 768,
        min_reads: int = 8192,
        min_tokens_extend: int = 4096,
    ) -> None:
        assert min_requests >= 2, f"a shared segment needs >= 2 requests, got {min_requests}"
        assert min(min_tokens, min_reads, min_tokens_extend) >= 1, (
            f"thresholds must be >= 1: {min_tokens=}, {min_reads=}, {min_tokens_extend=}"
        )
        self.min_requests = min_requests
        self.min_tokens = min_tokens
        self.min_reads = min_reads
        self.min_tokens_extend = min_tokens_extend

    def __repr__(self) -> str:
        return (
            f"TreeBackend(min_requests={self.min_requests}, min_tokens={self.min_tokens}, "
            f"min_reads={self.min_reads}, min_tokens_extend={self.min_tokens_extend})"
        )

    def keeps(self, num_requests: int, num_tokens: int, max_q_len: int) -> bool:
        """Whether a shared segment of `num_tokens` tokens under `num_requests` requests whose
        longest query block is `max_q_len` rows is attended on its own (else it folds).

        Defaults from `benchmarks/bench_backend.py --sweep` (native kernels, 2 threads, R = 128
        private tokens; kept/folded per-layer time, < 1 pays; docs/benchmarks.md). Folding a
        segment reads it once per request, but those re-reads come from the last-level cache,
        and the flat decode kernel runs near the read bandwidth, so keeping pays only for long
        segments. Decode: L >= 768 and k * L >= 8192. AVX2 EPYC Zen 3, float32 queries, fp16
        K/V, SmolLM2 heads (2026-11-26): k=2: L 4096 -> 0.99-1.03, 2048 -> 1.04-1.08; k=4:
        1024 -> 0.95-1.00; k=8: 1024 -> 0.92-0.95, 512 -> 1.37-1.39. Zen 5, bf16 queries, fp16
        K/V (2026-11-27), SmolLM2 and Llama-3.2-1B heads (2.7x the K/V bytes per token): k=4
        and 8 pay from L = 1024 in both (0.87-0.91) and 512 costs 1.38-1.43 in both, so the
        rule is in tokens, not K/V bytes. Zen 4, float32 queries, bf16 K/V (2026-12-05),
        k=16, L=768: 0.79-0.90 for SmolLM2, 1B and Gemma-3-4B heads (512: 0.84 / 0.82 /
        1.20); k=8, L=768: 0.92-1.17. A sliding layer's shared part is under its window
        (Gemma 3: < 1024), so 768 is what lets it pay there. Extends (q_len 8, Zen 3): only
        L = 4096 paid across k (0.90-0.98; k=2: 1.02; L = 2048: 0.96-1.09). A GPU wants its
        own measurement.
        """
        floor = self.min_tokens_extend if max_q_len > 1 else self.min_tokens
        return (
            num_requests >= self.min_requests
            and num_tokens >= floor
            and num_requests * num_tokens >= self.min_reads
        )

    def plan(self, batch: ForwardBatch) -> None:
        before = None if batch.follows is None else batch.follows.attn_plan
        if isinstance(before, TreePlan) and isinstance(before.private, SlotPlan):
            # the same paths: the same segments; each private part one key longer
            private = before.private.grown(batch.out_cache_loc)
            batch.attn_plan = dataclasses.replace(before, private=private)
            return
        batch.attn_plan = build_plan(batch, self.keeps)

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
        plan, new = batch.attn_plan, batch.out_cache_loc
        if window and slides(batch, window):
            if not batch.is_decode:
                return sliding_attention(q, k, v, layer, batch, window, scale, softcap, sinks)
            plan = batch.window_plans.get(window)
            if plan is None:
                step = windowed(batch, window)
                plan = batch.window_plans[window] = build_plan(step, self.keeps)
            new = batch.sliding_out_loc
        assert isinstance(plan, TreePlan), f"plan() not run for this batch: {type(plan)}"
        pool = batch.kv_pool
        # Write first: an extend's queries must see their own (and earlier) new keys.
        pool.write(layer, new, k, v)
        kc, vc = pool.k[layer], pool.v[layer]  # (num_slots, Hkv, D)
        if plan.in_place:
            out, lse = _fused_in_place(plan, q, kc, vc, scale, softcap)
        else:
            out, lse = plan.private.attend(q, kc, vc, scale, softcap=softcap)  # (T, Hq, D), (T, Hq)
            if plan.segments:
                out, lse = _merge_shared(plan, q, kc, vc, out, lse, scale, softcap)
        return with_sinks(out, lse, sinks)


def _fused_in_place(
    plan: TreePlan,
    q: torch.Tensor,  # (T, Hq, D)
    kc: torch.Tensor,  # (num_slots, Hkv, D) one layer's keys
    vc: torch.Tensor,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segments in plan order, each merged into its rows' running state by the kernel, then
    the private part from the full state -> out (T, Hq, D), lse (T, Hq)."""
    assert isinstance(plan.private, SlotPlan), f"in-place plan with {type(plan.private)}"
    state: tuple[torch.Tensor, torch.Tensor] | None = None  # (T, Hq, D), (T, Hq) float32
    for seg in plan.segments:
        everyone = seg.q_range == (0, q.shape[0])
        if state is None and everyone:
            state = kernels.pool_segment_attention(q, kc, vc, seg.slots, scale, softcap=softcap)
            continue
        if state is None:  # rows without a shared part yet: empty state (lse -inf)
            state = (
                q.new_zeros(q.shape),
                q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32),
            )
        state = _segment_into(state, seg, q, kc, vc, scale, softcap)
    return plan.private.attend(q, kc, vc, scale, prior=state, softcap=softcap)


def _segment_into(
    state: tuple[torch.Tensor, torch.Tensor],
    seg: SharedSegment,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment's rows of `state` merged with its attention (in place in `state`)."""
    out, lse = state
    if seg.q_range:
        rows = slice(*seg.q_range)
        o, s = kernels.pool_segment_attention(
            q[rows], kc, vc, seg.slots, scale, prior=(out[rows], lse[rows]), softcap=softcap
        )
        out[rows], lse[rows] = o, s
        return out, lse
    prior = out.index_select(0, seg.q_rows), lse.index_select(0, seg.q_rows)
    qs = q.index_select(0, seg.q_rows)
    o, s = kernels.pool_segment_attention(qs, kc, vc, seg.slots, scale, prior, softcap)
    return out.index_copy_(0, seg.q_rows, o), lse.index_copy_(0, seg.q_rows, s)


def _segment(
    plan: TreePlan,
    seg: SharedSegment,
    qs: torch.Tensor,  # (n, Hq, D) the queries of the segment's requests
    kc: torch.Tensor,  # (num_slots, Hkv, D) one layer's keys
    vc: torch.Tensor,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kept segment's attention (gathering kernels): as a slice view, or gathered."""
    if seg.kv_range:
        ks, vs = kc[seg.kv_range[0] : seg.kv_range[1]], vc[seg.kv_range[0] : seg.kv_range[1]]
    else:
        ks, vs = kc.index_select(0, seg.slots), vc.index_select(0, seg.slots)  # (L, Hkv, D)
    return kernels.segment_attention(qs, ks, vs, scale, softcap)


def _merge_shared(
    plan: TreePlan,
    q: torch.Tensor,  # (T, Hq, D)
    kc: torch.Tensor,  # (num_slots, Hkv, D) one layer's keys
    vc: torch.Tensor,
    out: torch.Tensor,  # (T, Hq, D) private part's output
    lse: torch.Tensor,  # (T, Hq) float32
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attend every kept segment once and merge it with the private part, row by row ->
    out (T, Hq, D), lse (T, Hq) over all of each row's keys."""
    rows = plan.merge_rows
    m, hq, d = plan.num_merge_rows, q.shape[1], q.shape[2]
    # Part 0 is the private part; part level + 1 a shared segment; lse -inf = "no such part".
    outs = q.new_zeros((plan.num_levels + 1, m, hq, d))  # (N, M, Hq, D)
    lses = torch.full((plan.num_levels + 1, m, hq), float("-inf"), device=q.device)
    outs[0] = out if rows is None else out.index_select(0, rows)
    lses[0] = lse if rows is None else lse.index_select(0, rows)
    for seg in plan.segments:
        if seg.q_range:
            qs = q[seg.q_range[0] : seg.q_range[1]]  # (n, Hq, D) view
        else:
            qs = q.index_select(0, seg.q_rows)
        o, s = _segment(plan, seg, qs, kc, vc, scale, softcap)  # (n, Hq, D), (n, Hq)
        part_o, part_s = outs[seg.level + 1], lses[seg.level + 1]  # (M, Hq, D), (M, Hq) views
        if seg.merge_range:
            part_o[seg.merge_range[0] : seg.merge_range[1]] = o
            part_s[seg.merge_range[0] : seg.merge_range[1]] = s
        else:
            part_o.index_copy_(0, seg.merge_rows, o)
            part_s.index_copy_(0, seg.merge_rows, s)
    merged, merged_lse = kernels.merge_states(outs, lses)  # (M, Hq, D), (M, Hq)
    if rows is None:
        return merged, merged_lse
    # `out` and `lse` are this step's fresh private results: the merged rows replace theirs.
    return out.index_copy_(0, rows, merged), lse.index_copy_(0, rows, merged_lse)
