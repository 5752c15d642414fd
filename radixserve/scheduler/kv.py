"""KV lifecycle of a sample: admit, extend, cache, release, retract.

Slot ownership (see req.py's region table): positions < tree_len belong to the radix cache
(kept alive by the lock on last_node); positions tree_len..kv_len-1 belong to the request.
Every slot is always owned by exactly one of: the pool's free list, the radix cache, or one
admitted request — `check_integrity` counts them.
"""

from __future__ import annotations

import torch

from radixserve.kvcache.pool import KVPool, ReqToTokenPool
from radixserve.kvcache.radix import RadixCache
from radixserve.scheduler.req import Req


class KVManager:
    def __init__(self, pool: KVPool, req_pool: ReqToTokenPool, cache: RadixCache) -> None:
        self.pool = pool
        self.req_pool = req_pool
        self.cache = cache

    @property
    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.pool.num_free + self.cache.evictable_size

    def slots(self, req: Req, end: int | None = None) -> torch.Tensor:
        assert req.row is not None, f"{req.rid} is not admitted"
        return self.req_pool.table[req.row, : req.kv_len if end is None else end]

    def reserve(self, n: int) -> bool:
        """Make `n` slots free (evicting unlocked cache leaves if needed); False if impossible."""
        if self.pool.num_free < n:
            self.cache.evict(n - self.pool.num_free)
        return self.pool.num_free >= n

    def admit(self, req: Req) -> bool:
        """Give a waiting sample a table row and its cached prefix (locked). False: no row."""
        row = self.req_pool.alloc()
        if row is None:
            return False
        match = self.cache.match_prefix(req.all_ids[: req.reuse_limit()])
        self.cache.lock(match.last_node)
        n = len(match.indices)
        self.req_pool.table[row, :n] = match.indices
        req.row, req.last_node, req.tree_len, req.kv_len = row, match.last_node, n, n
        if req.cached_tokens < 0:
            req.cached_tokens = min(n, len(req.prompt_ids))
        return True

    def unadmit(self, req: Req) -> None:
        """Undo `admit` before any K/V was computed (the prefix stays cached)."""
        assert req.kv_len == req.tree_len, "unadmit after an extend would leak slots"
        self._drop(req)

    def extend(self, req: Req, n: int) -> torch.Tensor:
        """Allocate slots for the next `n` positions; the caller reserved them."""
        slots = self.pool.alloc(n)
        assert slots is not None, f"extend of {n} slots without a reservation"
        assert req.row is not None
        self.req_pool.table[req.row, req.kv_len : req.kv_len + n] = slots
        return slots

    def cache_prefix(self, req: Req) -> None:
        """Move the request's computed K/V into the radix tree; it keeps using it (locked)."""
        if self.cache.disable:
            return
        match = self.cache.insert(req.all_ids[: req.kv_len], self.slots(req).clone())
        assert len(match.indices) == req.kv_len
        assert req.row is not None and req.last_node is not None
        self.req_pool.table[req.row, : req.kv_len] = match.indices
        self.cache.lock(match.last_node)
        self.cache.unlock(req.last_node)
        req.last_node, req.tree_len = match.last_node, req.kv_len

    def fork(self, parent: Req, child: Req) -> bool:
        """Let `child` share all of `parent`'s (cached) K/V. False: no row free."""
        assert parent.tree_len == parent.kv_len, "fork needs the parent's K/V in the tree"
        row = self.req_pool.alloc()
        if row is None:
            return False
        assert parent.last_node is not None
        self.cache.lock(parent.last_node)
        self.req_pool.table[row, : parent.kv_len] = self.slots(parent)
        child.row, child.last_node = row, parent.last_node
        child.tree_len = child.kv_len = parent.kv_len
        child.cached_tokens = parent.cached_tokens
        return True

    def release(self, req: Req) -> None:
        """Finished, aborted or retracted: its K/V goes to the cache (or the pool)."""
        if req.row is None:
            return
        if not self.cache.disable:
            self.cache_prefix(req)
        else:
            self.pool.free(self.slots(req)[req.tree_len :].clone())
        self._drop(req)

    def _drop(self, req: Req) -> None:
        assert req.row is not None and req.last_node is not None
        self.cache.unlock(req.last_node)
        self.req_pool.free(req.row)
        req.row, req.last_node, req.tree_len, req.kv_len = None, None, 0, 0

    def owned_by_requests(self, reqs: list[Req]) -> int:
        return sum(r.kv_len - r.tree_len for r in reqs if r.row is not None)

    def check_integrity(self, reqs: list[Req]) -> None:
        self.cache.check_integrity(in_use_elsewhere=self.owned_by_requests(reqs))
