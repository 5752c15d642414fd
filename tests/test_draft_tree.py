"""Token trees of speculative decoding (radixserve/scheduler/draft_tree.py): their shape,
and the tree weighted_tree keeps of several continuations, against a direct count."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.scheduler.draft_model import Growing
from radixserve.scheduler.draft_tree import ROOT, Draft, weighted_tree


def test_a_tree_knows_its_paths_children_and_depth() -> None:
    tree = Draft([5, 6, 7, 8], [ROOT, 0, ROOT, 1])
    assert [tree.path(i) for i in range(4)] == [[0], [0, 1], [2], [0, 1, 3]]
    assert tree.depths == [1, 2, 1, 3] and tree.depth == 3
    assert tree.child(ROOT, 7) == 2 and tree.child(0, 6) == 1 and tree.child(0, 7) is None
    chain = Draft.chain([4, 4, 4])
    assert chain.parents == [ROOT, 0, 1] and chain.depth == 3
    assert Draft().depth == 0 and not Draft()


def test_a_tree_refuses_a_bad_shape() -> None:
    with pytest.raises(AssertionError, match="one token"):
        Draft([5, 5], [ROOT, ROOT])  # two children of the root hold one token
    with pytest.raises(AssertionError):
        Draft([5, 6], [1, ROOT])  # a parent after its child
    with pytest.raises(AssertionError, match="a parent for each token"):
        Draft([5, 6], [ROOT])


def direct_tree(continuations: list[list[int]], k: int, topk: int) -> list[tuple[int, ...]]:
    """The k prefixes most continuations start with (first seen first among equal ones),
    each but the first token's under a kept one, at most topk under one."""
    count: dict[tuple[int, ...], int] = {}  # in first-seen order
    for seq in continuations:
        for end in range(1, len(seq) + 1):
            count[tuple(seq[:end])] = count.get(tuple(seq[:end]), 0) + 1
    order = sorted(enumerate(count), key=lambda e: (-count[e[1]], e[0]))
    kept: list[tuple[int, ...]] = []
    for _, prefix in order:
        up = prefix[:-1]
        under = sum(1 for p in kept if p[:-1] == up)
        if len(kept) < k and (not up or up in kept) and under < topk:
            kept.append(prefix)
    return kept


@given(
    st.lists(st.lists(st.integers(0, 2), max_size=6), max_size=8),
    st.integers(0, 20),
    st.integers(1, 3),
)
def test_the_weighted_tree_keeps_the_prefixes_most_continuations_take(
    continuations: list[list[int]], k: int, topk: int
) -> None:
    tree = weighted_tree(continuations, k, topk)
    paths = [tuple(tree.tokens[i] for i in tree.path(node)) for node in range(len(tree))]
    assert paths == direct_tree(continuations, k, topk)


def test_one_continuation_is_a_chain_and_agreeing_ones_outweigh_the_latest() -> None:
    assert weighted_tree([[1, 2, 3, 4]], 3, 4) == Draft.chain([1, 2, 3])
    # the latest goes 9 9 9, two others 1 2, then apart: 1 2 first, then the latest's
    # (earlier among equally likely nodes)
    tree = weighted_tree([[9, 9, 9], [1, 2, 3], [1, 2, 4]], 4, 4)
    assert tree.tokens == [1, 2, 9, 9] and tree.parents == [ROOT, 0, ROOT, 2]
    # one branch a node: the likeliest chain
    assert weighted_tree([[9, 9, 9], [1, 2, 3], [1, 2, 4]], 4, 1) == Draft.chain([1, 2, 3])


def test_a_draft_model_tree_keeps_its_likeliest_tokens() -> None:
    """Half its draft tokens kept: the chain's first two, then the runners-up where the
    draft model hesitated; drafting stops once a chain token could not make the cut."""
    grow = Growing(agree=0.5)
    grow.add([(5, 0.9), (6, 0.08)])  # chances 0.5 and 0.5 * 0.8 = 0.4
    assert grow.grows(4)
    grow.add([(7, 0.5), (8, 0.3), (9, 0.1)])  # 0.25, then 0.5 * 0.5 * 0.6 = 0.15 and 0.05
    assert grow.grows(4)  # the tail (0.25) is above the 4th likeliest (0.15)
    grow.add([(10, 0.6), (11, 0.2)])  # 0.125
    assert not grow.grows(4)  # the next chain token (at most 0.0625) would not
    assert grow.tree(4, 3) == Draft([5, 6, 7, 8], [ROOT, ROOT, 0, 0])
    assert grow.tree(5, 1) == Draft.chain([5, 7, 10])
    sure = Growing(agree=0.95)  # a draft model the model agrees with: the chain
    for _ in range(4):
        sure.add([(5, 0.4), (6, 0.3)])
    assert sure.tree(4, 4) == Draft.chain([5, 5, 5, 5])
