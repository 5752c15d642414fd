"""Tree attention: shared radix segments are attended once for all requests under them.

Plan (host side, once per step; see DESIGN.md "Tree attention"):

    request r:  |<-------------------------- seq_lens[r] -------------------------->|
                |<-- seg 0 -->|<- folded ->|<-- seg 1 -->|<- private tail + new ->|
                 shared by      shared but   shared by       only r's; the last
                 {r, s, u}      too small    {r, s}          extend_lens[r] are queries

1. Every radix node on the paths of >= 2 requests is a candidate. A node shared by k
   requests has ancestors shared by >= k, so along a path the request sets only shrink and
   candidates form a prefix of the path; consecutive nodes with the SAME request set merge
   into one segment (one slot tensor).
2. A segment folds back into its requests' private parts unless `TreeBackend.keeps` it:
   the extra segment call and merge cost a roughly fixed time per segment plus a time per
   query row, which only the saved re-reads of its K/V ((k - 1) * L rows) can pay back.
3. A request's private part is every position of kv_indices[r] not in a kept segment, in
   position order. Folding can make it non-contiguous, but all of it precedes or is the
   query block, and the queries are its last extend_lens[r] entries, so the bottom-right
   causal alignment of `private_attention` stays exact.
4. Each kept segment gets a `level`: its index among the kept segments on a member's path.
   All members agree (they share every ancestor node), so level + 1 is the segment's slot in
   the merge buffer and slot 0 holds the private part.

Per layer: write the new K/V, ONE private_attention call for the whole batch, one
segment_attention per kept segment (queries of all its requests stacked, K/V read once), then
one merge_states over the rows that have any shared part. With kernels that read the pool in
place (`kernels.reads_pool_in_place`) segments and private parts are passed as slot lists
into the pool and the merge is fused: segments run ancestors first, each starting from its
rows' running (out, lse) state (the pool ops' `prior`), and the private part last, from the
state of all of them; no merge buffer, no merge pass. Otherwise a segment whose slots are
not one range is gathered first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve import kernels
from radixserve.attention.base import AttentionBackend
from radixserve.attention.flat import PrivatePlan, SlotPlan, private_plan
from radixserve.core.batch import ForwardBatch

Range = tuple[int, int]  # half-open [start, end)


@dataclass(frozen=True)
class SharedSegment:
    """One kept shared segment of a step's plan."""

    requests: tuple[int, ...]  # batch indices of its requests, ascending, len >= 2
    start: int  # first position it covers on every member's sequence
    num_tokens: int
    slots: torch.Tensor  # (num_tokens,) int64 KV slots
    kv_range: Range | None  # set when slots == arange(*kv_range): read a slice view, no gather
    q_rows: torch.Tensor  # (n,) int64 rows of the members' queries in the flat (T,) layout
    q_range: Range | None  # set when q_rows is one ascending run
    level: int  # index among the kept segments on each member's path (0 = nearest the root)
    merge_rows: torch.Tensor  # (n,) int64 rows of these queries in the merge buffer
    merge_range: Range | None


@dataclass(frozen=True)
class TreePlan:
    """Everything `TreeBackend.forward` needs, built once per step by `TreeBackend.plan`."""

    segments: list[SharedSegment]
    private: PrivatePlan  # each request's private keys, position order (>= its q_len)
    num_levels: int  # max kept segments on one path; merge buffer has num_levels + 1 parts
    merge_rows: torch.Tensor | None  # (M,) rows with >= 1 shared part; None when M == T
    num_merge_rows: int  # M
    in_place: bool  # segments read by slot straight from the pool (kernels.pool_* ops)


def _as_range(idx: torch.Tensor) -> Range | None:
    """[a, b) when idx == arange(a, b), else None."""
    n = idx.numel()
    if n == 0:
        return None
    a = int(idx[0])
    if int(idx[-1]) - a + 1 != n or (n > 1 and not bool((idx.diff() == 1).all())):
        return None
    return a, a + n


