"""The prefix cache interface, the cache that shares nothing, and the one place that picks.

A prefix cache holds the KV slots of token prefixes that requests computed and hands them to
later requests starting with the same tokens. Two implementations:
  - `RadixCache` (radix.py): shares every cached prefix (the default);
  - `HiCache` (hicache.py, `--hicache-size` / `--hicache-remote`): a RadixCache over lower
    tiers (host, disk, Redis) that evicted prefixes go to and come back from, and with
    `--hicache-reposition` (reposition.py) runs cached at other positions, moved;
  - `NoPrefixCache` (here, `--disable-radix-cache`): a tree that is only a root; it matches
    nothing and keeps nothing, so a request's K/V stays the request's and goes back to the
    pool when the request ends.
`make_prefix_cache` is the only code that reads `EngineConfig.disable_radix_cache` and the
hicache fields; callers hold a `PrefixCache` and never ask which one it is.

Every lookup and insert takes the caller's `CacheSalt` (core/request.py): a cache shares K/V
only between requests of equal salts, in the pool, in the lower tiers and in the drafts it
proposes. The salt defaults to the shared part.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Protocol

import torch

from radixserve.config import EngineConfig
from radixserve.core.info import TierStats
from radixserve.core.request import SHARED, CacheSalt
from radixserve.kvcache.disk_store import DiskStore
from radixserve.kvcache.hicache import HiCache, pool_layout
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.radix import MatchResult, RadixCache, TreeNode, check_insert_args
from radixserve.kvcache.remote_store import RemoteStore
from radixserve.kvcache.reposition import Mover, RunIndex
from radixserve.kvcache.tier_store import (
    CHUNK_TOKENS,
    ChunkCodec,
    HostStore,
    SealedChunkCodec,
    TierStore,
)


class PrefixCache(Protocol):
    """KV slots of cached token prefixes over a KVPool, handed out through lockable nodes.

    Slot accounting (asserted by `check_integrity`): every pool slot is free, held by the
    cache (`total_size` = `evictable_size` + `locked_size`), or held by the caller
    (`in_use_elsewhere`).

    Contract:
      - `match_prefix` and `cached_length` never free or allocate slots.
      - `insert(token_ids, kv_indices)` keeps some prefix of `token_ids` (its length is
        len(result.indices), between the prefix already matched and locked and all of
        `token_ids`) and takes ownership of exactly that prefix of `kv_indices`; the rest of
        `kv_indices` stays the caller's, to use and later free. It never evicts.
      - A MatchResult's `indices` stay valid while its `last_node` is locked; `evict` never
        frees a locked node's slots; `evict` and `flush` free only slots the cache holds.
      - `lock`/`unlock`/`path` take only nodes this cache handed out and still holds, else
        raise AssertionError; on a root they are no-ops (path: []).
      - Nothing is shared across salts: a lookup under one salt finds, proposes and counts
        only what requests of the same salt inserted.
      - Single-threaded: the scheduler calls it between model steps.
    """

    @property
    def root(self) -> TreeNode:
        """The shared part's root: never evicted; a NoPrefixCache's has no children."""
        ...

    def roots(self) -> dict[CacheSalt, TreeNode]:
        """The root of every part by salt, `root` included (radix.py). Do not modify."""
        ...

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, root included."""
        ...

    @property
    def evictable_size(self) -> int:
        """Slots held in unlocked nodes: what `evict` can free."""
        ...

    @property
    def locked_size(self) -> int:
        """Slots held in locked nodes."""
        ...

    @property
    def total_size(self) -> int:
        """evictable_size + locked_size."""
        ...

    @property
    def swa_tokens(self) -> int:
        """Cached tokens holding sliding-window rows (kvcache/pool.py)."""
        ...

    @property
    def path_version(self) -> int:
        """Changes whenever the `path` of a node still in the cache may have changed (a
        split); a path read at the same version is still exact."""
        ...

    def split_since(self, version: int) -> frozenset[int] | None:
        """Ids of the nodes split since path_version `version`: a path read then that lists
        none of them is exact still. None when the cache no longer knows (read again)."""
        ...

    def match_prefix(self, token_ids: Sequence[int], *, salt: CacheSalt = SHARED) -> MatchResult:
        """The longest cached prefix of `token_ids` under `salt`: its slots, and the node
        ending it (`root` when nothing matches). May reorganise nodes; frees and allocates
        nothing."""
        ...

    def cached_length(self, token_ids: Sequence[int], *, salt: CacheSalt = SHARED) -> int:
        """len(match_prefix(token_ids, salt).indices) without changing anything (for
        ranking)."""
        ...

    def continuations(
        self, token_ids: Sequence[int], max_tokens: int, *, salt: CacheSalt = SHARED
    ) -> list[list[int]]:
        """The cached continuations of all of `token_ids` under `salt`, one a branch, each
        up to `max_tokens` tokens (drafts for speculative decoding); []: none. Changes
        nothing."""
        ...

    def suffix_continuations(
        self, token_ids: Sequence[int], max_tokens: int, *, salt: CacheSalt = SHARED
    ) -> tuple[int, list[list[int]]]:
        """(match length, up to `max_tokens` tokens after each) of the best cached
        occurrences of the end of `token_ids` under `salt` (kvcache/suffix_index.py); (0,
        []): none, or no suffix index. Changes nothing."""
        ...

    def insert(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, *, salt: CacheSalt = SHARED
    ) -> MatchResult:
        """Offer `token_ids` whose K/V sit at `kv_indices`, under `salt`; returns the slots
        the cache now holds for the prefix it kept and the node ending that prefix (see the
        contract). Raises AssertionError if kv_indices is not (len(token_ids),) int64."""
        ...

    def lock(self, node: TreeNode) -> None:
        """Pin `node`'s path: its slots are not evicted until the matching `unlock`."""
        ...

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`."""
        ...

    def path(self, node: TreeNode) -> list[tuple[int, int]]:
        """[(node id, tokens), ...] from below the root down to `node`: the shared segments an
        attention backend may compute once for every request on them."""
        ...

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked slots if it can; returns how many it freed."""
        ...

    def flush(self) -> None:
        """Free every slot the cache holds. Asserts that nothing is locked."""
        ...

    def trim_swa(self, spared: set[int], keep_ends: bool = True) -> int:
        """Free sliding-window layers' rows of cached tokens but the `spared` nodes' (ids)
        and, with `keep_ends`, those near the ends where matches stop (RadixCache.trim_swa);
        returns how many it freed."""
        ...

    def tier_stats(self) -> dict[str, TierStats]:
        """Counters of each KV tier by name ({} without lower tiers)."""
        ...

    def prefetch(self, queued: Sequence[tuple[Sequence[int], CacheSalt]]) -> None:
        """A hint, once per step: the token ids and salts of the waiting requests next to be
        admitted (first first). A cache with slower tiers may start moving their prefixes
        closer and spare them in `evict`. Frees and allocates nothing; raises nothing."""
        ...

    def check_integrity(self, in_use_elsewhere: int = 0) -> None:
        """Assert the cache's invariants and the slot accounting above, given the slots the
        caller holds outside the cache. Raises AssertionError with the offending values."""
        ...


class NoPrefixCache:
    """The PrefixCache that shares nothing (`--disable-radix-cache`).

    A tree that is only a root: `match_prefix` matches nothing, `insert` keeps nothing and
    takes none of the caller's slots (a request keeps its own K/V and frees it when it ends),
    nothing is evictable or locked. `check_integrity` still counts every slot:
    pool.num_free + in_use_elsewhere == pool.capacity.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.root = TreeNode(0, [], torch.empty(0, dtype=torch.int64), None, 0.0)
        self.num_nodes = 1

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def locked_size(self) -> int:
        return 0

    @property
    def total_size(self) -> int:
        return 0

    @property
    def swa_tokens(self) -> int:
        return 0

    @property
    def path_version(self) -> int:
        return 0

    def split_since(self, version: int) -> frozenset[int] | None:
        return frozenset()

    def roots(self) -> dict[CacheSalt, TreeNode]:
        return {SHARED: self.root}

    def match_prefix(self, token_ids: Sequence[int], *, salt: CacheSalt = SHARED) -> MatchResult:
        return self._nothing()

    def cached_length(self, token_ids: Sequence[int], *, salt: CacheSalt = SHARED) -> int:
        return 0

    def continuations(
        self, token_ids: Sequence[int], max_tokens: int, *, salt: CacheSalt = SHARED
    ) -> list[list[int]]:
        return []

    def suffix_continuations(
        self, token_ids: Sequence[int], max_tokens: int, *, salt: CacheSalt = SHARED
    ) -> tuple[int, list[list[int]]]:
        return 0, []

    def insert(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, *, salt: CacheSalt = SHARED
    ) -> MatchResult:
        check_insert_args(len(token_ids), kv_indices)
        return self._nothing()

    def _nothing(self) -> MatchResult:
        return MatchResult(torch.empty(0, dtype=torch.int64), self.root)

    def lock(self, node: TreeNode) -> None:
        self._check_root(node)

    def unlock(self, node: TreeNode) -> None:
        self._check_root(node)

    def path(self, node: TreeNode) -> list[tuple[int, int]]:
        self._check_root(node)
        return []

    def _check_root(self, node: TreeNode) -> None:
        assert node is self.root, f"{node} is not this cache's root, the only node it hands out"

    def evict(self, num_tokens: int) -> int:
        return 0

    def flush(self) -> None:
        """Nothing is held, so nothing to free."""

    def trim_swa(self, spared: set[int], keep_ends: bool = True) -> int:
        return 0

    def tier_stats(self) -> dict[str, TierStats]:
        return {}

    def prefetch(self, queued: Sequence[tuple[Sequence[int], CacheSalt]]) -> None:
        """Nothing is kept, so nothing to fetch."""

    def check_integrity(self, in_use_elsewhere: int = 0) -> None:
        root = self.root
        assert root.parent is None and not root.children and root.lock_ref == 0, (
            f"the root of a NoPrefixCache must stay bare: {root}"
        )
        pool = self.pool
        total = pool.num_free + in_use_elsewhere
        assert total == pool.capacity, (
            f"free {pool.num_free} + elsewhere {in_use_elsewhere} = {total} "
            f"!= capacity {pool.capacity}"
        )


GB = 1 << 30


def make_prefix_cache(
    config: EngineConfig,
    pool: KVPool,
    model_identity: str = "",
    rope_inv_freq: torch.Tensor | None = None,
) -> PrefixCache:
    """The scheduler's prefix cache: a RadixCache, a HiCache when a lower tier or
    `hicache_reposition` is configured, or a NoPrefixCache under `disable_radix_cache`. The
    only place that reads those fields. `model_identity` (models/identity.py) names the K/V
    in the tiers: servers of the same model and `hicache_secret` share it. `rope_inv_freq`
    (head_dim / 2,) float32, the model's RoPE frequencies, is needed by
    `hicache_reposition` to move keys: None for a model whose layers do not all rotate every
    key dim by one table (ValueError when reposition is on)."""
    if config.disable_radix_cache:
        return NoPrefixCache(pool)
    index_suffixes = config.speculative_algorithm in ("auto", "radix")
    if not config.hicache_enabled:
        return RadixCache(pool, index_suffixes=index_suffixes)
    layout = pool_layout(pool)
    codec = (SealedChunkCodec if config.hicache_encrypt else ChunkCodec)(
        layout, config.hicache_key()
    )
    local: list[TierStore] = []
    tier_bytes = 0  # what the local tiers hold, for the reposition index's bound
    if config.hicache_size > 0:
        disk = None
        if config.hicache_dir is not None:
            disk_bytes = int(config.hicache_disk_size * GB)
            disk = DiskStore(config.hicache_dir, disk_bytes, codec, config.hicache_ttl)
            tier_bytes += disk_bytes
        spill = None if disk is None else disk.put
        host_bytes = int(config.hicache_size * GB)
        local.append(HostStore(host_bytes, layout, spill, config.hicache_ttl))
        tier_bytes += host_bytes
        if disk is not None:
            local.append(disk)
    remote = None
    url = config.remote_url()
    if url is not None:
        remote = RemoteStore(url, codec, config.hicache_remote_ttl)
    # Keyed by the secret too: servers with other secrets never overwrite each other's
    # records, and keys cannot be computed (a popular prompt's chunk targeted) without it.
    namespace = hmac.new(codec.secret, model_identity.encode(), hashlib.sha256).hexdigest()
    if config.hicache_encrypt:
        namespace += "|sealed"  # never read nor overwritten by a MAC-only server, nor it
    mover = None
    if config.hicache_reposition:
        if rope_inv_freq is None:
            raise ValueError(
                "--hicache-reposition needs a model whose layers all rotate every key dim by "
                "one RoPE table; this model's layers differ (sliding-window bases, layers "
                "without RoPE, partial rotary or longrope)"
            )
        index_tokens = pool.capacity + tier_bytes // layout.chunk_bytes * CHUNK_TOKENS
        mover = Mover(RunIndex(index_tokens), rope_inv_freq)
        namespace += "|moved"  # moved (approximate) K/V never reaches an exact server
    return HiCache(pool, local, remote, namespace, config.hicache_layerwise, mover, index_suffixes)
