"""Tree attention: K/V shared by several requests of a step is attended once for all of them.

Plan (host side, once per step; see DESIGN.md "Tree attention"):

    request r:  |<-------------------------- seq_lens[r] -------------------------->|
                |<-- seg 0 -->|<- folded ->|<-- seg 1 -->|<- private tail + new ->|
                 shared by      shared but   shared by       only r's; the last
                 {r, s, u}      too small    {r, s}          extend_lens[r] are queries

A path node (`batch.paths`) names a fixed run of slots: a radix node, or a prompt module
(negative ids), which may sit at a different offset in each request that lists it. Every
path node lies in its requests' cached prefix, so ALL query rows of a request see all of it,
and attention over a key set is order-free (softmax over the set, merged by LSE): a shared
node can be attended once for all its requests' rows, wherever it sits in each.

1. Every node on the paths of >= 2 requests is a candidate; nodes with the SAME request set
   form one segment (their slots concatenated, in the first member's order). On a radix
   path request sets only shrink, so those nodes are consecutive (one chain); prompt modules
   imported by the same requests merge into one segment wherever each request has them.
2. A segment folds back into its requests' private parts unless `TreeBackend.keeps` it:
   the extra segment call and merge cost a roughly fixed time per segment plus a time per
   query row, which only the saved re-reads of its K/V ((k - 1) * L rows) can pay back.
3. A request's private part is every position of kv_indices[r] not in a kept segment, in
   position order. It can be non-contiguous, but all of it precedes or is the query block,
   and the queries are its last extend_lens[r] entries, so the bottom-right causal
   alignment of `private_attention` stays exact.
4. Each kept segment gets a `level`, its part in the merge buffer (slot 0 holds the private
   part): the smallest level no other kept segment of any of its members has. Segments are
   taken by the start of their first node on their first member (ancestors first), so on
   a radix tree the level is the segment's depth among the kept ones.

Per layer: write the new K/V, ONE private_attention call for the whole batch, one
segment_attention per kept segment (queries of all its requests stacked, K/V read once), then
one merge_states over the rows that have any shared part. With kernels that read the pool in
place (`kernels.reads_pool_in_place`) segments and private parts are passed as slot lists
into the pool and the merge is fused: segments run in plan order, each starting from its
rows' running (out, lse) state (the pool ops' `prior`), and the private part last, from the
state of all of them; no merge buffer, no merge pass. Otherwise a segment whose slots are
not one range is gathered first.
"""

from __future__ import annotations

import itertools
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
    nodes: tuple[int, ...]  # the path nodes it covers, in its first member's order
    num_tokens: int
    slots: torch.Tensor  # (num_tokens,) int64 KV slots
    kv_range: Range | None  # set when slots == arange(*kv_range): read a slice view, no gather
    q_rows: torch.Tensor  # (n,) int64 rows of the members' queries in the flat (T,) layout
    q_range: Range | None  # set when q_rows is one ascending run
    level: int  # its part in the merge buffer (plan step 4), unique on each member's path
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


@dataclass(frozen=True)
class _Candidate:
    """Shared nodes with one request set (plan step 1), before `keeps` decides."""

    requests: tuple[int, ...]
    nodes: tuple[int, ...]  # in the first member's path order
    num_tokens: int
    first_start: int  # where its first node starts on its first member


def _node_starts(batch: ForwardBatch) -> tuple[dict[int, dict[int, int]], dict[int, int]]:
    """(node_id -> {request: where the node starts in its kv_indices}, node_id -> tokens);
    checks that a node has one length and that paths stay within the cached prefixes."""
    starts: dict[int, dict[int, int]] = {}
    lengths: dict[int, int] = {}
    prefix_lens = batch.prefix_lens
    for r, path in enumerate(batch.paths):
        pos = 0
        for node, n in path:
            assert n >= 1, f"request {r}: node {node} has {n} tokens"
            seen = lengths.setdefault(node, n)
            assert seen == n, f"node {node} has {seen} and {n} tokens"
            where = starts.setdefault(node, {})
            assert r not in where, f"request {r} lists node {node} twice"
            where[r] = pos
            pos += n
        assert pos <= prefix_lens[r], (
            f"request {r}: path covers {pos} tokens > prefix_len {prefix_lens[r]}"
        )
    return starts, lengths


def _candidate_segments(
    starts: dict[int, dict[int, int]], lengths: dict[int, int]
) -> list[_Candidate]:
    """Every set of >= 2 requests sharing nodes, with those nodes (plan step 1)."""
    by_set: dict[tuple[int, ...], list[int]] = {}
    # `starts` is in order of first sight: a node shared by requests S is first seen on the
    # path of min(S), so each set's nodes come in its first member's path order.
    for node, where in starts.items():
        if len(where) >= 2:
            by_set.setdefault(tuple(where), []).append(node)
    return [
        _Candidate(reqs, tuple(xs), sum(lengths[x] for x in xs), starts[xs[0]][reqs[0]])
        for reqs, xs in by_set.items()
    ]


