"""KV lifecycle of a sample: admit, extend, cache, release, retract.

Slot ownership (see sample.py's region table): positions < tree_len belong to the prefix cache
(kept alive by the lock on last_node); positions tree_len..kv_len-1 belong to the request.
Every slot is always owned by exactly one of: the pool's free list, the prefix cache, or one
admitted request — `check_integrity` counts them. With a NoPrefixCache tree_len stays 0: the
request owns all its K/V and frees it when it ends. A sample importing prompt modules starts
with tree_len = kv_len = its module tokens, whose slots the ModuleStore owns (pinned, counted
as in use elsewhere); its own K/V is never offered to the prefix cache. A sample matches and
offers its K/V under its request's salt (`Sample.salt`): only samples of the same salt share it.
"""

from __future__ import annotations

import torch

from radixserve.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.kvcache.prefix_cache import PrefixCache
from radixserve.kvcache.radix import TreeNode
from radixserve.scheduler.modules import ModuleStore
from radixserve.scheduler.sample import Sample

# A reservation that must evict frees up to this many slots more than it needs (at most
# 1/64 of the pool), so that the next decode steps take their slots from the free list: an
# eviction's fixed cost, its first touch of the tree's and the pool's structures after the
# model's forward has left them out of the caches, is then paid once every few steps (Zen 4,
# a ~10k-node tree of 3-token leaves, caches flushed before each: 16 tokens take 95 us, 64
# take 215, 256 take 700).
EVICT_AHEAD = 1024


