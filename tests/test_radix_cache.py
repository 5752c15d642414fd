"""RadixCache: exact unit cases (splits, duplicates, locks, LRU order) and a seeded
state-machine property test against a plain dict model, with check_integrity after every step;
the machine inserts and matches under three salts (the shared part and two others), which
the model keeps apart.
NoPrefixCache (the cache off): the same interface, sharing nothing; and the one factory.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from radixserve.config import EngineConfig
from radixserve.core.request import SHARED, CacheSalt
from radixserve.kvcache import radix as radix_module
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.prefix_cache import NoPrefixCache, make_prefix_cache
from radixserve.kvcache.radix import LRU_SLACK, MatchResult, RadixCache, TreeNode


class ManualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make_pool(capacity: int) -> KVPool:
    return KVPool(capacity + 1, num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32)


def slots(pool: KVPool, n: int) -> torch.Tensor:
    out = pool.alloc(n)
    assert out is not None, f"test pool too small for {n} (free {pool.num_free})"
    return out


def free_set(pool: KVPool) -> set[int]:
    """The pool's free slots, read through its public API (take all, give all back)."""
    taken = pool.alloc(pool.num_free)
    assert taken is not None
    pool.free(taken)
    return set(taken.tolist())


def path_slots(node: TreeNode) -> list[int]:
    """Concatenated values from the root down to `node`, by walking parent links."""
    parts: list[list[int]] = []
    while node.parent is not None:
        parts.append(node.value.tolist())
        node = node.parent
    return [s for part in reversed(parts) for s in part]


def scan_evict_order(cache: RadixCache, n: int) -> list[int]:
    """The slots `evict(n)` frees, in order, found the plain way: a heap of every unlocked
    leaf by (last_access, id) from a walk of the whole tree, a parent pushed once its last
    child is gone. Reads the tree only."""
    children: dict[int, int] = {}
    heap = []
    stack = list(cache.roots().values())
    while stack:
        node = stack.pop()
        children[node.id] = len(node.children)
        stack.extend(node.children.values())
        if not node.children and node.lock_ref == 0 and not node.is_root:
            heap.append((node.last_access, node.id, node))
    heapq.heapify(heap)
    freed: list[int] = []
    while len(freed) < n and heap:
        _, _, leaf = heapq.heappop(heap)
        freed += leaf.value.tolist()
        parent = leaf.parent
        assert parent is not None
        children[parent.id] -= 1
        if not parent.is_root and children[parent.id] == 0 and parent.lock_ref == 0:
            heapq.heappush(heap, (parent.last_access, parent.id, parent))
    return freed