def _node_members(batch: ForwardBatch) -> dict[int, list[int]]:
    """node_id -> requests whose path lists it; checks that the paths form a tree."""
    members: dict[int, list[int]] = {}
    where: dict[int, tuple[int, int]] = {}  # node_id -> (start position, num_tokens)
    prefix_lens = batch.prefix_lens
    for r, path in enumerate(batch.paths):
        pos = 0
        for node, n in path:
            assert n >= 1, f"request {r}: node {node} has {n} tokens"
            seen = where.setdefault(node, (pos, n))
            assert seen == (pos, n), f"node {node} at (start, len) {seen} and {(pos, n)}"
            lst = members.setdefault(node, [])
            assert not lst or lst[-1] != r, f"request {r} lists node {node} twice"
            lst.append(r)
            pos += n
        assert pos <= prefix_lens[r], (
            f"request {r}: radix path covers {pos} tokens > prefix_len {prefix_lens[r]}"
        )
    return members


def _candidate_segments(
    batch: ForwardBatch, members: dict[int, list[int]]
) -> list[tuple[tuple[int, ...], int, int]]:
    """(requests, start, num_tokens) of every chain of shared nodes with one request set."""
    found: dict[tuple[tuple[int, ...], int], int] = {}  # (requests, start) -> num_tokens
    for r, path in enumerate(batch.paths):
        chains: list[list] = []  # [requests, start, num_tokens] along this path
        pos = 0
        for node, n in path:
            reqs = tuple(members[node])
            if len(reqs) < 2:
                break  # request sets only shrink along a path: nothing shared below
            if chains and chains[-1][0] == reqs:
                chains[-1][2] += n
            else:
                chains.append([reqs, pos, n])
            pos += n
        # Every member walks the same chain and must find the same length.
        for reqs, start, n in chains:
            seen = found.setdefault((reqs, start), n)
            assert seen == n, f"request {r}: segment {reqs}@{start} has {n} tokens, not {seen}"
    return [(reqs, start, n) for (reqs, start), n in found.items()]


def _rows(starts: list[int], lens: list[int], reqs: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.arange(starts[r], starts[r] + lens[r]) for r in reqs])


