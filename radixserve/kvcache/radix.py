"""Radix tree over token ids that maps every cached prefix to its KV slots (page size 1).

Each node is one edge of the tree: a run of token ids (`key`) and the KV slots holding them
(`value`, same length). The KV of a prefix is the concatenation of the values on the path
from the root to the node where the prefix ends.

Slot accounting (asserted by `check_integrity`):

    pool.capacity == pool.num_free + evictable_size + locked_size + in_use_elsewhere
                     |               |<-- slots held by the tree -->|  |
                     free list       unlocked nodes  locked nodes      slots requests hold
                                                                        outside the tree

Sliding-window layers (a pool with `swa_of`, kvcache/pool.py): a cached token may have lost
its sliding rows (freed once out of every running request's window, or by `trim_swa`: kept
only near the ends where matches stop). A match ending at L needs them for the last
`pool.window` tokens before L (the first query after the prefix sees those), so
`match_prefix` stops at the longest such L; the global layers' K/V of the whole prefix is
reused all the same. `swa_tokens` counts the cached tokens that still have them.

Parts (`CacheSalt`, core/request.py): the tree is a forest over one pool, one root per salt.
Requests share nodes only when their salts are equal: every lookup starts at the root of the
caller's salt, so no match, continuation or suffix draft reaches another part. The shared
part's root (`root`, the default salt) is permanent; another part's root is made by the
first insert under its salt and dropped with its last node. Eviction is one LRU over all
parts, so a part's size is bounded only by the pool.

    roots:   root (shared)     root (tenant "a")     root (tenant "a", salt "u1")   ...
              |     |                  |                       |
            [...] [...]              [...]                   [...]

Roots hold no tokens; a node knows its root (`top`) and its root's salt (`salt`).

The tree is single-threaded: the scheduler owns it and calls it between model steps.
`RadixCache` is the `PrefixCache` (prefix_cache.py) that shares every cached prefix.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from radixserve.core.info import TierStats
from radixserve.core.request import SHARED, CacheSalt
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.suffix_index import CANDIDATES, SuffixIndex, cached_branches

# Called with (token ids of the root-to-leaf path, their KV slots, where the leaf begins,
# the part's salt) just before `evict` frees a leaf's slots: the leaf's ancestors are still
# cached then, so the hook may read the K/V of the whole path (a HiCache demotes it to a
# lower tier, under its salt).
EvictHook = Callable[[list[int], torch.Tensor, int, CacheSalt], None]


class TreeNode:
    """One edge of the radix tree: a run of tokens and the KV slots that hold them.

    Invariants (asserted by `RadixCache.check_integrity`):
      - a root: empty key and value, no parent, lock_ref == 0 (locks stop below a root),
        `top` itself;
      - other nodes: len(key) == value.numel() > 0 and parent.children[key[0]] is self,
        the parent's `top` and `salt`;
      - lock_ref == (locks taken on this node) + sum(child.lock_ref), so a parent's count is
        >= the sum of its children's and an unlocked node has only unlocked descendants;
      - `value` is never written in place: the two halves of a split share its storage.
    `id` is unique within one cache and never reused, so it can name a node in a batch plan.
    """

    __slots__ = (
        "id", "key", "value", "children", "parent", "lock_ref", "last_access", "anchor",
        "top", "salt",
    )  # fmt: skip

    def __init__(
        self,
        node_id: int,
        key: list[int],
        value: torch.Tensor,
        parent: TreeNode | None,
        last_access: float,
        top: TreeNode | None = None,
        salt: CacheSalt = SHARED,
    ) -> None:
        self.id = node_id
        self.key = key
        self.value = value  # (len(key),) int64 KV slots
        self.children: dict[int, TreeNode] = {}  # keyed by the child's first token
        self.parent = parent  # None for the root and for nodes evicted or flushed
        self.lock_ref = 0
        self.last_access = last_access
        # a prompt ends with this node: the window before its end keeps its sliding rows
        # (RadixCache.trim_swa); a split leaves it on the lower half, which keeps the end
        self.anchor = False
        self.top: TreeNode = self if top is None else top  # the root of its part (a root: itself)
        self.salt: CacheSalt = salt if top is None else top.salt  # the part's salt

    @property
    def is_leaf(self) -> bool:
        return not self.children

    @property
    def is_root(self) -> bool:
        return self.top is self

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, children={len(self.children)})"
        )


@dataclass
class MatchResult:
    """KV slots of a matched token prefix and the node where the match ends.

    `indices` stays valid only while `last_node` is locked (or until the next evict/flush).
    """

    indices: torch.Tensor  # (matched_len,) int64 KV slots, root-first order
    last_node: TreeNode  # deepest node of the match, ending exactly at its last token; root if none
    # matched tokens by the tier they came from: "device" (already in the pool), and with a
    # HiCache "host" / "disk" / "remote" (loaded into freshly allocated slots) and "moved"
    # (a run cached at another position, --hicache-reposition); sums to len(indices); empty
    # when nothing matched
    tier_tokens: dict[str, int] = field(default_factory=dict)


LRU_SLACK = 64  # stale heap entries tolerated beyond the live ones before a rebuild
SPLIT_LOG = 4096  # splits remembered by split_since (paths older than that are read again)
# Tokens beyond the window that trim_swa keeps before an end: a match cut back a little
# (to a lower tier's chunk boundary, or one token before a prompt's end) still finds its
# window's sliding rows.
SWA_TAIL_SLACK = 64


def _empty_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _cat(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(values) if values else _empty_slots()


def _near_end(node: TreeNode, reach: int) -> bool:
    """Whether `node` ends fewer than `reach` tokens before the end of the first node at or
    below it that is a leaf, a branch or an anchor (down its one-child chain)."""
    below = 0
    while len(node.children) == 1 and not node.anchor:
        node = next(iter(node.children.values()))
        below += len(node.key)
        if below >= reach:
            return False
    return True


def _values(nodes: list[TreeNode]) -> torch.Tensor:
    """The slots of `nodes` (a path), concatenated."""
    return _cat([n.value for n in nodes])


def check_insert_args(num_tokens: int, kv_indices: torch.Tensor) -> None:
    """The `insert` argument check of every PrefixCache: kv_indices is (num_tokens,) int64."""
    assert kv_indices.dtype == torch.int64 and kv_indices.shape == (num_tokens,), (
        f"kv_indices must be ({num_tokens},) int64, got {tuple(kv_indices.shape)} "
        f"{kv_indices.dtype}"
    )


def _common_prefix_len(key: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]` (at most len(key))."""
    window = tokens[start : start + len(key)]
    if window == key:  # whole-edge match: one C-level list comparison
        return len(key)
    n = 0
    for a, b in zip(key, window, strict=False):  # window may be shorter than key
        if a != b:
            break
        n += 1
    return n