def evicted_in_order(cache: RadixCache, n: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Run `cache.evict(n)`; the slots it handed back to the pool, in order."""
    got: list[int] = []
    free = cache.pool.free
    monkeypatch.setattr(cache.pool, "free", lambda s: (got.extend(s.tolist()), free(s)))
    cache.evict(n)
    monkeypatch.undo()
    return got


# -- exact cases ---------------------------------------------------------------------------


def tree_snapshot(node: TreeNode) -> list[tuple[int, tuple[int, ...], float]]:
    """(id, edge, last_access) of every node, depth first in child-key order."""
    out = [(node.id, tuple(node.key), node.last_access)]
    for key in sorted(node.children):
        out += tree_snapshot(node.children[key])
    return out


def test_insert_then_match_returns_stored_slots() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    kv = slots(pool, 4)
    res = cache.insert([5, 6, 7, 8], kv)
    assert res.indices.tolist() == kv.tolist() and res.last_node is not cache.root
    cache.check_integrity()
    assert cache.match_prefix([5, 6, 7, 8, 9]).indices.tolist() == kv.tolist()
    assert cache.match_prefix([5, 6]).indices.tolist() == kv[:2].tolist()
    miss = cache.match_prefix([6, 5])
    assert miss.indices.numel() == 0 and miss.last_node is cache.root
    empty = cache.match_prefix([])
    assert empty.indices.dtype == torch.int64 and empty.last_node is cache.root
    assert (cache.evictable_size, cache.locked_size, cache.total_size) == (4, 0, 4)
    cache.check_integrity()


def test_match_inside_edge_splits_and_id_stays_with_lower_half() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    kv = slots(pool, 5)
    leaf = cache.insert([1, 2, 3, 4, 5], kv).last_node
    leaf_id = leaf.id
    m = cache.match_prefix([1, 2, 9])
    upper = m.last_node
    assert m.indices.tolist() == kv[:2].tolist()
    assert upper.key == [1, 2] and upper.value.tolist() == kv[:2].tolist()
    # The original object keeps its id and the lower half; the upper half is new.
    assert leaf.id == leaf_id and leaf.key == [3, 4, 5] and leaf.parent is upper
    assert upper.id != leaf_id and upper.id > leaf_id
    assert cache.path(leaf) == [(upper.id, 2), (leaf_id, 3)]
    assert cache.path(upper) == [(upper.id, 2)]
    assert cache.path(cache.root) == []
    cache.check_integrity()


def test_insert_frees_duplicate_slots_and_returns_tree_slots() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    a = slots(pool, 3)
    cache.insert([1, 2, 3], a)
    b = slots(pool, 4)
    res = cache.insert([1, 2, 4, 5], b)  # [1, 2] already cached: b[:2] are duplicates
    assert res.indices.tolist() == a[:2].tolist() + b[2:].tolist()
    assert res.last_node.key == [4, 5]
    assert set(b[:2].tolist()) <= free_set(pool)
    assert pool.num_free == 16 - 5 and cache.total_size == 5
    # Fully cached insert: all slots freed, the node ending at the last token returned.
    c = slots(pool, 2)
    again = cache.insert([1, 2], c)
    assert again.indices.tolist() == a[:2].tolist() and again.last_node.key == [1, 2]
    assert pool.num_free == 11
    cache.check_integrity()


def test_insert_keeps_slots_that_are_already_the_trees() -> None:
    """Scheduler pattern: match, compute the rest, insert [tree slots | new slots]."""
    pool = make_pool(16)
    cache = RadixCache(pool)
    a = slots(pool, 4)
    cache.insert([1, 2, 3, 4], a)
    m = cache.match_prefix([1, 2, 3, 7, 8])
    cache.lock(m.last_node)
    new = slots(pool, 2)
    own = torch.cat([m.indices, new])
    cache.check_integrity(in_use_elsewhere=2)
    res = cache.insert([1, 2, 3, 7, 8], own)
    assert res.indices.tolist() == own.tolist()
    assert pool.num_free == 16 - 6  # nothing freed: no duplicates
    cache.lock(res.last_node)
    cache.unlock(m.last_node)
    assert cache.locked_size == 5 and cache.evictable_size == 1
    cache.check_integrity()
    # Mixed: matched 2 tree slots, then another request cached [.., 3, 7]; 2 of ours duplicate.
    mine = torch.cat([a[:2], slots(pool, 3)])
    res2 = cache.insert([1, 2, 3, 7, 9], mine)
    assert res2.indices.tolist() == own[:4].tolist() + mine[4:].tolist()
    assert pool.num_free == 16 - 7
    cache.check_integrity()


def test_insert_copies_slots_out_of_the_callers_tensor() -> None:
    """The caller may pass a view of a req_to_token row that is overwritten later."""
    pool = make_pool(16)
    cache = RadixCache(pool)
    row = torch.zeros(8, dtype=torch.int64)
    row[:3] = slots(pool, 3)
    kept = row[:3].tolist()
    cache.insert([1, 2, 3], row[:3])
    row[:3] = torch.tensor([13, 14, 15])  # the row is reused by another request
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == kept
    cache.check_integrity()


def test_split_keeps_locks_on_both_halves_and_locked_paths_stay_correct() -> None:
    pool = make_pool(32)
    cache = RadixCache(pool)
    kv = slots(pool, 6)
    node = cache.insert([1, 2, 3, 4, 5, 6], kv).last_node
    cache.lock(node)
    cache.lock(node)
    assert cache.locked_size == 6 and cache.evictable_size == 0
    cache.insert([1, 2, 3, 9], slots(pool, 4))  # splits after 3 tokens
    cache.match_prefix([1, 7])  # splits after 1 token
    assert node.key == [4, 5, 6] and node.lock_ref == 2
    assert [n for _, n in cache.path(node)] == [1, 2, 3]
    assert path_slots(node) == kv.tolist()
    mid = node.parent
    assert mid is not None and mid.lock_ref == 2 and mid.key == [2, 3]
    assert mid.parent is not None and mid.parent.lock_ref == 2 and mid.parent.key == [1]
    assert cache.locked_size == 6 and cache.evictable_size == 1
    cache.check_integrity(in_use_elsewhere=0)
    cache.unlock(node)
    assert mid.lock_ref == 1
    cache.unlock(node)
    assert (cache.locked_size, cache.evictable_size) == (0, 7)
    with pytest.raises(AssertionError, match="unlocked"):
        cache.unlock(node)


def test_lru_eviction_order_is_exact() -> None:
    pool = make_pool(16)
    clock = ManualClock()
    cache = RadixCache(pool, clock=clock)
    clock.t = 1
    a = slots(pool, 3)
    cache.insert([1, 2, 3], a)
    clock.t = 2
    b = slots(pool, 2)
    cache.insert([4, 5], b)
    clock.t = 3
    c = slots(pool, 3)
    cache.insert([1, 2, 9], c)  # leaves: [3]@1, [4,5]@2, [9]@3; [1,2]@3
    order = []
    for want in (1, 1, 1, 1):
        before = free_set(pool)
        got = cache.evict(want)
        order.append((got, sorted(free_set(pool) - before)))
        cache.check_integrity()
        if len(order) == 2:
            clock.t = 4
            cache.match_prefix([1, 2])  # refresh [1,2]; [9] stays @3
    assert (
        order
        == [
            (1, [int(a[2])]),
            (2, sorted(b.tolist())),
            (1, [int(c[2])]),  # [1,2] is not a leaf until [9] is gone
            (2, sorted(a[:2].tolist())),
        ]
    )
    assert cache.evict(5) == 0 and pool.num_free == 16


def test_parent_becomes_candidate_only_after_children() -> None:
    pool = make_pool(16)
    clock = ManualClock()
    cache = RadixCache(pool, clock=clock)
    clock.t = 10
    ab = slots(pool, 2)
    cache.insert([1, 2], ab)
    clock.t = 5  # non-monotonic on purpose: parent [1,2] and child [3] both @5
    c = slots(pool, 1)
    cache.insert([1, 2, 3], torch.cat([ab, c]))  # [1,2] slots are the tree's own
    clock.t = 7
    seven = slots(pool, 1)
    cache.insert([7], seven)
    before = free_set(pool)
    # The parent ties the child on time and has the lower id, yet only leaves are candidates.
    assert cache.evict(1) == 1
    assert free_set(pool) - before == {int(c[0])}
    before = free_set(pool)
    assert cache.evict(1) == 2  # now a leaf: [1,2]@5 goes before [7]@7
    assert free_set(pool) - before == set(ab.tolist())
    assert cache.match_prefix([7]).indices.tolist() == seven.tolist()
    cache.check_integrity()
    # evict(2) on a fresh chain frees child then parent in one call.
    cache.insert([4, 5], slots(pool, 2))
    cache.insert([4, 5, 6], slots(pool, 3))
    clock.t = 20
    cache.match_prefix([7])
    assert cache.evict(2) == 3 and cache.match_prefix([4]).indices.numel() == 0
    assert cache.total_size == 1
    cache.check_integrity()


def test_locked_nodes_are_never_evicted() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    kv = slots(pool, 3)
    cache.insert([1, 2, 3], kv)
    cache.insert([1, 2, 4], slots(pool, 3))
    cache.insert([5], slots(pool, 1))
    m = cache.match_prefix([1, 2, 3])
    cache.lock(m.last_node)
    assert (cache.locked_size, cache.evictable_size) == (3, 2)
    assert cache.evict(100) == 2
    assert cache.match_prefix([1, 2, 3]).indices.tolist() == kv.tolist()
    assert cache.match_prefix([1, 2, 4]).indices.numel() == 2
    assert cache.evict(100) == 0
    cache.check_integrity()
    cache.unlock(m.last_node)
    assert cache.evict(1) == 1 and cache.evict(1) == 2  # leaf [3], then its parent [1,2]
    assert pool.num_free == pool.capacity
    with pytest.raises(AssertionError, match="not in the tree"):
        cache.lock(m.last_node)


def test_flush_frees_everything_and_refuses_while_locked() -> None:
    pool = make_pool(16)
    cache = RadixCache(pool)
    node = cache.insert([1, 2, 3], slots(pool, 3)).last_node
    cache.insert([1, 4], slots(pool, 2))
    cache.lock(node)
    with pytest.raises(AssertionError, match="locked"):
        cache.flush()
    cache.unlock(node)
    cache.flush()
    assert pool.num_free == pool.capacity and cache.total_size == 0
    assert cache.match_prefix([1, 2, 3]).last_node is cache.root
    cache.check_integrity()
    new = cache.insert([1], slots(pool, 1)).last_node
    assert new.id > node.id  # ids never reused


def test_no_prefix_cache_keeps_nothing_and_takes_no_slots() -> None:
    pool = make_pool(8)
    cache = NoPrefixCache(pool)
    kv = slots(pool, 5)
    before = kv.tolist()
    res = cache.insert([1, 2, 3, 4, 5], kv)
    # Keeps no prefix and takes none of the slots: all 5 stay the caller's, none freed.
    assert res.indices.tolist() == [] and res.indices.dtype == torch.int64
    assert res.last_node is cache.root and kv.tolist() == before
    assert pool.num_free == 3 and free_set(pool) == {6, 7, 8}
    cache.check_integrity(in_use_elsewhere=5)
    with pytest.raises(AssertionError, match="capacity"):
        cache.check_integrity()  # the caller's 5 slots, unaccounted: a leak
    miss = cache.insert([1, 2, 3, 4, 5], kv)  # the same tokens again: still nothing shared
    assert miss.indices.tolist() == [] and cache.match_prefix([1, 2, 3]).indices.tolist() == []
    assert cache.match_prefix([1, 2, 3]).last_node is cache.root
    assert cache.cached_length([1, 2, 3, 4, 5]) == 0
    assert (cache.evictable_size, cache.locked_size, cache.total_size) == (0, 0, 0)
    assert cache.evict(10) == 0 and pool.num_free == 3
    cache.lock(cache.root)
    cache.lock(cache.root)
    assert cache.path(cache.root) == [] and cache.root.lock_ref == 0
    cache.unlock(cache.root)
    cache.unlock(cache.root)
    cache.flush()  # holds nothing: frees nothing
    assert pool.num_free == 3
    pool.free(kv)  # the caller frees its own K/V when its request ends
    assert pool.num_free == 8
    cache.check_integrity()


def test_no_prefix_cache_refuses_foreign_nodes_and_bad_slots() -> None:
    pool = make_pool(8)
    cache = NoPrefixCache(pool)
    radix = RadixCache(pool)
    foreign = radix.insert([1, 2], slots(pool, 2)).last_node
    for op in (cache.lock, cache.unlock, cache.path):
        with pytest.raises(AssertionError, match="not this cache's root"):
            op(foreign)
    with pytest.raises(AssertionError, match="not this cache's root"):
        cache.lock(radix.root)
    with pytest.raises(AssertionError, match="kv_indices"):
        cache.insert([1, 2, 3], slots(pool, 2))
    with pytest.raises(AssertionError, match="kv_indices"):
        cache.insert([1], torch.tensor([1], dtype=torch.int32))


def test_make_prefix_cache_reads_the_flag() -> None:
    pool = make_pool(8)
    assert type(make_prefix_cache(EngineConfig(), pool)) is RadixCache
    off = make_prefix_cache(EngineConfig(disable_radix_cache=True), pool)
    assert type(off) is NoPrefixCache
    off.check_integrity()


def test_check_integrity_detects_leaks_and_bad_slots() -> None:
    pool = make_pool(8)
    cache = RadixCache(pool)
    cache.insert([1, 2], slots(pool, 2))
    leaked = slots(pool, 1)  # held by nobody the cache is told about
    with pytest.raises(AssertionError, match="capacity"):
        cache.check_integrity()
    cache.check_integrity(in_use_elsewhere=1)
    pool.free(leaked)
    node = cache.match_prefix([1, 2]).last_node
    pool.free(node.value[:1])  # a tree slot wrongly returned to the pool
    with pytest.raises(AssertionError, match="free in pool"):
        cache.check_integrity()


def test_insert_rejects_mismatched_slots() -> None:
    pool = make_pool(8)
    cache = RadixCache(pool)
    with pytest.raises(AssertionError, match="kv_indices"):
        cache.insert([1, 2, 3], slots(pool, 2))
    with pytest.raises(AssertionError, match="kv_indices"):
        cache.insert([1], torch.tensor([1], dtype=torch.int32))


def test_long_sequences_random_ops_stay_consistent() -> None:
    """Seeded random workload with long shared prefixes (exercises the whole-edge fast path)."""
    rng = random.Random(1234)
    pool = make_pool(4000)
    cache = RadixCache(pool)
    bases = [[rng.randrange(50) for _ in range(300)] for _ in range(4)]
    for _ in range(150):
        seq = rng.choice(bases)[: rng.randrange(1, 300)] + [
            rng.randrange(3) for _ in range(rng.randrange(0, 40))
        ]
        m = cache.match_prefix(seq)
        if not pool.can_alloc(len(seq) - len(m.indices)):
            cache.evict(len(seq))
            m = cache.match_prefix(seq)
        new = slots(pool, len(seq) - len(m.indices))
        res = cache.insert(seq, torch.cat([m.indices, new]))
        assert res.indices[: len(m.indices)].tolist() == m.indices.tolist()
        assert cache.match_prefix(seq).indices.tolist() == res.indices.tolist()
    cache.check_integrity()
    cache.flush()
    assert pool.num_free == pool.capacity


def test_only_a_split_moves_paths() -> None:
    """path_version changes with a split (an existing node's path changes) and with nothing
    else: a path read at the same version is exact."""
    pool = make_pool(32)
    cache = RadixCache(pool)
    leaf = cache.insert([1, 2, 3, 4], slots(pool, 4)).last_node
    cache.lock(leaf)
    version, kept = cache.path_version, cache.path(leaf)
    cache.insert([5, 6], slots(pool, 2))  # a new leaf elsewhere
    cache.insert(
        [1, 2, 3, 4, 7], torch.cat([cache.match_prefix([1, 2, 3, 4]).indices, slots(pool, 1)])
    )
    cache.match_prefix([5, 6])
    cache.evict(3)  # [7], then [5, 6]
    cache.unlock(leaf)
    cache.lock(leaf)
    assert cache.path_version == version and cache.path(leaf) == kept
    cache.match_prefix([1, 2, 9])  # splits [1, 2, 3, 4] after 2 tokens
    assert cache.path_version == version + 1
    assert [n for _, n in cache.path(leaf)] == [2, 2] and cache.path(leaf) != kept
    assert cache.split_since(version) == {leaf.id}  # the split node keeps its id
    assert cache.split_since(version + 1) == frozenset()
    cache.unlock(leaf)
    cache.check_integrity()


def test_split_since_forgets_old_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    """split_since names the nodes split after a version while it remembers them
    (SPLIT_LOG splits), and None for a version older than that: read the path again."""
    monkeypatch.setattr(radix_module, "SPLIT_LOG", 4)
    pool = make_pool(64)
    cache = RadixCache(pool)
    split = []
    for i in range(6):  # each second insert splits the first one's node
        key = [10 * i + j for j in range(1, 5)]
        node = cache.insert(key, slots(pool, 4)).last_node
        cache.match_prefix([*key[:2], 99])
        split.append(node.id)
    assert cache.path_version == 6
    assert cache.split_since(5) == {split[5]} and cache.split_since(4) == set(split[4:])
    assert cache.split_since(0) is None  # the log kept only the newest splits


def test_eviction_order_matches_a_whole_tree_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded workload of inserts, matches (LRU touches, splits), locks and evictions: each
    evict frees exactly the slots, in the order, that a scan of the whole tree picks."""
    rng = random.Random(7)
    pool = make_pool(400)
    clock = ManualClock()
    cache = RadixCache(pool, clock=clock)
    locked: list[TreeNode] = []
    for step in range(400):
        clock.t = float(rng.randrange(50))  # ties and non-monotonic times on purpose
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
        op = rng.random()
        if op < 0.45:
            m = cache.match_prefix(seq)
            new = pool.alloc(len(seq) - len(m.indices))
            if new is not None:
                cache.insert(seq, torch.cat([m.indices, new]))
        elif op < 0.65:
            cache.match_prefix(seq)
        elif op < 0.75:
            node = cache.match_prefix(seq).last_node
            cache.lock(node)
            locked.append(node)
        elif op < 0.85 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            n = rng.randrange(1, 12)
            want = scan_evict_order(cache, n)
            assert evicted_in_order(cache, n, monkeypatch) == want, step
        cache.check_integrity()
    for node in locked:
        cache.unlock(node)
    want = scan_evict_order(cache, pool.capacity)
    assert evicted_in_order(cache, pool.capacity, monkeypatch) == want
    assert pool.num_free == pool.capacity and cache.num_nodes == 1


def test_lru_heap_stays_bounded_under_lock_churn() -> None:
    """Locking and unlocking a leaf over and over leaves stale heap entries; the heap is
    rebuilt before they outnumber the evictable leaves (plus a constant)."""
    pool = make_pool(64)
    cache = RadixCache(pool)
    leaves = [cache.insert([i, 1], slots(pool, 2)).last_node for i in range(20)]
    for _ in range(50):
        for leaf in leaves:
            cache.lock(leaf)
            cache.unlock(leaf)
            cache.match_prefix([leaf.key[0], 1])  # an LRU touch: another stale entry
        assert len(cache._lru) <= 2 * len(cache._leaves) + LRU_SLACK
    cache.check_integrity()
    assert cache.evict(40) == 40 and cache.num_nodes == 1


# -- state machine against a dict model ----------------------------------------------------

CAPACITY = 24
TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=7)
SALTS = st.sampled_from([SHARED, CacheSalt("a"), CacheSalt("a", "x")])
Key = tuple[CacheSalt, tuple[int, ...]]  # the model's: (salt, cached token prefix)


@dataclass
class Request:
    tokens: list[int]
    node: TreeNode  # locked; covers tokens[: len(tree_slots)]
    tree_slots: torch.Tensor
    own: torch.Tensor  # slots of tokens[len(tree_slots):], held outside the tree
    salt: CacheSalt = SHARED
    extra: list[int] = field(default_factory=list)


class RadixMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(CAPACITY)
        self.cache = RadixCache(self.pool)
        self.model: dict[Key, int] = {}  # (salt, cached token prefix) -> KV slot of its last
        self.locks: list[tuple[TreeNode, list[int], CacheSalt]] = []
        self.requests: list[Request] = []
        self.kept: list[tuple[TreeNode, int, list[tuple[int, int]]]] = []  # (node, version, path)

    def expected(self, tokens: list[int], salt: CacheSalt) -> list[int]:
        out = []
        for i in range(len(tokens)):
            slot = self.model.get((salt, tuple(tokens[: i + 1])))
            if slot is None:
                break
            out.append(slot)
        return out

    def alloc(self, n: int) -> torch.Tensor | None:
        if not self.pool.can_alloc(n):
            self.checked_evict(n - self.pool.num_free)
        return self.pool.alloc(n)

    def record_insert(self, tokens: list[int], kv: torch.Tensor, salt: CacheSalt) -> MatchResult:
        """Insert and check the result against the model, then update the model."""
        free_before = self.pool.num_free
        want, dups = [], 0
        for i, slot in enumerate(kv.tolist()):
            cached = self.model.setdefault((salt, tuple(tokens[: i + 1])), slot)
            dups += cached != slot
            want.append(cached)
        res = self.cache.insert(tokens, kv, salt=salt)
        assert res.indices.tolist() == want
        assert self.pool.num_free == free_before + dups
        assert sum(n for _, n in self.cache.path(res.last_node)) == len(tokens)
        return res

    def checked_evict(self, n: int) -> None:
        evictable, before = self.cache.evictable_size, free_set(self.pool)
        want = scan_evict_order(self.cache, n)
        freed = self.cache.evict(n)
        newly = free_set(self.pool) - before
        assert sorted(newly) == sorted(want), (sorted(newly), want)  # the scan's leaves
        assert len(newly) == freed
        assert freed >= n if evictable >= n else freed == evictable
        gone = {p for p, s in self.model.items() if s in newly}
        assert len(gone) == freed
        # Removal is closed under extension: a prefix goes only with everything below it.
        for salt, p in gone:
            below = [q for q in self.model if q[0] == salt and q[1][: len(p)] == p]
            assert all(q in gone for q in below), (p, gone)
        for p in gone:
            del self.model[p]

    @rule(tokens=TOKENS, salt=SALTS)
    def insert_fresh(self, tokens: list[int], salt: CacheSalt) -> None:
        kv = self.alloc(len(tokens))
        if kv is not None:
            self.record_insert(tokens, kv, salt)

    @rule(tokens=TOKENS, salt=SALTS)
    def cached_length(self, tokens: list[int], salt: CacheSalt) -> None:
        """The read-only lookup agrees with the model and changes nothing (no split, no LRU)."""
        before = [tree_snapshot(r) for r in self.cache.roots().values()]
        assert self.cache.cached_length(tokens, salt=salt) == len(self.expected(tokens, salt))
        assert [tree_snapshot(r) for r in self.cache.roots().values()] == before

    @rule(tokens=TOKENS, salt=SALTS)
    def match(self, tokens: list[int], salt: CacheSalt) -> None:
        m = self.cache.match_prefix(tokens, salt=salt)
        assert m.indices.tolist() == self.expected(tokens, salt)
        assert path_slots(m.last_node) == m.indices.tolist()
        assert m.last_node is self.cache.root or m.last_node.salt == salt

    @rule(tokens=TOKENS, salt=SALTS)
    def continuations(self, tokens: list[int], salt: CacheSalt) -> None:
        """Every cached continuation is one of the model's sequences of the same salt."""
        for branch in self.cache.continuations(tokens, 4, salt=salt):
            assert (salt, tuple(tokens + branch)) in self.model, (salt, tokens, branch)

    @rule(tokens=TOKENS, salt=SALTS)
    def lock(self, tokens: list[int], salt: CacheSalt) -> None:
        m = self.cache.match_prefix(tokens, salt=salt)
        self.cache.lock(m.last_node)
        self.locks.append((m.last_node, tokens[: len(m.indices)], salt))

    @precondition(lambda self: self.locks)
    @rule(pick=st.integers(0, 99))
    def unlock(self, pick: int) -> None:
        node, _, _ = self.locks.pop(pick % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, CAPACITY + 2))
    def evict(self, n: int) -> None:
        self.checked_evict(n)

    @rule(tokens=TOKENS.filter(bool), salt=SALTS)
    def start_request(self, tokens: list[int], salt: CacheSalt) -> None:
        m = self.cache.match_prefix(tokens, salt=salt)
        self.cache.lock(m.last_node)
        own = self.alloc(len(tokens) - len(m.indices))
        if own is None:
            self.cache.unlock(m.last_node)
            return
        self.requests.append(Request(tokens, m.last_node, m.indices, own, salt))

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 99))
    def prefill_done(self, pick: int) -> None:
        """insert(prompt) -> switch to the tree's slots, lock the new node, unlock the old."""
        req = self.requests[pick % len(self.requests)]
        res = self.record_insert(req.tokens, torch.cat([req.tree_slots, req.own]), req.salt)
        self.cache.lock(res.last_node)
        self.cache.unlock(req.node)
        req.node, req.tree_slots, req.own = res.last_node, res.indices, res.indices[:0]

    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 99), output=TOKENS)
    def finish_request(self, pick: int, output: list[int]) -> None:
        """insert(prompt + output) with its slots, then unlock the node it held."""
        req = self.requests.pop(pick % len(self.requests))
        out_slots = self.alloc(len(output))
        if out_slots is None:
            output, out_slots = [], req.own[:0]
        kv = torch.cat([req.tree_slots, req.own, out_slots])
        self.record_insert(req.tokens + output, kv, req.salt)
        self.cache.unlock(req.node)

    @precondition(lambda self: not self.locks and not self.requests)
    @rule()
    def flush(self) -> None:
        self.cache.flush()
        self.model.clear()
        assert self.pool.num_free == self.pool.capacity

    @invariant()
    def consistent(self) -> None:
        self.cache.check_integrity(in_use_elsewhere=sum(r.own.numel() for r in self.requests))
        assert self.cache.total_size == len(self.model)
        assert all((s, p[:-1]) in self.model for s, p in self.model if len(p) > 1)
        salts = {s for s, _ in self.model}
        assert set(self.cache.roots()) == salts | {SHARED}  # a part lives while it holds tokens
        for node, tokens, salt in self.locks:
            assert node.lock_ref > 0 or node is self.cache.root
            assert sum(n for _, n in self.cache.path(node)) == len(tokens)
            assert path_slots(node) == self.expected(tokens, salt)[: len(tokens)]
        for req in self.requests:
            assert req.node.lock_ref > 0 or req.node is self.cache.root
            assert sum(n for _, n in self.cache.path(req.node)) == req.tree_slots.numel()
            assert path_slots(req.node) == req.tree_slots.tolist()
            want = self.expected(req.tokens, req.salt)[: req.tree_slots.numel()]
            assert want == req.tree_slots.tolist()

    @invariant()
    def kept_paths_are_exact_while_the_version_holds(self) -> None:
        """A path read at the cache's current path_version equals a fresh walk (the locked
        nodes' paths, kept from the last step, as a running request keeps its own)."""
        version = self.cache.path_version
        for node, read_at, path in self.kept:
            if read_at == version and node.parent is not None:
                assert self.cache.path(node) == path, (node, path, self.cache.path(node))
        held = [n for n, _, _ in self.locks] + [r.node for r in self.requests]
        self.kept = [(n, version, self.cache.path(n)) for n in held]

    def teardown(self) -> None:
        for node, _, _ in self.locks:
            self.cache.unlock(node)
        for req in self.requests:
            self.pool.free(req.own)
            self.cache.unlock(req.node)
        self.cache.check_integrity()
        assert self.cache.locked_size == 0
        self.cache.flush()
        assert self.pool.num_free == self.pool.capacity
        self.cache.check_integrity()


RadixMachine.TestCase.settings = settings(stateful_step_count=40)  # examples: conftest profile
TestRadixMachine = RadixMachine.TestCase