class KVManager:
    def __init__(self, pool: KVPool, req_pool: ReqToTokenPool, cache: PrefixCache) -> None:
        self.pool = pool
        self.req_pool = req_pool
        self.cache = cache
        self.modules = ModuleStore()
        self.admitted: set[Sample] = set()  # samples holding a table row
        self._swa_mark = 0  # sliding rows held when the cache is trimmed next (trim_swa)
        self._evict_ahead = min(EVICT_AHEAD, pool.capacity // 64)

    def trim_swa(self, pressed: bool = False) -> None:
        """Free the sliding-window layers' K/V that no query will read: an admitted sample's
        next queries (positions >= kv_len) see no key before kv_len - window + 1. Its own
        older tokens' go at once. The cache's, but those of the nodes an admitted sample's
        window reaches and those near the ends where matches stop, go whenever a window's
        worth more rows are held than after the last such trim; `pressed` (rows are short),
        near the ends too."""
        window = self.pool.window
        if not window:
            return
        for r in self.admitted:
            first = r.kv_len - window + 1  # the first position the next queries see
            own = max(r.tree_len, r.swa_from)
            if first > own:
                self.pool.free_swa(self.slots(r, first)[own:])
                r.swa_from = first
        if self.pool.swa_used <= self._swa_mark and not pressed:
            return
        spared: set[int] = set()
        for r in self.admitted:
            node, end = r.last_node, r.tree_len
            assert node is not None, f"{r.rid} is admitted without a cache node"
            while not node.is_root and end > r.kv_len - window:
                assert node.parent is not None, f"{r.rid} left the tree"
                spared.add(node.id)
                end -= len(node.key)
                node = node.parent
        self.cache.trim_swa(spared, keep_ends=not pressed)
        self._swa_mark = self.pool.swa_used + window

    @property
    def available(self) -> int:
        """Slots obtainable now: free plus evictable (each with a sliding row, where the
        cache's and the free ones are enough)."""
        slots = self.pool.num_free + self.cache.evictable_size
        if not self.pool.window:
            return slots
        return min(slots, self.pool.swa_free + self.cache.swa_tokens)

    def slots(self, req: Sample, end: int | None = None) -> torch.Tensor:
        assert req.row is not None, f"{req.rid} is not admitted"
        return self.req_pool.table[req.row, : req.kv_len if end is None else end]

    def reserve(self, n: int) -> bool:
        """Make `n` slots free, each with a sliding row (evicting unlocked cache leaves if
        needed, EVICT_AHEAD more where there are, and the cache's sliding rows that no running
        window reaches first); False if impossible."""
        if self.pool.num_free < n:
            self.cache.evict(n - self.pool.num_free + self._evict_ahead)
        if self.pool.swa_free < n:
            self.trim_swa(pressed=True)
            while self.pool.swa_free < n and self.cache.evict(n - self.pool.swa_free) > 0:
                pass
        return self.pool.can_alloc(n)

    def admit(self, req: Sample) -> bool:
        """Give a waiting sample a table row and its cached prefix (locked). False: no row."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        if req.request.modules is not None:
            self._admit_modules(req, row)
            return True
        match = self.cache.match_prefix(req.all_ids[: req.reuse_limit()], salt=req.salt)
        self.cache.lock(match.last_node)
        n = len(match.indices)
        self.req_pool.table[row, :n] = match.indices
        req.row, req.last_node, req.tree_len, req.kv_len = row, match.last_node, n, n
        req.path = None
        self.admitted.add(req)
        if req.cached_tokens < 0:
            req.cached_tokens = min(n, len(req.prompt_ids))
            req.cached_tiers = dict(match.tier_tokens)
        return True

    def _admit_modules(self, req: Sample, row: int) -> None:
        assert req.request.modules is not None
        slots = self.modules.slots(req.request.modules)
        n = slots.numel()
        self.req_pool.table[row, :n] = slots
        req.row, req.last_node, req.tree_len, req.kv_len = row, self.cache.root, n, n
        req.path = None
        self.admitted.add(req)
        if req.cached_tokens < 0:
            req.cached_tokens = n

    def unadmit(self, req: Sample) -> None:
        """Undo `admit` before any K/V was computed (the prefix stays cached)."""
        assert req.kv_len == req.tree_len, "unadmit after an extend would leak slots"
        self._drop(req)

    def extend(self, req: Sample, n: int, skip: int = 0) -> None:
        """Allocate slots for the `n` positions after the next `skip` (allocated already);
        the caller reserved them."""
        slots = self.pool.alloc(n)
        assert slots is not None, f"extend of {n} slots without a reservation"
        assert req.row is not None
        start = req.kv_len + skip
        self.req_pool.table[req.row, start : start + n] = slots
        req.alloc_end = start + n

    def extend_each(
        self, work: list[tuple[Sample, int]], rows: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """`extend(req, n)` for each pair, in order. When every n is 1 (a decode step) the
        same slots come from one allocation and go into the table in one write, and are
        returned ((B,) int64, in order); `rows`: the samples' table rows, when known."""
        if any(n != 1 for _, n in work):
            for req, n in work:
                self.extend(req, n)
            return None
        slots = self.pool.alloc(len(work), in_order=False)  # as len(work) single allocations
        assert slots is not None, f"extend of {len(work)} slots without a reservation"
        assert all(r.row is not None for r, _ in work), "extend of a sample not admitted"
        if rows is None:
            rows = torch.tensor([r.row for r, _ in work], dtype=torch.int64)  # (B,)
        cols = [r.kv_len for r, _ in work]
        self.req_pool.table.numpy()[rows.numpy(), cols] = slots.numpy()  # numpy: half the time
        for (sample, _), col in zip(work, cols):
            sample.alloc_end = col + 1
        return slots

    def settle_draft(self, req: Sample, start: int, size: int, kept: list[int]) -> None:
        """Positions start .. start + size - 1 hold the slots of a speculative draft's nodes;
        keep those of the nodes `kept` (a path, in order) at positions start, start + 1, ..
        and free the others."""
        assert req.row is not None, f"{req.rid} is not admitted"
        drafted = self.req_pool.table[req.row, start : start + size].clone()
        keep = torch.tensor(kept, dtype=torch.int64)
        self.req_pool.table[req.row, start : start + len(kept)] = drafted[keep]
        dropped = torch.ones(size, dtype=torch.bool)
        dropped[keep] = False
        self.pool.free(drafted[dropped])
        req.alloc_end = start + len(kept)

    def path(self, req: Sample) -> list[tuple[int, int]]:
        """The shared runs at the start of the request's K/V as (node id, tokens): its radix
        path, or its prompt modules. Kept on the request and read again only when it may
        have changed: last_node moved (the path was cleared then) or a node on it was split
        (`PrefixCache.split_since`). Do not modify the list."""
        assert req.last_node is not None, f"{req.rid} runs without a cache node"
        use = req.request.modules
        if use is not None:  # pinned while the request runs: read once
            if req.path is None:
                req.path = self.modules.path(use)
            return req.path
        kept = req.path if self._path_current(req) else None
        path = kept if kept is not None else self.cache.path(req.last_node)
        req.path, req.path_version = path, self.cache.path_version
        return path

    def _path_current(self, req: Sample) -> bool:
        """Whether the radix path kept on `req` is exact: read at the cache's path_version,
        or no node on it was split since (the other samples' splits leave it as it is)."""
        if req.path is None:
            return False
        version = self.cache.path_version
        if req.path_version == version:
            return True
        split = self.cache.split_since(req.path_version)
        return split is not None and not any(node in split for node, _ in req.path)

    def cache_prefix(self, req: Sample) -> None:
        """Offer the request's computed K/V to the cache; the request goes on using it.

        The prefix the cache keeps (all of it for a RadixCache, none for a NoPrefixCache)
        switches to the cache's slots and becomes positions < tree_len, locked through the
        new last_node; the rest stays the request's.
        """
        assert req.row is not None and req.last_node is not None
        if req.request.modules is not None:
            return  # module K/V sits at other positions than its tokens' index: not a prefix
        match = self.cache.insert(req.all_ids[: req.kv_len], self.slots(req).clone(), salt=req.salt)
        n = len(match.indices)
        assert req.tree_len <= n <= req.kv_len, (
            f"{req.rid}: the cache kept {n} of {req.kv_len} tokens, {req.tree_len} already"
        )
        self.req_pool.table[req.row, :n] = match.indices
        if n == len(req.prompt_ids):  # where a later match of the prompt stops
            self._anchor(match.last_node)
        self.cache.lock(match.last_node)
        self.cache.unlock(req.last_node)
        if match.last_node is not req.last_node:
            req.last_node, req.path = match.last_node, None
        req.tree_len = n

    def _anchor(self, node: TreeNode) -> None:
        """Mark `node` the end of a prompt (RadixCache.trim_swa keeps the sliding-window K/V
        before it) in place of the prompt ends above it: an earlier turn's prompt is seldom
        sent again once the conversation went on."""
        if node.is_root:
            return
        node.anchor = True
        above = node.parent
        while above is not None and not above.is_root:
            above.anchor = False
            above = above.parent

    def fork(self, parent: Sample, child: Sample) -> bool:
        """Let `child` share all of `parent`'s K/V through the cache's lock on it. False when
        the cache does not hold all of it (a NoPrefixCache holds none) or no row is free."""
        if parent.tree_len < parent.kv_len:
            return False
        row = self.req_pool.alloc()
        if row is None:
            return False
        assert parent.last_node is not None
        self.cache.lock(parent.last_node)
        self.req_pool.table[row, : parent.kv_len] = self.slots(parent)
        child.row, child.last_node, child.path = row, parent.last_node, None
        child.tree_len = child.kv_len = parent.kv_len
        self.admitted.add(child)
        child.cached_tokens = parent.cached_tokens
        child.cached_tiers = parent.cached_tiers
        return True

    def release(self, req: Sample) -> None:
        """Finished, aborted or retracted: the cache keeps what it takes of its K/V (see
        `cache_prefix`); the rest, and the slots of a step that failed before it was
        processed (positions kv_len .. alloc_end - 1), go back to the pool now."""
        if req.row is None:
            return
        self.cache_prefix(req)
        self.pool.free(self.slots(req, max(req.kv_len, req.alloc_end))[req.tree_len :].clone())
        self._drop(req)

    def _drop(self, req: Sample) -> None:
        assert req.row is not None and req.last_node is not None
        self.cache.unlock(req.last_node)
        self.req_pool.free(req.row)
        req.row, req.last_node, req.tree_len, req.kv_len = None, None, 0, 0
        req.swa_from = 0
        self.admitted.discard(req)
        req.path, req.alloc_end = None, 0

    def owned_by_requests(self, reqs: list[Sample]) -> int:
        return sum(r.kv_len - r.tree_len for r in reqs if r.row is not None)

    def check_integrity(self, reqs: list[Sample]) -> None:
        """The cache's own check with the slots `reqs` hold, and every path kept on a
        request that `path` would still return equal to a fresh walk."""
        held = self.owned_by_requests(reqs) + self.modules.num_slots
        self.cache.check_integrity(in_use_elsewhere=held)
        self.pool.check_swa()
        for r in reqs:
            assert r.alloc_end <= r.kv_len, f"{r.rid}: slots to {r.alloc_end}, K/V to {r.kv_len}"
            use = r.request.modules
            if r.path is None or (use is None and not self._path_current(r)):
                continue  # read again at its next use
            assert r.last_node is not None, f"{r.rid}: a path kept without a node"
            fresh = self.modules.path(use) if use is not None else self.cache.path(r.last_node)
            assert r.path == fresh, f"{r.rid}: kept path {r.path}, the tree has {fresh}"
