"""TreeBackend: its plan on a hand-made tree, and its output on random trees.

Oracle: per request, kernels.reference.private_attention over the request's whole sequence,
with K/V taken from the test's own copy (pool contents before the step + the step's new K/V),
never from the pool the backend wrote. Tolerances: fp32 max |diff| <= 1e-5 (float32 rounding
of differently ordered sums of O(1) values is ~1e-7); bf16: see BF16_ATOL.

Every test runs twice (module-scoped `kernel_impl`): with the torch kernels ("cpu": private
keys gathered, PaddedPlan / GatherPlan) and with the native kernels ("native": K/V read in
place by slot, SlotPlan), skipped where those cannot be built.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from radixserve import kernels
from radixserve.attention import AttentionBackend, FlatBackend, TreeBackend, make_backend
from radixserve.attention.flat import GatherPlan, PaddedPlan, SlotPlan
from radixserve.attention.tree_plan import TreePlan, batched_nodes
from radixserve.core.batch import ForwardBatch
from radixserve.kernels import native, reference
from radixserve.kvcache.pool import KVPool

FP32_ATOL = 1e-5
# bf16: each part's output is rounded to bf16 (rel 2^-9) before the merge and the merged
# result again, so |tree - oracle| <= 2^-9 * max_j |O_j| + 2^-9 * |out| with |O_j| <= ~4
# (averages of randn values): checked as |diff| <= BF16_ATOL + BF16_RTOL * |oracle|.
# Observed worst ratio over 200 random trees (seeds 0..199): 0.51; fp32 worst diff 1.2e-6.
BF16_ATOL = 1e-2
BF16_RTOL = 1e-2
GARBAGE = 1e3  # pool content at the new tokens' slots before the step: must be overwritten


@pytest.fixture(scope="module", autouse=True, params=["cpu", "native"])
def kernel_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the whole module with each CPU kernel impl (module scope: hypothesis-safe)."""
    if request.param == "native" and native.ops() is None:
        pytest.skip("native attention kernels cannot be built here")
    before = kernels.get_impl()
    kernels.set_impl(request.param)
    yield request.param
    kernels.set_impl(before)


def in_place() -> bool:
    """Whether backends plan SlotPlans (native kernels) instead of gathering."""
    return kernels.get_impl() == "native"


@dataclass
class Case:
    batch: ForwardBatch
    q: torch.Tensor  # (T, Hq, D)
    k: torch.Tensor  # (T, Hkv, D)
    v: torch.Tensor
    k_all: torch.Tensor  # (num_slots, Hkv, D) what the pool must hold after the write
    v_all: torch.Tensor
    k_before: torch.Tensor  # pool contents before the step
    v_before: torch.Tensor