def _counter_clock() -> Callable[[], float]:
    """Default clock: 1.0, 2.0, ... per call, so LRU order is deterministic."""
    counter = itertools.count(1)
    return lambda: float(next(counter))


# Algorithm.
#
# Descend (shared by match_prefix and insert): from the root, follow the child keyed by the
# next token, count how many tokens of its edge agree with the input; a full agreement moves
# on, a partial one splits the edge there and stops. Each edge is compared once, and KV slots
# are gathered as whole-edge tensors, so both calls are O(len(token_ids)) plus one torch.cat.
#
# Split of node N (key k0..kn, value s0..sn) after j tokens:
#
#     parent --(k0..kn)--> N          becomes     parent --(k0..kj-1)--> U --(kj..kn)--> N
#
# The new upper node U gets a fresh id; N keeps its id, its object, its children and the lower
# half. Requests hold references to their deepest node, so keeping the object (and id) on the
# lower half leaves every locked request's node ending at the same token; its path just gains
# U. U copies N's lock_ref and last_access: every lock on N (or below) went through U's place.
#
# Insert: descend as far as the tree already has the tokens; for those positions the caller's
# slots are either the tree's own (the request matched them earlier) or duplicates, which are
# freed; the remaining suffix becomes one new leaf holding a copy of the caller's slots.
#
# Evict: the evictable leaves (lock_ref == 0, no children, not the root) are kept as a set
# beside a min-heap keyed by (last_access, id), both updated by every operation that can make
# a node one or stop it being one (add or remove a leaf, lock, unlock) or touch its
# last_access (the descend); so evict never walks the tree. Pop, free the slots, and the
# parent joins once it is an unlocked leaf itself. Heap entries are lazy: one whose node left
# the set or was touched since is skipped when popped (the heap is rebuilt from the set when
# stale entries outnumber live ones). Ties on last_access go to the lower id, so the order is
# deterministic: the unlocked leaf with the least (last_access, id) goes first, one at a
# time. An unlocked node has only unlocked descendants, so a locked node is never evicted.
#
# Path version: only a split changes an existing node's path (the root-to-node list of
# (id, length)); `path_version` counts splits, so a path read at the same version is exact,
# and `split_since` names the nodes split since a version: a path that lists none of them
# is exact still (the node split keeps its id, and every path through it lists it).