def _rows(starts: list[int], lens: list[int], reqs: tuple[int, ...]) -> torch.Tensor:
    return torch.cat([torch.arange(starts[r], starts[r] + lens[r]) for r in reqs])


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
        min_tokens: int = 1024,
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

        Defaults from `benchmarks/bench_backend.py --sweep --dtype float32 --kv-dtype float16`
        (the CPU engine's default dtypes; native kernels, session 13, 2 threads, AVX2 EPYC
        Zen 3, SmolLM2 heads, R = 128 private tokens; kept/folded per-layer time, < 1 pays).
        Folding a segment reads it once per request, but those re-reads come from the
        last-level cache, and the flat decode kernel runs near the read bandwidth, so keeping
        pays only for long segments. Decode: L >= 1024 and k * L >= 8192 (k=2: L 4096 ->
        0.99-1.03, 2048 -> 1.04-1.08; k=4: 2048 -> 0.93-0.94, 1024 -> 0.95-1.00; k=8: 1024 ->
        0.92-0.95, 512 -> 1.37-1.39; k=32 and 64: 512 -> 0.92-0.97, 256 -> 1.07-1.15).
        Extends (q_len 8): only L = 4096 paid across k (0.90-0.98; k=2: 1.02; L = 2048:
        0.96-1.09). The earlier kernels kept segments from k * L >= 2048 and L >= 64 (decode)
        or 512 (extend). A GPU wants its own measurement.
        """
        floor = self.min_tokens_extend if max_q_len > 1 else self.min_tokens
        return (
            num_requests >= self.min_requests
            and num_tokens >= floor
            and num_requests * num_tokens >= self.min_reads
        )

    def plan(self, batch: ForwardBatch) -> None:
        q_lens = batch.extend_lens
        starts, lengths = _node_starts(batch)
        kept = [
            c
            for c in _candidate_segments(starts, lengths)
            if self.keeps(len(c.requests), c.num_tokens, max(q_lens[r] for r in c.requests))
        ]
        kept.sort(key=lambda c: (c.first_start, c.requests))  # ancestors before descendants
        batch.attn_plan = _build_plan(batch, kept, starts, lengths)

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
    """Ids of the path nodes (radix nodes, prompt modules) that this batch's tree plan
    attended once for several requests (empty for a batch planned by another backend, or
    not planned)."""
    plan = batch.attn_plan
    if not isinstance(plan, TreePlan):
        return set()
    return {node for seg in plan.segments for node in seg.nodes}


def _levels(kept: list[_Candidate]) -> list[int]:
    """Plan step 4: per kept segment, the smallest level none of its members uses yet."""
    used: dict[int, set[int]] = {}  # request -> levels of its kept segments so far
    levels = []
    for c in kept:
        taken = set().union(*(used.get(r, set()) for r in c.requests))
        level = next(lv for lv in itertools.count() if lv not in taken)
        for r in c.requests:
            used.setdefault(r, set()).add(level)
        levels.append(level)
    return levels


def _build_plan(
    batch: ForwardBatch,
    kept: list[_Candidate],
    starts: dict[int, dict[int, int]],
    lengths: dict[int, int],
) -> TreePlan:
    q_lens = list(batch.extend_lens)
    q_starts = [0]
    for n in q_lens[:-1]:
        q_starts.append(q_starts[-1] + n)
    per_req: list[list[Range]] = [[] for _ in q_lens]  # kept ranges of each request
    for c in kept:
        for node in c.nodes:
            for r in c.requests:
                a = starts[node][r]
                per_req[r].append((a, a + lengths[node]))
    levels = _levels(kept)
    # Merge buffer rows: the query rows of requests with >= 1 kept segment, request-major.
    merge_starts, m = [0] * len(q_lens), 0
    for r, ranges in enumerate(per_req):
        merge_starts[r], m = m, m + (q_lens[r] if ranges else 0)
    all_rows = m == sum(q_lens)
    segments = [
        _make_segment(batch, c, starts, lengths, level, q_starts, q_lens, merge_starts)
        for c, level in zip(kept, levels, strict=True)
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
    c: _Candidate,
    starts: dict[int, dict[int, int]],
    lengths: dict[int, int],
    level: int,
    q_starts: list[int],
    q_lens: list[int],
    merge_starts: list[int],
) -> SharedSegment:
    parts = []
    for node in c.nodes:
        mine, *others = (
            batch.kv_indices[r][starts[node][r] : starts[node][r] + lengths[node]]
            for r in c.requests
        )
        for r, other in zip(c.requests[1:], others, strict=True):
            assert torch.equal(mine, other), f"node {node}: request {r} has other slots"
        parts.append(mine)
    slots = parts[0] if len(parts) == 1 else torch.cat(parts)
    q_rows = _rows(q_starts, q_lens, c.requests)
    merge_rows = _rows(merge_starts, q_lens, c.requests)
    dev = batch.kv_pool.k[0].device  # index tensors live where the tensors they index do
    return SharedSegment(
        requests=c.requests,
        nodes=c.nodes,
        num_tokens=c.num_tokens,
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
        for a, b in [*sorted(kept), (batch.seq_lens[r], batch.seq_lens[r])]:
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
    """Segments in plan order, each merged into its rows' running state by the kernel, then
    the private part from the full state -> (T, Hq, D)."""
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