def make_case(
    paths: list[list[tuple[int, int]]],
    node_slots: dict[int, list[int]],
    tails: list[list[int]],  # per request: cached slots after its path (not in the tree)
    news: list[list[int]],  # per request: slots of its new tokens (queries)
    kv_heads: int,
    group: int,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_layers: int = 1,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    kv_indices = [
        torch.tensor([s for node, _ in p for s in node_slots[node]] + t + n, dtype=torch.int64)
        for p, t, n in zip(paths, tails, news, strict=True)
    ]
    num_slots = 1 + max(int(x.max()) for x in kv_indices)
    pool = KVPool(num_slots, num_layers, kv_heads, head_dim, dtype)
    new_slots = torch.tensor([s for n in news for s in n], dtype=torch.int64)
    shape = (num_slots, kv_heads, head_dim)
    for buf in (pool.k[0], pool.v[0]):
        buf.copy_(torch.randn(shape, generator=gen))
        buf[new_slots] = GARBAGE
    t = len(new_slots)
    q = torch.randn((t, kv_heads * group, head_dim), generator=gen).to(dtype)
    k = torch.randn((t, kv_heads, head_dim), generator=gen).to(dtype)
    v = torch.randn((t, kv_heads, head_dim), generator=gen).to(dtype)
    k_all, v_all = pool.k[0].clone(), pool.v[0].clone()
    k_all[new_slots], v_all[new_slots] = k, v
    batch = ForwardBatch(
        input_ids=torch.zeros(t, dtype=torch.int64),
        positions=torch.cat(
            [torch.arange(len(x) - len(n), len(x)) for x, n in zip(kv_indices, news, strict=True)]
        ),
        out_cache_loc=new_slots,
        seq_lens=[len(x) for x in kv_indices],
        extend_lens=[len(n) for n in news],
        kv_indices=kv_indices,
        paths=paths,
        kv_pool=pool,
    )
    return Case(batch, q, k, v, k_all, v_all, pool.k[0].clone(), pool.v[0].clone())


def tree(min_requests: int, min_tokens: int) -> TreeBackend:
    """A TreeBackend whose only thresholds are these two (the product rule and the extend floor
    switched off), so tests choose exactly which segments fold."""
    return TreeBackend(min_requests, min_tokens, min_reads=1, min_tokens_extend=min_tokens)


def run_backend(
    backend: AttentionBackend, case: Case, scale: float, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Plan + one layer's forward on a fresh copy of the pre-step pool."""
    case.batch.kv_pool.k[0].copy_(case.k_before)
    case.batch.kv_pool.v[0].copy_(case.v_before)
    backend.plan(case.batch)
    out = backend.forward(case.q, case.k, case.v, 0, case.batch, scale, sinks=sinks)
    assert torch.equal(case.batch.kv_pool.k[0], case.k_all), "pool K after forward"
    assert torch.equal(case.batch.kv_pool.v[0], case.v_all), "pool V after forward"
    return out


def oracle(case: Case, scale: float) -> torch.Tensor:
    outs, q0 = [], 0
    for idx, ql in zip(case.batch.kv_indices, case.batch.extend_lens, strict=True):
        n = len(idx)
        o, _ = reference.private_attention(
            case.q[q0 : q0 + ql], case.k_all[idx], case.v_all[idx], [ql], [n], scale
        )
        outs.append(o)
        q0 += ql
    return torch.cat(outs)


def bf16_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst |got - want| / (BF16_ATOL + BF16_RTOL * |want|); <= 1 passes."""
    assert got.dtype == want.dtype == torch.bfloat16, (got.dtype, want.dtype)
    d = (got.float() - want.float()).abs()
    return float((d / (BF16_ATOL + BF16_RTOL * want.float().abs())).max())


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------------------- the plan
#
#   A(4) ─ A2(3) ─┬─ B(9) ─┬─ D(2)    r0 = A A2 B D + tail 70 + new 80
#                 │        └─         r2 = A A2 B     + new 82 83
#                 └─ C(6)             r1 = A A2 C     + new 81
#                                     r3 = (no path) tail 90 91 92 + new 84
NODE_SLOTS = {
    1: [10, 11, 12, 13],
    2: [30, 32, 31],
    3: list(range(40, 49)),
    4: [50, 51],
    5: list(range(60, 66)),
}
A, A2, B, D, C = (1, 4), (2, 3), (3, 9), (4, 2), (5, 6)
HAND_PATHS = [[A, A2, B, D], [A, A2, C], [A, A2, B], []]
HAND_TAILS = [[70], [], [], [90, 91, 92]]
HAND_NEWS = [[80], [81], [82, 83], [84]]
CHAIN = [10, 11, 12, 13, 30, 32, 31]  # A + A2


def hand_plan(min_requests: int, min_tokens: int) -> tuple[TreePlan, Case]:
    case = make_case(HAND_PATHS, NODE_SLOTS, HAND_TAILS, HAND_NEWS, kv_heads=1, group=3)
    tree(min_requests, min_tokens).plan(case.batch)
    plan = case.batch.attn_plan
    assert isinstance(plan, TreePlan)
    return plan, case


def seg_summary(plan: TreePlan) -> list[tuple]:
    return [
        (
            s.requests,
            s.nodes,
            s.slots.tolist(),
            s.kv_range,
            s.level,
            s.q_rows.tolist(),
            s.q_range,
            s.merge_rows.tolist(),
            s.merge_range,
        )
        for s in plan.segments
    ]


def private_per_request(plan: TreePlan) -> list[list[int]]:
    p, out, i = plan.private, [], 0
    if isinstance(p, SlotPlan):
        return [k.tolist() for k in p.keys()]
    if isinstance(p, PaddedPlan):
        grid = p.grid.view(len(p.kv_lens), -1).tolist()
        return [row[:n] for row, n in zip(grid, p.kv_lens, strict=True)]
    slots = p.slots.tolist()
    for n in p.kv_lens:
        out.append(slots[i : i + n])
        i += n
    return out


def test_plan_no_folding_merges_chain_and_keeps_both_levels() -> None:
    plan, _ = hand_plan(2, 1)
    assert seg_summary(plan) == [
        ((0, 1, 2), (1, 2), CHAIN, None, 0, [0, 1, 2, 3], (0, 4), [0, 1, 2, 3], (0, 4)),
        ((0, 2), (3,), list(range(40, 49)), (40, 49), 1, [0, 2, 3], None, [0, 2, 3], None),
    ]
    assert private_per_request(plan) == [
        [50, 51, 70, 80],
        [*range(60, 66), 81],
        [82, 83],
        [90, 91, 92, 84],
    ]
    if in_place():
        assert isinstance(plan.private, SlotPlan)
        assert plan.private.q_offsets.tolist() == [0, 1, 2, 4, 5] and plan.in_place
    else:
        assert isinstance(plan.private, GatherPlan) and plan.private.q_lens == [1, 1, 2, 1]
    assert plan.num_levels == 2
    assert plan.merge_rows is not None and plan.merge_rows.tolist() == [0, 1, 2, 3]
    assert plan.num_merge_rows == 4


def test_plan_min_tokens_folds_root_chain_private_part_non_contiguous() -> None:
    plan, _ = hand_plan(2, 8)  # A+A2 (7 tokens) folds, B (9) stays
    assert seg_summary(plan) == [
        ((0, 2), (3,), list(range(40, 49)), (40, 49), 0, [0, 2, 3], None, [0, 1, 2], (0, 3)),
    ]
    assert private_per_request(plan) == [
        [*CHAIN, 50, 51, 70, 80],
        [*CHAIN, *range(60, 66), 81],
        [*CHAIN, 82, 83],
        [90, 91, 92, 84],
    ]
    assert plan.num_levels == 1
    assert plan.merge_rows is not None and plan.merge_rows.tolist() == [0, 2, 3]


def test_plan_min_requests_folds_pair_segment() -> None:
    plan, _ = hand_plan(3, 1)
    assert seg_summary(plan) == [
        ((0, 1, 2), (1, 2), CHAIN, None, 0, [0, 1, 2, 3], (0, 4), [0, 1, 2, 3], (0, 4)),
    ]
    assert private_per_request(plan)[0] == [*range(40, 49), 50, 51, 70, 80]
    assert private_per_request(plan)[2] == [*range(40, 49), 82, 83]


def test_plan_min_reads_folds_small_product() -> None:
    case = make_case(HAND_PATHS, NODE_SLOTS, HAND_TAILS, HAND_NEWS, kv_heads=1, group=3)
    # A+A2: 3 requests x 7 tokens = 21 reads, kept; B: 2 x 9 = 18 < 20, folded.
    TreeBackend(2, 1, min_reads=20, min_tokens_extend=1).plan(case.batch)
    plan = case.batch.attn_plan
    assert isinstance(plan, TreePlan)
    assert [(s.requests, s.nodes, s.num_tokens) for s in plan.segments] == [((0, 1, 2), (1, 2), 7)]


def test_default_thresholds_rule() -> None:
    t = TreeBackend()
    assert (t.min_requests, t.min_tokens, t.min_reads, t.min_tokens_extend) == (2, 768, 8192, 4096)
    decode = [(2, 4096), (4, 2048), (8, 1024), (11, 768), (256, 768)]
    assert all(t.keeps(k, n, 1) for k, n in decode)
    folded = [(2, 4095), (4, 2047), (8, 1023), (10, 768), (256, 767), (1, 10**6)]
    assert not any(t.keeps(k, n, 1) for k, n in folded)
    assert t.keeps(2, 4096, 8) and t.keeps(64, 4096, 32)
    # extend: L >= 4096, a floor of its own (8 x 2048 keeps as decode, folds as extend)
    assert not t.keeps(64, 4095, 8) and not t.keeps(8, 2048, 2) and t.keeps(8, 2048, 1)


def test_plan_everything_folded_is_flat() -> None:
    plan, case = hand_plan(4, 1)
    assert plan.segments == [] and plan.num_levels == 0 and plan.num_merge_rows == 0
    assert private_per_request(plan) == [x.tolist() for x in case.batch.kv_indices]


@pytest.mark.parametrize("thresholds", [(2, 1), (2, 8), (3, 1), (4, 1)])
def test_hand_tree_output_matches_oracle(thresholds: tuple[int, int]) -> None:
    plan, case = hand_plan(*thresholds)
    out = run_backend(tree(*thresholds), case, 0.25)
    assert max_err(out, oracle(case, 0.25)) <= FP32_ATOL


def test_plan_rejects_inconsistent_tree() -> None:
    slots = {**NODE_SLOTS, 6: [10, 11, 12, 14]}  # node 1 in r1 points at other slots
    case = make_case(
        [[A, A2], [A, A2]], {1: [10, 11, 12, 13], 2: [30, 32, 31]}, [[], []], [[80], [81]], 1, 1
    )
    case.batch.kv_indices[1] = torch.tensor([*slots[6], 30, 32, 31, 81])
    with pytest.raises(AssertionError, match="other slots"):
        tree(2, 1).plan(case.batch)
    case = make_case([[A]], NODE_SLOTS, [[]], [[80]], 1, 1)
    case.batch.paths = [[A, A2]]  # 7 path tokens > prefix_len 4
    with pytest.raises(AssertionError, match="prefix_len"):
        tree(2, 1).plan(case.batch)


# ----------------------------------------------------------- write before attention


@pytest.mark.parametrize("backend", [tree(2, 1), FlatBackend()])
def test_extend_queries_see_their_own_new_keys(backend: TreeBackend | FlatBackend) -> None:
    # Two requests share a cached 5-token node and extend 3 tokens each; the pool holds
    # GARBAGE at the new slots, so attending before writing would be off by ~1e3.
    case = make_case(
        [[(1, 5)], [(1, 5)], []],
        {1: [1, 2, 3, 4, 5]},
        [[], [], []],
        [[6, 7, 8], [9, 10, 11], [12, 13, 14]],
        kv_heads=2,
        group=1,
    )
    out = run_backend(backend, case, 0.5)
    assert max_err(out, oracle(case, 0.5)) <= FP32_ATOL
    # Request 2 has no cached prefix: its first query sees only its own key -> exactly v.
    torch.testing.assert_close(out[6], case.v[6], atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", [tree(2, 1), FlatBackend()])
def test_one_plan_serves_every_layer(backend: AttentionBackend) -> None:
    """plan() once, forward on layer 0 then layer 1 (other K/V, other q): both exact, and the
    first output is not clobbered by the second forward (the plan's scratch is reused)."""
    case = make_case(
        HAND_PATHS, NODE_SLOTS, HAND_TAILS, HAND_NEWS, kv_heads=1, group=3, num_layers=2
    )
    pool, gen = case.batch.kv_pool, torch.Generator().manual_seed(1)
    assert isinstance(pool, KVPool)
    pool.k[1].copy_(torch.randn(pool.k[0].shape, generator=gen))  # layer 1: other K/V
    pool.v[1].copy_(torch.randn(pool.v[0].shape, generator=gen))
    layer1 = Case(
        case.batch, case.q.flip(0), case.k.flip(0), case.v.flip(0),
        pool.k[1].clone(), pool.v[1].clone(), pool.k[1].clone(), pool.v[1].clone(),
    )  # fmt: skip
    layer1.k_all[case.batch.out_cache_loc] = layer1.k
    layer1.v_all[case.batch.out_cache_loc] = layer1.v
    backend.plan(case.batch)
    out0 = backend.forward(case.q, case.k, case.v, 0, case.batch, 0.25)
    out0_copy = out0.clone()
    out1 = backend.forward(layer1.q, layer1.k, layer1.v, 1, case.batch, 0.25)
    assert max_err(out0, oracle(case, 0.25)) <= FP32_ATOL
    assert max_err(out1, oracle(layer1, 0.25)) <= FP32_ATOL
    assert torch.equal(out0, out0_copy)
    assert torch.equal(pool.k[1], layer1.k_all) and torch.equal(pool.v[0], case.v_all)


def test_naive_softmax_agrees_with_oracle() -> None:
    """The oracle itself against a line-by-line softmax, on the hand-made tree."""
    _, case = hand_plan(2, 1)
    got, q0 = oracle(case, 0.3), 0
    for idx, ql in zip(case.batch.kv_indices, case.batch.extend_lens, strict=True):
        kk = case.k_all[idx].repeat_interleave(3, dim=1)  # (S, Hq, D)
        vv = case.v_all[idx].repeat_interleave(3, dim=1)
        for i in range(ql):
            visible = len(idx) - ql + i + 1
            s = torch.einsum("hd,shd->hs", case.q[q0 + i], kk[:visible]) * 0.3
            want = torch.einsum("hs,shd->hd", s.softmax(-1), vv[:visible])
            torch.testing.assert_close(got[q0 + i], want, atol=1e-6, rtol=1e-6)
        q0 += ql


# ------------------------------------------------------------------- random trees


def random_case(
    seed: int, depth: int, fanout: int, max_len: int, group: int, extend: bool, dtype: torch.dtype
) -> Case:
    rng = random.Random(seed)
    parent: dict[int, int | None] = {}
    lengths: dict[int, int] = {}
    frontier: list[int | None] = [None]
    for level in range(depth):
        nxt: list[int | None] = []
        for p in frontier:
            for _ in range(rng.randint(1, fanout) if level == 0 else rng.randint(0, fanout)):
                node = len(parent) + 1
                parent[node] = p
                lengths[node] = rng.randint(1, max_len)
                nxt.append(node)
        frontier = nxt or frontier
    # Slots: half the nodes get a contiguous run, the rest scattered slots; new tokens too.
    total = sum(lengths.values()) + 8 * 60
    scattered = list(range(total + 1, 2 * total + 1))
    rng.shuffle(scattered)
    cursor = 1

    def take(n: int) -> list[int]:
        nonlocal cursor
        if rng.random() < 0.5:
            cursor += n
            return list(range(cursor - n, cursor))
        return [scattered.pop() for _ in range(n)]

    node_slots = {node: take(n) for node, n in lengths.items()}
    leaves = [n for n in lengths if n not in set(parent.values())]
    paths: list[list[tuple[int, int]]] = []
    for _ in range(rng.randint(1, 8)):
        if paths and rng.random() < 0.15:
            paths.append(list(paths[-1]))  # duplicated path
            continue
        # Mostly leaves (deep paths share at several levels); None: no cached path at all.
        options: list[int | None] = [*leaves] if rng.random() < 0.6 else [None, *lengths]
        cur = rng.choice(options)
        path = []
        while cur is not None:
            path.append((cur, lengths[cur]))
            cur = parent[cur]
        paths.append(path[::-1])
    tails = [take(rng.choice([0, 0, rng.randint(1, 20)])) for _ in paths]
    news = [take(rng.randint(1, 12) if extend else 1) for _ in paths]
    return make_case(
        paths,
        node_slots,
        tails,
        news,
        kv_heads=rng.choice([1, 2]),
        group=group,
        dtype=dtype,
        seed=seed,
    )


@given(
    seed=st.integers(0, 2**31 - 1),
    depth=st.integers(1, 4),
    fanout=st.integers(1, 4),
    max_len=st.sampled_from([1, 8, 300]),
    group=st.sampled_from([1, 3, 8]),
    extend=st.booleans(),
    thresholds=st.sampled_from([(2, 1), (2, 16), (3, 1), (3, 64), (1000, 1), None]),
)
def test_random_trees_fp32(
    seed: int,
    depth: int,
    fanout: int,
    max_len: int,
    group: int,
    extend: bool,
    thresholds: tuple[int, int] | None,
) -> None:
    case = random_case(seed, depth, fanout, max_len, group, extend, torch.float32)
    scale = 1 / math.sqrt(16)
    want = oracle(case, scale)
    backend = TreeBackend() if thresholds is None else tree(*thresholds)  # None: defaults
    assert max_err(run_backend(backend, case, scale), want) <= FP32_ATOL
    assert max_err(run_backend(FlatBackend(), case, scale), want) <= FP32_ATOL


@given(
    seed=st.integers(0, 2**31 - 1),
    depth=st.integers(1, 4),
    group=st.sampled_from([1, 3, 8]),
    extend=st.booleans(),
)
def test_random_trees_bf16(seed: int, depth: int, group: int, extend: bool) -> None:
    case = random_case(seed, depth, 3, 300, group, extend, torch.bfloat16)
    want = oracle(case, 0.25)
    assert bf16_ratio(run_backend(tree(2, 1), case, 0.25), want) <= 1.0
    assert bf16_ratio(run_backend(FlatBackend(), case, 0.25), want) <= 1.0


def test_single_request_and_all_duplicates() -> None:
    nodes = {1: list(range(1, 41)), 2: list(range(41, 61))}
    one = make_case([[(1, 40), (2, 20)]], nodes, [[]], [[61]], kv_heads=1, group=8)
    assert max_err(run_backend(tree(2, 1), one, 0.2), oracle(one, 0.2)) <= FP32_ATOL
    dup = make_case(
        [[(1, 40), (2, 20)]] * 4, nodes, [[]] * 4, [[61], [62], [63], [64, 65]], kv_heads=1, group=8
    )
    out = run_backend(tree(2, 1), dup, 0.2)
    plan = dup.batch.attn_plan
    assert isinstance(plan, TreePlan)
    # Both nodes have the same request set: one segment of 60 contiguous slots, read as a view.
    assert [(s.requests, s.num_tokens, s.kv_range) for s in plan.segments] == [
        ((0, 1, 2, 3), 60, (1, 61))
    ]
    assert plan.merge_rows is None  # every row has a shared part: merge all rows in place
    assert max_err(out, oracle(dup, 0.2)) <= FP32_ATOL


@pytest.mark.parametrize(
    ("lens", "plan_type"),
    [
        ([30, 41, 25, 60], PaddedPlan),  # decode, similar lengths: one padded call
        ([200, 3, 5, 9], GatherPlan),  # padding would be > 2x the keys: gather concatenated
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_private_plans(lens: list[int], plan_type: type, dtype: torch.dtype) -> None:
    """Both ways of reading private keys in a decode step match the oracle, flat and tree
    (a shared 40-token root segment kept, so tree's private parts are the tails); native
    kernels read them by slot instead (SlotPlan) whatever the lengths."""
    plan_type = SlotPlan if in_place() else plan_type
    nodes = {1: list(range(1, 41))}
    base = 41
    tails, news = [], []
    for n in lens:
        tails.append(list(range(base, base + n - 1)))
        news.append([base + n - 1])
        base += n
    case = make_case([[(1, 40)]] * 4, nodes, tails, news, kv_heads=3, group=3, dtype=dtype)
    want = oracle(case, 0.125)
    for backend in (FlatBackend(), tree(2, 1)):
        got = run_backend(backend, case, 0.125)
        plan = case.batch.attn_plan
        private = plan.private if isinstance(plan, TreePlan) else plan
        assert isinstance(private, plan_type), (backend, type(private))
        if dtype == torch.float32:
            assert max_err(got, want) <= FP32_ATOL, backend
        else:
            assert bf16_ratio(got, want) <= 1.0, backend


# --------------------------------------------- prompt modules: shared at any offset
#
#   modules (negative ids, as the ModuleStore names them): M1 5 tokens, M2 3, M3 4
#   r0 = M1 M2 M3 + new 80        M1, M3: shared by {r0, r1} at other offsets in each
#   r1 = M3 M1    + new 81        -> ONE segment of both (9 tokens); M2: {r0, r2}
#   r2 = M2       + tail 70 + new 82 83
MOD_SLOTS = {-1: [1, 2, 3, 4, 5], -2: [20, 22, 21], -3: [30, 31, 32, 33]}
M1, M2, M3 = (-1, 5), (-2, 3), (-3, 4)


def test_plan_modules_shared_at_different_offsets_are_one_segment() -> None:
    case = make_case(
        [[M1, M2, M3], [M3, M1], [M2]], MOD_SLOTS, [[], [], [70]], [[80], [81], [82, 83]], 1, 2
    )
    tree(2, 1).plan(case.batch)
    plan = case.batch.attn_plan
    assert isinstance(plan, TreePlan)
    assert seg_summary(plan) == [
        (
            (0, 1),
            (-1, -3),
            [1, 2, 3, 4, 5, 30, 31, 32, 33],
            None,
            0,
            [0, 1],
            (0, 2),
            [0, 1],
            (0, 2),
        ),
        ((0, 2), (-2,), [20, 22, 21], None, 1, [0, 2, 3], None, [0, 2, 3], None),
    ]
    assert private_per_request(plan) == [[80], [81], [70, 82, 83]]
    assert plan.num_levels == 2 and plan.merge_rows is None
    assert batched_nodes(case.batch) == {-1, -2, -3}
    assert max_err(run_backend(tree(2, 1), case, 0.25), oracle(case, 0.25)) <= FP32_ATOL


def module_case(seed: int, extend: bool, dtype: torch.dtype) -> Case:
    """2..8 requests, each importing a random subset of 6 modules in a random order (then a
    private tail and new tokens); some requests instead follow a small radix tree."""
    rng = random.Random(seed)
    cursor, slots = 1, {}
    for m in range(1, 7):
        n = rng.randint(1, 200)
        if rng.random() < 0.5:
            slots[-m] = list(range(cursor, cursor + n))
        else:
            slots[-m] = rng.sample(range(cursor, cursor + 3 * n), n)
        cursor += 3 * n
    radix = {1: list(range(cursor, cursor + 40)), 2: list(range(cursor + 40, cursor + 50))}
    cursor += 50
    paths: list[list[tuple[int, int]]] = []
    for _ in range(rng.randint(2, 8)):
        if rng.random() < 0.2:
            paths.append([(1, 40), (2, 10)][: rng.randint(1, 2)])
            continue
        mods = rng.sample(range(1, 7), rng.randint(0, 6))
        paths.append([(-m, len(slots[-m])) for m in mods])
    tails, news = [], []
    for _ in paths:
        n_tail, n_new = rng.choice([0, rng.randint(1, 20)]), rng.randint(1, 12) if extend else 1
        tails.append(list(range(cursor, cursor + n_tail)))
        news.append(list(range(cursor + n_tail, cursor + n_tail + n_new)))
        cursor += n_tail + n_new
    return make_case(
        paths, {**slots, **radix}, tails, news, rng.choice([1, 2]), rng.choice([1, 3]), dtype=dtype
    )


@given(
    seed=st.integers(0, 2**31 - 1),
    extend=st.booleans(),
    thresholds=st.sampled_from([(2, 1), (2, 16), (3, 1), None]),
)
def test_random_module_imports_fp32(
    seed: int, extend: bool, thresholds: tuple[int, int] | None
) -> None:
    case = module_case(seed, extend, torch.float32)
    want = oracle(case, 0.25)
    backend = TreeBackend() if thresholds is None else tree(*thresholds)
    assert max_err(run_backend(backend, case, 0.25), want) <= FP32_ATOL
    plan = case.batch.attn_plan
    assert isinstance(plan, TreePlan)
    # every node kept is in ONE segment, whose requests are exactly those listing it
    for seg in plan.segments:
        for node in seg.nodes:
            importers = tuple(r for r, p in enumerate(case.batch.paths) if node in dict(p))
            assert importers == seg.requests, (node, importers, seg.requests)
    if thresholds == (2, 1):  # nothing folds: every node of >= 2 requests is batched
        listed = [node for p in case.batch.paths for node, _ in p]
        assert batched_nodes(case.batch) == {x for x in listed if listed.count(x) >= 2}
    assert max_err(run_backend(FlatBackend(), case, 0.25), want) <= FP32_ATOL


# ------------------------------------------------------------- sliding-window layers


def window_oracle(case: Case, scale: float, w: int) -> torch.Tensor:
    """The oracle with each query at position p seeing only positions p - w + 1 .. p."""
    outs, q0 = [], 0
    for idx, ql in zip(case.batch.kv_indices, case.batch.extend_lens, strict=True):
        for i in range(ql):
            p = len(idx) - ql + i
            keys = idx[max(0, p - w + 1) : p + 1]
            qi = case.q[q0 + i : q0 + i + 1]
            outs.append(
                reference.private_attention(
                    qi, case.k_all[keys], case.v_all[keys], [1], [len(keys)], scale
                )[0]
            )
        q0 += ql
    return torch.cat(outs)


def run_sliding(
    backend: AttentionBackend,
    case: Case,
    scale: float,
    w: int,
    rows: bool,
    sinks: torch.Tensor | None = None,
) -> Any:
    """Plan + one sliding layer's forward; with `rows`, over a pool whose layer keeps its K/V
    in rows of its own (each slot's in a random row), as a sliding pool does."""
    batch, k_before, v_before, k_all, v_all = (
        case.batch, case.k_before, case.v_before, case.k_all, case.v_all
    )  # fmt: skip
    if rows:
        n, (hkv, d) = k_before.shape[0], k_before.shape[1:]
        pool = KVPool(n, 1, hkv, d, k_before.dtype, windows=[w])
        assert pool.swa_of is not None
        pool.swa_of[1:] = torch.randperm(n - 1, generator=torch.Generator().manual_seed(n)) + 1
        at = torch.empty(n, dtype=torch.int64)
        at[pool.swa_of] = torch.arange(n)  # row -> slot
        k_before, v_before, k_all, v_all = (x[at] for x in (k_before, v_before, k_all, v_all))
        batch = ForwardBatch(
            batch.input_ids, batch.positions, batch.out_cache_loc, batch.seq_lens,
            batch.extend_lens, batch.kv_indices, batch.paths, pool,
            swa_kv_indices=[pool.swa_of[s] for s in batch.kv_indices],
        )  # fmt: skip
    batch.window_plans.clear()
    batch.kv_pool.k[0].copy_(k_before)
    batch.kv_pool.v[0].copy_(v_before)
    backend.plan(batch)
    out = backend.forward(case.q, case.k, case.v, 0, batch, scale, window=w, sinks=sinks)
    assert torch.equal(batch.kv_pool.k[0], k_all), "pool K after forward"
    assert torch.equal(batch.kv_pool.v[0], v_all), "pool V after forward"
    return out, batch


@given(
    seed=st.integers(0, 2**31 - 1),
    depth=st.integers(1, 4),
    max_len=st.sampled_from([8, 300]),
    window=st.sampled_from([1, 5, 37, 256]),
    extend=st.booleans(),
    rows=st.booleans(),
    thresholds=st.sampled_from([(2, 1), (3, 16), None]),
    sinks=st.booleans(),
)
def test_random_trees_sliding_fp32(
    seed: int,
    depth: int,
    max_len: int,
    window: int,
    extend: bool,
    rows: bool,
    thresholds: tuple[int, int] | None,
    sinks: bool,
) -> None:
    """Tree and flat attention of a sliding layer == the windowed oracle, decode steps (shared
    K/V inside the windows attended once) and extends (old and recent blocks merged), over
    the slots or rows of their own; with sinks, applied once after those merges."""
    case = random_case(seed, depth, 3, max_len, 3, extend, torch.float32)
    sink = random_sinks(case, seed) if sinks else None
    want = (
        window_oracle(case, 0.25, window) if sink is None else sink_oracle(case, 0.25, sink, window)
    )
    backend = TreeBackend() if thresholds is None else tree(*thresholds)
    for b in (backend, FlatBackend()):
        out, _ = run_sliding(b, case, 0.25, window, rows, sink)
        assert max_err(out, want) <= FP32_ATOL, b


@pytest.mark.parametrize("rows", [False, True], ids=["slots", "rows"])
def test_decode_attends_shared_keys_inside_the_window_once(rows: bool) -> None:
    """Four samples of one 300-token prompt, each 20 tokens on, window 100: the sliding layer
    attends the prompt's last 80 tokens once for all four (its first 220 are out of every
    window), the 20 own tokens apart; two samples 10 tokens on share its last 90."""
    nodes = {1: list(range(1, 201)), 2: list(range(201, 301))}
    prompt = [(1, 200), (2, 100)]
    tails = [list(range(400 + 100 * r, 419 + 100 * r)) for r in range(4)]
    news = [[419 + 100 * r] for r in range(4)]
    tails += [list(range(900, 909)), list(range(950, 959))]
    news += [[909], [959]]
    case = make_case([prompt] * 6, nodes, tails, news, kv_heads=2, group=2, dtype=torch.float32)
    out, batch = run_sliding(tree(2, 1), case, 0.25, 100, rows)
    assert max_err(out, window_oracle(case, 0.25, 100)) <= FP32_ATOL
    plan = batch.window_plans[100]
    assert isinstance(plan, TreePlan)
    in_rows = batch.kv_pool.layer_slots(0, torch.arange(1, 301))
    assert [(s.requests, s.slots.tolist()) for s in plan.segments] == [
        ((0, 1, 2, 3), in_rows[220:].tolist()),
        ((4, 5), in_rows[210:].tolist()),
    ]
    assert [len(p) for p in private_per_request(plan)] == [20] * 4 + [10] * 2


# ------------------------------------------------------------------- attention sinks


def sink_oracle(case: Case, scale: float, sinks: torch.Tensor, w: int = 0) -> torch.Tensor:
    """Each query row's softmax over its visible keys (window `w`, 0: all) and one more logit,
    sinks[h], of a key whose value is zero, written out row by row."""
    group = case.q.shape[1] // case.k.shape[1]
    outs, q0 = [], 0
    for idx, ql in zip(case.batch.kv_indices, case.batch.extend_lens, strict=True):
        kk = case.k_all[idx].repeat_interleave(group, dim=1)  # (S, Hq, D)
        vv = case.v_all[idx].repeat_interleave(group, dim=1)
        for i in range(ql):
            p = len(idx) - ql + i
            lo = max(0, p - w + 1) if w else 0
            s = torch.einsum("hd,shd->hs", case.q[q0 + i], kk[lo : p + 1]) * scale  # (Hq, n)
            probs = torch.cat([s, sinks[:, None]], dim=1).softmax(-1)[:, :-1]
            outs.append(torch.einsum("hs,shd->hd", probs, vv[lo : p + 1]))
        q0 += ql
    return torch.stack(outs)


def random_sinks(case: Case, seed: int) -> torch.Tensor:
    """(Hq,) sink logits of the size of the scores (some heads' sinks take most of the mass)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(case.q.shape[1], generator=g) * 3


@pytest.mark.parametrize("thresholds", [(2, 1), (3, 1), (4, 1)])
def test_sinks_on_the_hand_tree_apply_once_after_the_merge(thresholds: tuple[int, int]) -> None:
    """With segments kept at one and two levels (and none), tree == flat == the oracle; a sink
    applied per part instead would scale each part's output before the merge."""
    plan, case = hand_plan(*thresholds)
    sinks = random_sinks(case, 0)
    want = sink_oracle(case, 0.25, sinks)
    assert max_err(run_backend(tree(*thresholds), case, 0.25, sinks), want) <= FP32_ATOL
    assert max_err(run_backend(FlatBackend(), case, 0.25, sinks), want) <= FP32_ATOL
    assert max_err(want, oracle(case, 0.25)) > 1e-2  # the sinks change the output
    assert bool(plan.segments) == (thresholds != (4, 1))


@given(
    seed=st.integers(0, 2**31 - 1),
    depth=st.integers(1, 4),
    max_len=st.sampled_from([1, 8, 300]),
    group=st.sampled_from([1, 3]),
    extend=st.booleans(),
    thresholds=st.sampled_from([(2, 1), (3, 16), None]),
)
def test_random_trees_with_sinks_fp32(
    seed: int,
    depth: int,
    max_len: int,
    group: int,
    extend: bool,
    thresholds: tuple[int, int] | None,
) -> None:
    case = random_case(seed, depth, 3, max_len, group, extend, torch.float32)
    sinks = random_sinks(case, seed)
    want = sink_oracle(case, 0.25, sinks)
    backend = TreeBackend() if thresholds is None else tree(*thresholds)
    assert max_err(run_backend(backend, case, 0.25, sinks), want) <= FP32_ATOL
    assert max_err(run_backend(FlatBackend(), case, 0.25, sinks), want) <= FP32_ATOL


def test_sinks_in_bf16_round_once() -> None:
    """bf16 queries and K/V: the sink scales the merged float32 state's output, within the
    bf16 bound of the oracle run in float32 on the same values."""
    case = random_case(3, 3, 3, 300, 3, True, torch.bfloat16)
    sinks = random_sinks(case, 3)
    f32 = Case(*(x.float() if isinstance(x, torch.Tensor) else x for x in vars(case).values()))
    want = sink_oracle(f32, 0.25, sinks).to(torch.bfloat16)
    assert bf16_ratio(run_backend(tree(2, 1), case, 0.25, sinks), want) <= 1.0
    assert bf16_ratio(run_backend(FlatBackend(), case, 0.25, sinks), want) <= 1.0


# ------------------------------------------------------------------------ registry


def test_make_backend_registry() -> None:
    assert isinstance(make_backend("tree"), TreeBackend)
    assert isinstance(make_backend("flat"), FlatBackend)
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_backend("paged")
    none = make_backend("none")
    case = make_case([[(1, 3)]], {1: [1, 2, 3]}, [[]], [[4, 5]], kv_heads=1, group=3)
    none.plan(case.batch)
    out = none.forward(case.q, case.k, case.v, 0, case.batch, 1.0)
    assert out.shape == case.q.shape and not bool(out.any())
    assert torch.equal(case.batch.kv_pool.k[0], case.k_all)