class RadixCache:
    """Token-level prefix cache over a KVPool; the `PrefixCache` that shares every prefix.

    Contract (the interface's, made exact):
      - `match_prefix` never frees or allocates slots; it may split one node.
      - `insert` keeps ALL of `token_ids` and takes ownership of all of `kv_indices`:
        afterwards every one of those slots is either held by the tree or back in the pool.
        It never evicts.
      - `evict` and `flush` return slots to the pool; nodes they remove get `parent = None` and
        any MatchResult pointing into them is stale.
      - Slots of a locked node are never evicted; `lock`/`unlock` on a root are no-ops.
      - Every lookup and insert reads and writes only the part of its `salt` (module
        docstring); a MatchResult that matched nothing ends at `root`, whatever the salt.
    """

    def __init__(
        self,
        pool: KVPool,
        clock: Callable[[], float] | None = None,
        on_evict: EvictHook | None = None,
        index_suffixes: bool = False,
    ) -> None:
        self.pool = pool
        self._on_evict = on_evict
        # where token runs occur, for speculative decoding's suffix lookup
        self.suffixes = SuffixIndex() if index_suffixes else None
        self._clock = clock if clock is not None else _counter_clock()
        self._ids = itertools.count()
        self.root = TreeNode(next(self._ids), [], _empty_slots(), None, self._clock())
        self._roots: dict[CacheSalt, TreeNode] = {SHARED: self.root}  # one per part
        self._evictable = 0  # tokens in nodes with lock_ref == 0
        self._locked = 0  # tokens in nodes with lock_ref > 0
        self.num_nodes = 1  # roots included
        self.path_version = 0  # splits so far: a path read at this version is still exact
        self._splits: list[int] = []  # ids of the nodes split since version _splits_from
        self._splits_from = 0
        self._leaves: set[TreeNode] = set()  # the evictable leaves (see Algorithm)
        self._lru: list[tuple[float, int, TreeNode]] = []  # heap over them, lazy entries
        self.swa_tokens = 0  # cached tokens whose sliding rows are held (module docstring)
        self._swa_nodes: set[TreeNode] = set()  # every node holding some (and maybe others)

    # -- sizes -----------------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def locked_size(self) -> int:
        return self._locked

    @property
    def total_size(self) -> int:
        return self._evictable + self._locked

    # -- lookup and insertion -------------------------------------------------------------

    def roots(self) -> dict[CacheSalt, TreeNode]:
        """The root of every part by salt, the shared `root` included. Do not modify."""
        return self._roots

    def match_prefix(
        self, token_ids: Sequence[int], whole: bool = False, *, salt: CacheSalt = SHARED
    ) -> MatchResult:
        """Longest cached prefix of `token_ids` in `salt`'s part: its KV slots and the node
        ending it; with sliding-window layers, the longest whose window before its end has
        their K/V (module docstring), unless `whole` (what the tree holds, for a caller that
        adds those rows).

        Splits a node when the match ends inside its edge; sets last_access of every node on
        the matched path. No match: empty indices at `root` (the shared part's).
        """
        top = self._roots.get(salt)
        if len(token_ids) == 0 or top is None:
            return MatchResult(_empty_slots(), self.root)
        tokens, now = list(token_ids), self._clock()
        nodes, n = self._descend(tokens, now, top)
        slots = _values(nodes)
        usable = n if whole else self._swa_usable(slots)
        if usable < n:  # the sliding layers' K/V is missing in the last window before n
            nodes, n = self._descend(tokens[:usable], now, top)
            slots = slots[:n]
        return MatchResult(slots, nodes[-1] if nodes else self.root, {"device": n} if n else {})

    def _swa_usable(self, slots: torch.Tensor) -> int:
        """The longest prefix of `slots` whose last pool.window tokens (or all, if fewer)
        hold their sliding rows: the runs of such tokens, the last one long enough."""
        n, w = slots.numel(), self.pool.window
        if not w or n == 0:
            return n
        missing = (~self.pool.has_swa(slots)).nonzero().flatten()
        if missing.numel() == 0:
            return n
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), missing + 1])
        ends = torch.cat([missing, torch.tensor([n])])
        ok = ((ends - starts) >= w) | (starts == 0)
        return int(ends[ok.nonzero().flatten()[-1]])

    def cached_length(self, token_ids: Sequence[int], *, salt: CacheSalt = SHARED) -> int:
        """How many leading tokens of `token_ids` are cached in `salt`'s part. Read-only: no
        split, no LRU touch (for ranking candidates; `match_prefix` is for the one that is
        admitted)."""
        return sum(m for _, m in self._edges(list(token_ids), salt))

    def deepest_node(self, token_ids: Sequence[int], *, salt: CacheSalt = SHARED) -> TreeNode:
        """The deepest node of `salt`'s part sharing a prefix with `token_ids` (`root` if
        none). Read-only."""
        edges = list(self._edges(list(token_ids), salt))
        return edges[-1][0] if edges else self.root

    def continuations(
        self, token_ids: Sequence[int], max_tokens: int, *, salt: CacheSalt = SHARED
    ) -> list[list[int]]:
        """The cached continuations of all of `token_ids` in `salt`'s part: up to CANDIDATES
        branches, the most recently used first, each up to `max_tokens` tokens; [] when no
        cached sequence extends `token_ids`. Read-only."""
        tokens = list(token_ids)
        node, matched, on_edge = self.root, 0, 0
        for child, m in self._edges(tokens, salt):
            node, matched, on_edge = child, matched + m, m
        if matched < len(tokens) or not tokens or max_tokens <= 0:
            return []
        # on_edge >= 1: node is no root
        found = cached_branches(node, on_edge - 1, max_tokens, CANDIDATES)
        return [] if found == [[]] else found

    def suffix_continuations(
        self, token_ids: Sequence[int], max_tokens: int, *, salt: CacheSalt = SHARED
    ) -> tuple[int, list[list[int]]]:
        """(match length, up to `max_tokens` tokens after each) of the cache's best
        occurrences of the end of `token_ids` anywhere in `salt`'s part (suffix_index.py);
        (0, []) for none or when the cache keeps no suffix index. Read-only."""
        top = self._roots.get(salt)
        if self.suffixes is None or top is None:
            return 0, []
        return self.suffixes.lookup(token_ids, max_tokens, top)

    def insert(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, *, salt: CacheSalt = SHARED
    ) -> MatchResult:
        """Cache `token_ids` whose K/V sit at `kv_indices` in `salt`'s part; takes ownership
        of `kv_indices`.

        Positions already cached keep the tree's slots; caller slots there that differ from the
        tree's are duplicates and are freed to the pool. Returns the tree's slots for ALL of
        `token_ids` and the node ending at its last token (the caller may switch to those slots
        and lock that node). Raises AssertionError if kv_indices is not (len(token_ids),) int64.
        """
        tokens = list(token_ids)
        check_insert_args(len(tokens), kv_indices)
        if not tokens:
            return MatchResult(_empty_slots(), self.root)
        now = self._clock()
        top = self._roots.get(salt) or self._new_root(salt, now)
        nodes, pos = self._descend(tokens, now, top)
        node = nodes[-1] if nodes else top
        cached = _values(nodes)  # (pos,) the tree's slots for tokens[:pos]
        given = kv_indices[:pos]
        twice = given != cached  # duplicates; equal slots are the tree's own
        if self.pool.window and bool(twice.any()):
            self._adopt_swa(nodes, cached[twice], given[twice])
        self.pool.free(given[twice])
        if pos == len(tokens):
            return MatchResult(cached, node)
        leaf = self._add_leaf(node, tokens[pos:], kv_indices[pos:].clone(), now)
        return MatchResult(torch.cat([cached, leaf.value]), leaf)

    def _adopt_swa(self, path: list[TreeNode], cached: torch.Tensor, given: torch.Tensor) -> None:
        """The caller's duplicates `given` give their sliding rows to the tree's `cached`
        tokens (on `path`) that lack them."""
        moved = int(self.pool.adopt_swa(cached, given).sum())
        self.swa_tokens += moved
        for node in path if moved else []:
            self._push_swa(node)

    def _new_root(self, salt: CacheSalt, now: float) -> TreeNode:
        """The root of a new part (`insert` adds a leaf under it at once)."""
        top = TreeNode(next(self._ids), [], _empty_slots(), None, now, salt=salt)
        self._roots[salt] = top
        self.num_nodes += 1
        return top

    def _edges(
        self, tokens: list[int], part: CacheSalt | TreeNode
    ) -> Iterator[tuple[TreeNode, int]]:
        """(child, tokens matched on its edge) along the longest cached prefix of `tokens`
        below the root `part` (or that of the salt `part`; nothing if it has none), root
        first; only the last edge may be matched partway. Reads the tree only."""
        node = part if isinstance(part, TreeNode) else self._roots.get(part)
        pos = 0
        while node is not None and pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                return
            m = _common_prefix_len(child.key, tokens, pos)
            yield child, m
            if m < len(child.key):
                return
            node, pos = child, pos + m

    def _descend(self, tokens: list[int], now: float, top: TreeNode) -> tuple[list[TreeNode], int]:
        """Walk down the longest cached prefix of `tokens` below the root `top`, splitting
        where it ends mid-edge.

        Returns (the matched nodes root-first, matched length).
        """
        nodes, pos = [], 0
        top.last_access = now
        for child, m in list(self._edges(tokens, top)):  # list first: a split mutates the tree
            if m < len(child.key):
                child = self._split(child, m)  # the new upper node: exactly the matched part
            child.last_access = now
            if child in self._leaves:  # its old heap entry is stale now
                self._push_lru(child)
            nodes.append(child)
            pos += m
        return nodes, pos

    def _split(self, node: TreeNode, k: int) -> TreeNode:
        """Cut `node`'s edge after `k` tokens; returns the new upper node (fresh id).

        `node` keeps its object, id, children and lower half; sizes are unchanged because
        both halves have the same lock_ref.
        """
        parent = node.parent
        assert parent is not None and 0 < k < len(node.key), f"bad split {node} at {k}"
        upper = TreeNode(
            next(self._ids), node.key[:k], node.value[:k], parent, node.last_access, node.top
        )
        upper.lock_ref = node.lock_ref
        upper.children[node.key[k]] = node
        parent.children[node.key[0]] = upper
        self.num_nodes += 1
        self.path_version += 1
        self._splits.append(node.id)
        if len(self._splits) > SPLIT_LOG:  # forget the older half
            del self._splits[: SPLIT_LOG // 2]
            self._splits_from = self.path_version - len(self._splits)
        node.parent = upper
        node.key = node.key[k:]
        node.value = node.value[k:]
        if self.suffixes is not None:
            self.suffixes.split(upper, node)
        self._push_swa(upper)
        return upper

    def split_since(self, version: int) -> frozenset[int] | None:
        """Ids of the nodes split after `version` (module comment, "Path version"), or None
        when that is older than the splits remembered (SPLIT_LOG)."""
        if version < self._splits_from:
            return None
        return frozenset(self._splits[version - self._splits_from :])

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, now: float
    ) -> TreeNode:
        assert key[0] not in parent.children, f"token {key[0]} already under {parent}"
        leaf = TreeNode(next(self._ids), key, value, parent, now, parent.top)
        parent.children[key[0]] = leaf
        self._evictable += len(key)
        self.num_nodes += 1
        self._leaves.discard(parent)  # a leaf no more
        self._update_evictable(leaf)
        if self.suffixes is not None:
            self.suffixes.add(leaf)
        if self.pool.window:
            self.swa_tokens += int(self.pool.has_swa(value).sum())
            self._push_swa(leaf)
        return leaf

    # -- locking ---------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """lock_ref += 1 on `node` and every ancestor below its root; pins their slots.

        Raises AssertionError if `node` is no longer in the tree (evicted or flushed).
        """
        while not node.is_root:
            parent = node.parent
            assert parent is not None, f"lock of a node not in the tree: {node}"
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._locked += len(node.key)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises AssertionError if a lock_ref on the path is 0."""
        while not node.is_root:
            parent = node.parent
            assert parent is not None, f"unlock of a node not in the tree: {node}"
            assert node.lock_ref > 0, f"unlock of an unlocked node: {node}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked -= len(node.key)
                self._evictable += len(node.key)
                self._update_evictable(node)
            node = parent

    def path(self, node: TreeNode) -> list[tuple[int, int]]:
        """[(node.id, len(node.key)), ...] from its root's child down to `node`, root
        excluded."""
        out: list[tuple[int, int]] = []
        while not node.is_root:
            parent = node.parent
            assert parent is not None, f"path of a node not in the tree: {node}"
            out.append((node.id, len(node.key)))
            node = parent
        out.reverse()
        return out

    # -- freeing ---------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots from unlocked leaves, least recently used first.

        A parent becomes a candidate once its children are gone. Frees fewer only when the
        whole evictable part of the tree is gone. Returns the number of slots freed.
        """
        freed: list[torch.Tensor] = []
        n = 0
        while n < num_tokens and (leaf := self._pop_lru()) is not None:
            self._remove_leaf(leaf)
            freed.append(leaf.value)
            n += len(leaf.key)
        if freed:  # one free for all the leaves
            self.pool.free(freed[0] if len(freed) == 1 else torch.cat(freed))
        return n

    def _remove_leaf(self, leaf: TreeNode) -> None:
        """Take `leaf` out of the tree; its slots are the caller's to free."""
        parent = leaf.parent
        assert parent is not None and leaf.is_leaf and leaf.lock_ref == 0, f"bad evict {leaf}"
        if self._on_evict is not None:
            self._on_evict(*self._path_kv(leaf), leaf.salt)
        if self.suffixes is not None:
            self.suffixes.remove(leaf)
        if self.pool.window:
            self.swa_tokens -= int(self.pool.has_swa(leaf.value).sum())
            self._swa_nodes.discard(leaf)
        del parent.children[leaf.key[0]]
        self._evictable -= len(leaf.key)
        self.num_nodes -= 1
        leaf.parent = None
        self._leaves.discard(leaf)
        self._update_evictable(parent)
        if parent.is_root and not parent.children and parent is not self.root:
            del self._roots[parent.salt]  # the part's last node: the part goes too
            self.num_nodes -= 1

    # -- the evictable leaves (see Algorithm) ---------------------------------------------

    def _update_evictable(self, node: TreeNode) -> None:
        """Put `node` in the evictable set (and the heap) or take it out, as it is now."""
        if node.lock_ref == 0 and not node.children and not node.is_root:
            if node not in self._leaves:
                self._leaves.add(node)
                self._push_lru(node)
        else:
            self._leaves.discard(node)

    def _push_lru(self, node: TreeNode) -> None:
        heapq.heappush(self._lru, (node.last_access, node.id, node))
        if len(self._lru) > 2 * len(self._leaves) + LRU_SLACK:  # mostly stale: rebuild
            self._lru = [(n.last_access, n.id, n) for n in self._leaves]
            heapq.heapify(self._lru)

    def _pop_lru(self) -> TreeNode | None:
        """The evictable leaf with the least (last_access, id), or None if there is none."""
        while self._lru:
            access, _, node = heapq.heappop(self._lru)
            if node in self._leaves and node.last_access == access:
                return node
        return None

    # -- sliding rows (module docstring) -------------------------------------------------

    def trim_swa(self, spared: set[int], keep_ends: bool = True) -> int:
        """Free the sliding rows of cached tokens: every node's but the `spared` ones' (ids:
        the running requests' windows) and, with `keep_ends`, those that a likely match
        needs, within window + SWA_TAIL_SLACK tokens before the end of a leaf, a branch or
        an anchor (a prompt's end). Returns how many rows it freed."""
        reach = self.pool.window + SWA_TAIL_SLACK
        freed = 0
        for node in list(self._swa_nodes):
            if node.parent is None:  # evicted or flushed
                self._swa_nodes.discard(node)
            elif node.id not in spared and not (keep_ends and _near_end(node, reach)):
                n = self.pool.free_swa(node.value)
                self.swa_tokens -= n
                freed += n
                self._swa_nodes.discard(node)
        return freed

    def _push_swa(self, node: TreeNode) -> None:
        if self.pool.window:
            self._swa_nodes.add(node)

    def _path_kv(self, node: TreeNode) -> tuple[list[int], torch.Tensor, int]:
        """(tokens, slots) of the path from the root to `node`, and where `node` begins."""
        keys: list[list[int]] = []
        values: list[torch.Tensor] = []
        while not node.is_root:
            assert node.parent is not None, f"path of a node not in the tree: {node}"
            keys.append(node.key)
            values.append(node.value)
            node = node.parent
        tokens = [t for key in reversed(keys) for t in key]
        return tokens, _cat(values[::-1]), len(tokens) - len(keys[0])

    def flush(self) -> None:
        """Free every cached slot and empty the tree. Asserts that nothing is locked."""
        assert self._locked == 0, f"flush with {self._locked} locked tokens"
        nodes = [n for n in self._iter_nodes() if not n.is_root]
        self.pool.free(_cat([n.value for n in nodes]))
        for n in nodes:
            n.parent = None
            n.children = {}
        self.root.children = {}
        self._roots = {SHARED: self.root}
        self._evictable = 0
        self.num_nodes = 1
        self._leaves.clear()
        self._lru.clear()
        self.swa_tokens = 0
        self._swa_nodes.clear()
        if self.suffixes is not None:
            self.suffixes.clear()

    def tier_stats(self) -> dict[str, TierStats]:
        return {}

    def prefetch(self, queued: Sequence[tuple[Sequence[int], CacheSalt]]) -> None:
        """Everything this cache holds is in the pool already."""

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """Every node of every part, roots included, parents before children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- self-check ------------------------------------------------------------------------

    def check_integrity(self, in_use_elsewhere: int = 0) -> None:
        """Assert every tree invariant and the slot accounting of the module docstring.

        `in_use_elsewhere`: slots the caller holds outside the tree (e.g. running requests'
        uncached tokens). Raises AssertionError with the offending values.
        """
        assert self._roots[SHARED] is self.root, "the shared part's root was replaced"
        for salt, root in self._roots.items():
            assert root.parent is None and not root.key and root.value.numel() == 0, f"bad {root}"
            assert root.lock_ref == 0, f"a root must never be locked: {root}"
            assert root.is_root and root.salt == salt, f"{root} filed under {salt}"
            assert root is self.root or root.children, f"the part of {salt} is empty"
        evictable = locked = 0
        ids: set[int] = set()
        values: list[torch.Tensor] = []
        for node in self._iter_nodes():
            assert node.id not in ids, f"node id {node.id} appears twice"
            ids.add(node.id)
            self._check_children(node)
            if not node.is_root:
                values.append(node.value)
                if node.lock_ref == 0:
                    evictable += len(node.key)
                else:
                    locked += len(node.key)
        assert len(ids) == self.num_nodes, f"num_nodes {self.num_nodes}, tree has {len(ids)}"
        assert (evictable, locked) == (self._evictable, self._locked), (
            f"size counters (evictable, locked)={(self._evictable, self._locked)}, "
            f"tree has {(evictable, locked)}"
        )
        self._check_lru()
        self._check_slots(_cat(values), in_use_elsewhere)
        self._check_swa(_cat(values))
        if self.suffixes is not None:
            self.suffixes.check(self._iter_nodes())

    def _check_lru(self) -> None:
        """The evictable set is exactly the unlocked leaves, each with a live heap entry."""
        scan = {n for n in self._iter_nodes() if n.is_leaf and n.lock_ref == 0 and not n.is_root}
        assert scan == self._leaves, (
            f"evictable set {sorted(n.id for n in self._leaves)}, "
            f"unlocked leaves {sorted(n.id for n in scan)}"
        )
        live = {(access, node_id) for access, node_id, _ in self._lru}
        missing = [n for n in self._leaves if (n.last_access, n.id) not in live]
        assert not missing, f"evictable leaves without a heap entry: {missing}"

    def _check_swa(self, slots: torch.Tensor) -> None:
        """swa_tokens counts the cached tokens with sliding rows, and trim_swa sees every
        node that has some."""
        if not self.pool.window:
            return
        held = int(self.pool.has_swa(slots).sum())
        assert held == self.swa_tokens, f"swa_tokens {self.swa_tokens}, the tree holds {held}"
        lost = [
            n
            for n in self._iter_nodes()
            if not n.is_root and n not in self._swa_nodes and bool(self.pool.has_swa(n.value).any())
        ]
        assert not lost, f"nodes with sliding rows that trim_swa does not see: {lost}"

    def _check_children(self, node: TreeNode) -> None:
        child_locks = 0
        for first, child in node.children.items():
            assert child.parent is node, f"{child} under {node} has parent {child.parent}"
            assert child.top is node.top and child.salt == node.salt, f"{child} left its part"
            assert child.key and child.key[0] == first, f"{child} keyed by {first}"
            assert child.value.dtype == torch.int64 and child.value.shape == (len(child.key),), (
                f"{child}: value {tuple(child.value.shape)} {child.value.dtype}, "
                f"key length {len(child.key)}"
            )
            assert child.lock_ref >= 0, f"negative lock_ref: {child}"
            child_locks += child.lock_ref
        if not node.is_root:
            assert node.lock_ref >= child_locks, f"{node} below its children's {child_locks}"

    def _check_slots(self, slots: torch.Tensor, in_use_elsewhere: int) -> None:
        pool = self.pool
        if slots.numel() > 0:
            assert int(slots.min()) > 0, "scratch slot 0 is in the tree"
            assert int(slots.unique().numel()) == slots.numel(), "a KV slot appears twice"
            free_in_tree = slots[pool.is_free(slots)]
            assert free_in_tree.numel() == 0, f"tree slots free in pool: {free_in_tree.tolist()}"
        total = pool.num_free + self.total_size + in_use_elsewhere
        assert total == pool.capacity, (
            f"free {pool.num_free} + evictable {self._evictable} + locked {self._locked} + "
            f"elsewhere {in_use_elsewhere} = {total} != capacity {pool.capacity}"
        )
