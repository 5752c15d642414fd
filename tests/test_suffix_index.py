"""The radix cache's suffix index (radixserve/kvcache/suffix_index.py): kept in step with the
tree through inserts, splits, evictions and flushes, and its lookup against a direct search
over every cached sequence."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.radix import RadixCache
from radixserve.kvcache.suffix_index import CANDIDATES, MAX_MATCH, ORDER

seqs = st.lists(st.integers(0, 3), min_size=1, max_size=24)
# a cut of one base sequence and a tail: inserts and matches that split edges deep down
branches = st.tuples(st.integers(0, 16), st.lists(st.integers(0, 3), max_size=8))
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), branches),
        st.tuples(st.just("match"), branches),  # may split a node
        st.tuples(st.just("evict"), st.integers(1, 30)),
        st.tuples(st.just("flush"), st.just((0, []))),
    ),
    max_size=14,
)


def make_cache() -> tuple[KVPool, RadixCache]:
    pool = KVPool(512, 1, 1, 4, torch.float32)
    return pool, RadixCache(pool, index_suffixes=True)


def insert(pool: KVPool, cache: RadixCache, tokens: list[int]) -> None:
    slots = pool.alloc(len(tokens))
    assert slots is not None
    cache.insert(tokens, slots)


def cached_prefixes(cache: RadixCache) -> set[tuple[int, ...]]:
    """Every non-empty prefix the tree holds, i.e. every cached position."""
    out: set[tuple[int, ...]] = set()
    stack = [(cache.root, ())]
    while stack:
        node, before = stack.pop()
        for i in range(len(node.key)):
            out.add(before + tuple(node.key[: i + 1]))
        stack.extend((c, before + tuple(node.key)) for c in node.children.values())
    return out


def common_suffix(a: tuple[int, ...], b: list[int]) -> int:
    m = 0
    while m < min(len(a), len(b), MAX_MATCH) and a[-1 - m] == b[-1 - m]:
        m += 1
    return m


@given(
    st.lists(st.integers(0, 3), min_size=16, max_size=16),
    ops,
    st.lists(seqs, min_size=1, max_size=6),
    st.integers(1, 6),
)
def test_the_index_follows_the_tree_and_finds_the_longest_match(
    base: list[int], script: list[tuple[str, object]], queries: list[list[int]], k: int
) -> None:
    pool, cache = make_cache()
    for op, arg in script:
        if op == "evict":
            assert isinstance(arg, int)
            cache.evict(arg)
        elif op == "flush":
            cache.flush()
        else:
            assert isinstance(arg, tuple)
            tokens = base[: arg[0]] + arg[1]
            if op == "match":
                cache.match_prefix(tokens)
            elif tokens:
                insert(pool, cache, tokens)
        cache.check_integrity()  # asserts the index files exactly the tree's positions
    prefixes = cached_prefixes(cache)
    for ids in queries + [base[:cut] for cut in range(ORDER, 17)]:
        match, found = cache.suffix_continuations(ids, k)
        # the positions filed under the query's last ORDER tokens, and those with tokens after
        filed = [p for p in prefixes if len(ids) >= ORDER and p[-ORDER:] == tuple(ids[-ORDER:])]
        followed = [p for p in filed if any(q[: len(p)] == p and len(q) > len(p) for q in prefixes)]
        if not followed:
            assert (match, found) == (0, [])
            continue
        assert ORDER <= match <= MAX_MATCH and 1 <= len(found) <= CANDIDATES
        # each is after a cached position that matches `match` tokens, no two after one
        at = []
        for after in found:
            assert 1 <= len(after) <= k
            at.append(
                [
                    p
                    for p in followed
                    if common_suffix(p, ids) >= match and p + tuple(after) in prefixes
                ]
            )
            assert at[-1], after
        assert len(found) <= len(set().union(*map(set, at)))
        if len(filed) <= CANDIDATES:  # every one was scored: the longest match won
            assert match == max(common_suffix(p, ids) for p in followed)


def test_a_lookup_follows_the_most_recent_branch_after_the_match() -> None:
    pool, cache = make_cache()
    insert(pool, cache, [7, 1, 2, 3, 4, 5])
    insert(pool, cache, [8, 1, 2, 3, 9, 9])  # the same run under another first token
    assert cache.suffix_continuations([6, 1, 2, 3], 10) == (3, [[9, 9], [4, 5]])  # latest first
    assert cache.suffix_continuations([7, 1, 2, 3], 10) == (4, [[4, 5]])  # the longer match
    assert cache.suffix_continuations([5, 2, 3], 10) == (0, [])  # no run 5, 2, 3 cached
    insert(pool, cache, [7, 1, 2, 3, 4, 6])  # splits [4, 5]; now the newer branch
    assert cache.suffix_continuations([0, 2, 3, 4], 1) == (3, [[6]])
    cache.check_integrity()
    assert cache.evict(100) == 13
    assert cache.suffix_continuations([0, 1, 2, 3], 10) == (0, [])
    assert len(cache.suffixes or []) == 0


def test_no_index_unless_asked() -> None:
    pool = KVPool(64, 1, 1, 4, torch.float32)
    cache = RadixCache(pool)
    insert(pool, cache, [1, 2, 3, 4, 5])
    assert cache.suffixes is None
    assert cache.suffix_continuations([1, 2, 3], 4) == (0, [])