class TreeBackend(AttentionBackend):
    """Hydragen-style attention over the radix tree (see module docstring).

    `plan(batch)` sets `batch.attn_plan` to a TreePlan and touches no K/V. `forward` writes the
    new K/V at `batch.out_cache_loc` of `layer` (mutates the pool), then reads only slots of
    the batch's kv_indices. Raises AssertionError when the paths are not a tree consistent
    with kv_indices (a node with two lengths or two sets of slots, a path past prefix_len).
    """

    name = "tree"

    def __init__(
        self,
        min_requests: int = 2,
        min_tokens: int = 64,
        min_reads: int = 2048,
        min_tokens_extend: int = 512,
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

        Defaults from `benchmarks/bench_backend.py --sweep --threads 1` (bf16, SmolLM2 heads,
        R = 128 private tokens; kept/folded per-layer time, < 1 pays). Decode: keeping pays
        once k * L >= ~2048 (k=2: L 1024 -> 0.86, 512 -> 1.23; k=4: 512 -> 0.83, 256 -> 1.24;
        k=8: 256 -> 0.89, 128 -> 1.17; k=16: 128 -> 0.96, 64 -> 1.15); at k = 64..128 segments
        under L = 64 were at best break-even. Extends (q_len 8): merge work grows with the
        query rows and nothing under L = 512 paid (k=8: 512 -> 0.78, 256 -> 1.10).
        These are CPU numbers for the "cpu" kernels; a GPU wants its own measurement.
        The native kernels (same sweep, float32, AVX2 EPYC) keep the k * L >= ~2048 rule (k=2:
        1024 -> 0.99; k=4: 512 -> 0.92; k=8: 256 -> 0.92; k=16: 128 -> 0.97) but L = 64 now
        loses (k=16 and 32: 1.08): min_tokens=128 would fit them better (not the default yet).
        """
        floor = self.min_tokens_extend if max_q_len > 1 else self.min_tokens
        return (
            num_requests >= self.min_requests
            and num_tokens >= floor
            and num_requests * num_tokens >= self.min_reads
        )

    def plan(self, batch: ForwardBatch) -> None:
        q_lens = batch.extend_lens
        kept = [
            (reqs, start, n)
            for reqs, start, n in _candidate_segments(batch, _node_members(batch))
            if self.keeps(len(reqs), n, max(q_lens[r] for r in reqs))
        ]
        kept.sort(key=lambda c: (c[1], c[0]))  # by start: ancestors before descendants
        batch.attn_plan = _build_plan(batch, kept)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        plan = batch.attn_plan
        assert isinstance(plan, TreePlan), f"plan() not run for this batch: {type(plan)}"
        pool = batch.kv_pool
        # Write first: an extend's queries must see their own (and earlier) new keys.
        pool.write(layer, batch.out_cache_loc, k, v)
        kc, vc = pool.k[layer], pool.v[layer]  # (num_slots, Hkv, D)
        if plan.in_place:
            return _fused_in_place(plan, q, kc, vc, scale)
        out, lse = plan.private.attend(q, kc, vc, scale)  # (T, Hq, D), (T, Hq)
        if not plan.segments:
            return out
        return _merge_shared(plan, q, kc, vc, out, lse, scale)


def batched_nodes(batch: ForwardBatch) -> set[int]:
    """Ids of the radix nodes that this batch's tree plan attended once for several requests
    (empty for a batch planned by another backend, or not planned)."""
    plan = batch.attn_plan
    if not isinstance(plan, TreePlan):
        return set()
    found: set[int] = set()
    for seg in plan.segments:
        pos = 0
        for node, n in batch.paths[seg.requests[0]]:
            if seg.start <= pos and pos + n <= seg.start + seg.num_tokens:
                found.add(node)
            pos += n
    return found


def _build_plan(batch: ForwardBatch, kept: list[tuple[tuple[int, ...], int, int]]) -> TreePlan:
    q_lens = list(batch.extend_lens)
    q_starts = [0]
    for n in q_lens[:-1]:
        q_starts.append(q_starts[-1] + n)
    per_req: list[list[Range]] = [[] for _ in q_lens]  # kept ranges on each path, by start
    levels: list[int] = []
    for reqs, start, n in kept:
        depth = {len(per_req[r]) for r in reqs}
        assert len(depth) == 1, f"segment {reqs}@{start} at different levels {depth}"
        levels.append(depth.pop())
        for r in reqs:
            per_req[r].append((start, start + n))
    # Merge buffer rows: the query rows of requests with >= 1 kept segment, request-major.
    merge_starts, m = [0] * len(q_lens), 0
    for r, ranges in enumerate(per_req):
        merge_starts[r], m = m, m + (q_lens[r] if ranges else 0)
    all_rows = m == sum(q_lens)
    segments = [
        _make_segment(batch, reqs, start, n, level, q_starts, q_lens, merge_starts)
        for (reqs, start, n), level in zip(kept, levels, strict=True)
    ]
    dev = batch.kv_pool.k[0].device
    with_shared = tuple(r for r, ranges in enumerate(per_req) if ranges)
    return TreePlan(
        segments=segments,
        private=private_plan(_private_slots(batch, per_req), q_lens, batch.kv_pool.k[0]),
        num_levels=max((lv + 1 for lv in levels), default=0),
        merge_rows=None
        if all_rows or not with_shared
        else _rows(q_starts, q_lens, with_shared).to(dev),
        num_merge_rows=m,
        in_place=kernels.reads_pool_in_place(batch.kv_pool.k[0]),
    )


def _make_segment(
    batch: ForwardBatch,
    reqs: tuple[int, ...],
    start: int,
    n: int,
    level: int,
    q_starts: list[int],
    q_lens: list[int],
    merge_starts: list[int],
) -> SharedSegment:
    slots = batch.kv_indices[reqs[0]][start : start + n]
    for r in reqs[1:]:
        other = batch.kv_indices[r][start : start + n]
        assert torch.equal(slots, other), f"segment {reqs}@{start}: request {r} has other slots"
    q_rows = _rows(q_starts, q_lens, reqs)
    merge_rows = _rows(merge_starts, q_lens, reqs)
    dev = batch.kv_pool.k[0].device  # index tensors live where the tensors they index do
    return SharedSegment(
        requests=reqs,
        start=start,
        num_tokens=n,
        slots=slots.to(dev),
        kv_range=_as_range(slots),
        q_rows=q_rows.to(dev),
        q_range=_as_range(q_rows),
        level=level,
        merge_rows=merge_rows.to(dev),
        merge_range=_as_range(merge_rows),
    )


def _private_slots(batch: ForwardBatch, per_req: list[list[Range]]) -> list[torch.Tensor]:
    """Per request, the slots of every position outside its kept segments, in order."""
    out: list[torch.Tensor] = []
    for r, kept in enumerate(per_req):
        idx, pos, parts = batch.kv_indices[r], 0, []
        assert idx.numel() == batch.seq_lens[r], f"request {r}: kv_indices vs seq_len"
        for a, b in [*kept, (batch.seq_lens[r], batch.seq_lens[r])]:
            if a > pos:
                parts.append(idx[pos:a])
            pos = b
        out.append(parts[0] if len(parts) == 1 else torch.cat(parts))
    return out


def _fused_in_place(
    plan: TreePlan,
    q: torch.Tensor,  # (T, Hq, D)
    kc: torch.Tensor,  # (num_slots, Hkv, D) one layer's keys
    vc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Segments by start (a request's ancestors first), each merged into its rows' running
    state by the kernel, then the private part from the full state -> (T, Hq, D)."""
    assert isinstance(plan.private, SlotPlan), f"in-place plan with {type(plan.private)}"
    state: tuple[torch.Tensor, torch.Tensor] | None = None  # (T, Hq, D), (T, Hq) float32
    for seg in plan.segments:
        everyone = seg.q_range == (0, q.shape[0])
        if state is None and everyone:
            state = kernels.pool_segment_attention(q, kc, vc, seg.slots, scale)
            continue
        if state is None:  # rows without a shared part yet: empty state (lse -inf)
            state = (
                q.new_zeros(q.shape),
                q.new_full(q.shape[:2], float("-inf"), dtype=torch.float32),
            )
        state = _segment_into(state, seg, q, kc, vc, scale)
    return plan.private.attend(q, kc, vc, scale, prior=state)[0]


def _segment_into(
    state: tuple[torch.Tensor, torch.Tensor],
    seg: SharedSegment,
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment's rows of `state` merged with its attention (in place in `state`)."""
    out, lse = state
    if seg.q_range:
        rows = slice(*seg.q_range)
        o, s = kernels.pool_segment_attention(
            q[rows], kc, vc, seg.slots, scale, prior=(out[rows], lse[rows])
        )
        out[rows], lse[rows] = o, s
        return out, lse
    prior = out.index_select(0, seg.q_rows), lse.index_select(0, seg.q_rows)
    qs = q.index_select(0, seg.q_rows)
    o, s = kernels.pool_segment_attention(qs, kc, vc, seg.slots, scale, prior=prior)
    return out.index_copy_(0, seg.q_rows, o), lse.index_copy_(0, seg.q_rows, s)


def _segment(
    plan: TreePlan,
    seg: SharedSegment,
    qs: torch.Tensor,  # (n, Hq, D) the queries of the segment's requests
    kc: torch.Tensor,  # (num_slots, Hkv, D) one layer's keys
    vc: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One kept segment's attention (gathering kernels): as a slice view, or gathered."""
    if seg.kv_range:
        ks, vs = kc[seg.kv_range[0] : seg.kv_range[1]], vc[seg.kv_range[0] : seg.kv_range[1]]
    else:
        ks, vs = kc.index_select(0, seg.slots), vc.index_select(0, seg.slots)  # (L, Hkv, D)
    return kernels.segment_attention(qs, ks, vs, scale)


def _merge_shared(
    plan: TreePlan,
    q: torch.Tensor,  # (T, Hq, D)
    kc: torch.Tensor,  # (num_slots, Hkv, D) one layer's keys
    vc: torch.Tensor,
    out: torch.Tensor,  # (T, Hq, D) private part's output
    lse: torch.Tensor,  # (T, Hq) float32
    scale: float,
) -> torch.Tensor:
    """Attend every kept segment once and merge it with the private part, row by row."""
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
        o, s = _segment(plan, seg, qs, kc, vc, scale)  # (n, Hq, D), (n, Hq)
        part_o, part_s = outs[seg.level + 1], lses[seg.level + 1]  # (M, Hq, D), (M, Hq) views
        if seg.merge_range:
            part_o[seg.merge_range[0] : seg.merge_range[1]] = o
            part_s[seg.merge_range[0] : seg.merge_range[1]] = s
        else:
            part_o.index_copy_(0, seg.merge_rows, o)
            part_s.index_copy_(0, seg.merge_rows, s)
    merged, _ = kernels.merge_states(outs, lses)  # (M, Hq, D)
    if rows is None:
        return merged
    return out.index_copy_(0, rows, merged)  # `out` is this step's fresh private result
