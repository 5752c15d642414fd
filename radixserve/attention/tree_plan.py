"""The tree backend's per-step plan: which shared K/V is attended once for several
requests (see attention/tree.py for how a layer runs it).

Plan (host side, once per step; the step as a whole: docs/architecture.md):

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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve import kernels
from radixserve.attention.flat import PrivatePlan, private_plan
from radixserve.attention.slots import table_plan
from radixserve.core.batch import ForwardBatch

Range = tuple[int, int]  # half-open [start, end)
Keeps = Callable[[int, int, int], bool]  # (num_requests, num_tokens, max_q_len) -> keep?


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
    """Rows [starts[r], starts[r] + lens[r]) of every r in `reqs` (non-empty), concatenated:
    a few tensor ops for any batch, not an `arange` per request."""
    first = torch.tensor([starts[r] for r in reqs], dtype=torch.int64)
    n = torch.tensor([lens[r] for r in reqs], dtype=torch.int64)
    ends = n.cumsum(0)
    return torch.arange(int(ends[-1])) + torch.repeat_interleave(first - (ends - n), n)


def build_plan(batch: ForwardBatch, keeps: Keeps) -> TreePlan:
    """The step's plan (module docstring, steps 1-4); `keeps(num_requests, num_tokens,
    max_q_len)` decides which candidate segments are attended on their own."""
    q_lens = batch.extend_lens
    starts, lengths = _node_starts(batch)
    kept = [
        c
        for c in _candidate_segments(starts, lengths)
        if keeps(len(c.requests), c.num_tokens, max(q_lens[r] for r in c.requests))
    ]
    kept.sort(key=lambda c: (c.first_start, c.requests))  # ancestors before descendants
    return _build_plan(batch, kept, starts, lengths)


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
        private=_private(batch, per_req, q_lens),
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
        at, n = starts[node], lengths[node]
        runs = torch.stack([batch.kv_indices[r][at[r] : at[r] + n] for r in c.requests])
        same = (runs == runs[0]).all(1)
        assert bool(same.all()), (
            f"node {node}: request {c.requests[int((~same).nonzero()[0])]} has other slots"
        )
        parts.append(runs[0])
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


def _private(batch: ForwardBatch, per_req: list[list[Range]], q_lens: list[int]) -> PrivatePlan:
    """The plan of every position outside the kept segments: read in the request-to-token
    table where each request's kept ranges cover a prefix of its sequence (its private keys
    one run), else from the slots gathered per request."""
    heads = [h for h in map(_covered_prefix, per_req) if h is not None]
    in_table = table_plan(batch, heads) if len(heads) == len(per_req) else None
    if in_table is not None:
        return in_table
    return private_plan(_private_slots(batch, per_req), q_lens, batch.kv_pool.k[0])


def _covered_prefix(kept: list[Range]) -> int | None:
    """How many leading positions the ranges cover together, if they cover nothing else."""
    end = 0
    for a, b in sorted(kept):
        if a != end:
            return None
        end = b
    return end


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
