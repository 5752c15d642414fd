"""HiCache: the radix cache (L1, the KV pool) over lower KV tiers (host L2, disk L3, Redis L4).

The radix tree holds what is in the pool, as without tiers; the lower tiers hold chunks of
evicted prefixes by content key (tier_store.py). Flow of a prefix's K/V:

    L1 pool  --evict leaf--> L2 host --over budget--> L3 disk          (demotion)
       |                                                (writer thread)
       +--insert (write-through, writer thread)--> L4 Redis (shared by servers)

    match_prefix(tokens):                                                  (promotion)
      |<---- L1 radix match ---->|<-- chunks from L2 / L3 / L4 -->|<- recomputed ->|
      0                          p    k0*C <= p < (k0+1)*C        q = k*C
    the chunks covering [p, q) are looked up tier by tier (host, then disk, then one Redis
    MGET for the rest), copied into freshly allocated pool slots and inserted into the tree,
    so the caller gets one MatchResult over slots, as from a plain RadixCache, with
    `tier_tokens` saying where each part came from.

Demotion on eviction copies the chunks of the evicted leaf that end inside it (chunk rows
before the leaf belong to its ancestors, which are still in the pool when a leaf goes: the
tree evicts leaves first); the tail of a leaf that does not fill a chunk is not kept. The
copy is the only part of saving that runs in the step (the slots are reused right after):
one index_select per layer and K/V into a fresh buffer; encoding and writing to disk and
Redis are the writer threads'.

Prefetch (scheduler-aware): for requests still waiting, `prefetch` hands the chunks beyond
the pool's match that the host tier lacks to a reader thread, which reads them from the disk
tier, and the rest of the run with one Redis MGET; the scheduler thread moves what was read
into the host tier at its next call, so the request's admission finds them in memory (a
match that needs a chunk still being read waits for the reader instead of reading it too). The
reader touches only the disk and Redis tiers (thread-safe) and queues; the tree and the host
tier stay the scheduler thread's.

Positional decoupling (`mover`, --hicache-reposition, opt-in and approximate; see
reposition.py): where the in-place match above ends at q, a run of the prompt that the
cache holds at another position (a truncated conversation's kept turns) continues it: its
rows are copied out of the pool (the old sequence's radix path) and the tiers (the old
sequence's chunk keys), its keys rotated to [q, ...), and it is loaded and inserted like a
tier hit (`tier_tokens["moved"]`).

Sliding-window layers (kvcache/pool.py): a chunk whose tokens all hold their sliding rows is
kept whole; one whose tokens lost some goes to the local tiers under a key of its own
(namespace + GLOBAL_ONLY), and when it comes back its tokens get no sliding rows, so the
match stops where the radix tree's would (radix.py). The remote tier keeps whole chunks.

Parts (`CacheSalt`, radix.py): a salted request's chunks are keyed under the namespace
extended by its salt's digest (`namespace_of`), so a record written under one salt is never
found under another, in any tier, whichever server wrote it; the run index of positional
decoupling files runs by salt too.

Exactness: a chunk holds the pool's rows bit for bit, so a promoted prefix gives the same
outputs as the same prefix still in the pool. A record a tier cannot trust is a miss
(recomputed), never loaded.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

import torch

from radixserve.core.info import TierStats
from radixserve.core.request import SHARED, CacheSalt
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.radix import MatchResult, RadixCache, TreeNode
from radixserve.kvcache.remote_store import RemoteStore
from radixserve.kvcache.reposition import WINDOW, Mover
from radixserve.kvcache.tier_store import CHUNK_TOKENS, ChunkLayout, TierStore, chunk_keys

C = CHUNK_TOKENS
READ_WAIT_S = 5.0  # a match waits at most this long for a chunk the prefetch reader is reading
GLOBAL_ONLY = "|global"  # namespace suffix of chunks whose sliding-window rows are not kept


def namespace_of(namespace: str, salt: CacheSalt) -> str:
    """The chunk-key namespace of `salt`'s part: `namespace` for the shared part, else with
    the salt's fixed-length digest added (so a suffix such as GLOBAL_ONLY after it cannot
    make two salts' namespaces equal)."""
    return namespace if salt.shared else f"{namespace}|salt:{salt.digest()}"


def pool_layout(pool: KVPool) -> ChunkLayout:
    k = pool.k[0]
    return ChunkLayout(len(pool.k), k.shape[1], k.shape[2], k.dtype)


class HiCache:
    """The `PrefixCache` with lower tiers (prefix_cache.py's contract, with one exception):
    `match_prefix` may allocate pool slots for what it loads from a lower tier, evicting
    unlocked leaves to make room (never the matched path). Its result's slots belong to the
    cache, like any match. `local` are the tiers searched in order (host, then disk);
    `remote` is the shared one, written through on `insert`. `layerwise`: a hit's rows are
    written into the pool layer by layer by the pool's loader thread while the step runs
    (KVPool.load), else all of them before `match_prefix` returns (the reference path).
    """

    def __init__(
        self,
        pool: KVPool,
        local: list[TierStore],
        remote: RemoteStore | None,
        namespace: str,
        layerwise: bool = True,
        mover: Mover | None = None,
        index_suffixes: bool = False,
    ) -> None:
        self.pool = pool
        self.mover = mover  # positional decoupling (--hicache-reposition): None is off
        self.layerwise = layerwise  # load hits layer by layer while the step computes
        self.tree = RadixCache(pool, on_evict=self._demote, index_suffixes=index_suffixes)
        self.local = local
        self.remote = remote
        self.namespace = namespace
        self.layout = pool_layout(pool)
        self.device = TierStats()
        self.prefetched = 0  # chunks moved up into the host tier ahead of their request
        self._queued: list[TreeNode] = []  # deepest cached nodes of the queued requests
        self._wanted: set[str] = set()  # keys handed to the reader, not yet in the host
        self._to_read: queue.Queue[list[tuple[str, list[int]]]] = queue.Queue()
        self._read: queue.Queue[tuple[str, list[int], tuple[str, torch.Tensor] | None]]
        self._read = queue.Queue()
        # prefetch lands chunks in the host tier, from the disk tier or Redis below it
        self._prefetches = bool(local) and (len(local) > 1 or remote is not None)
        if self._prefetches:
            threading.Thread(target=self._read_loop, name="hicache-prefetch", daemon=True).start()

    # -- PrefixCache: sizes, locks and paths are the tree's ---------------------------------

    @property
    def root(self) -> TreeNode:
        return self.tree.root

    def roots(self) -> dict[CacheSalt, TreeNode]:
        return self.tree.roots()

    @property
    def num_nodes(self) -> int:
        return self.tree.num_nodes

    @property
    def evictable_size(self) -> int:
        return self.tree.evictable_size

    @property
    def locked_size(self) -> int:
        return self.tree.locked_size

    @property
    def total_size(self) -> int:
        return self.tree.total_size

    @property
    def path_version(self) -> int:
        return self.tree.path_version

    def split_since(self, version: int) -> frozenset[int] | None:
        return self.tree.split_since(version)

    @property
    def swa_tokens(self) -> int:
        return self.tree.swa_tokens

    def cached_length(self, token_ids: Sequence[int], *, salt: CacheSalt = SHARED) -> int:
        return self.tree.cached_length(token_ids, salt=salt)

    def continuations(
        self, token_ids: Sequence[int], max_tokens: int, *, salt: CacheSalt = SHARED
    ) -> list[list[int]]:
        return self.tree.continuations(token_ids, max_tokens, salt=salt)

    def suffix_continuations(
        self, token_ids: Sequence[int], max_tokens: int, *, salt: CacheSalt = SHARED
    ) -> tuple[int, list[list[int]]]:
        return self.tree.suffix_continuations(token_ids, max_tokens, salt=salt)

    def lock(self, node: TreeNode) -> None:
        self.tree.lock(node)

    def unlock(self, node: TreeNode) -> None:
        self.tree.unlock(node)

    def path(self, node: TreeNode) -> list[tuple[int, int]]:
        return self.tree.path(node)

    def evict(self, num_tokens: int) -> int:
        """Evict least recently used leaves, sparing the queued requests' paths (see
        `prefetch`) unless nothing else is left."""
        spared = [n for n in self._queued if n.parent is not None]  # still in the tree
        for node in spared:
            self.tree.lock(node)
        freed = self.tree.evict(num_tokens)
        for node in spared:
            self.tree.unlock(node)
        return freed + self.tree.evict(num_tokens - freed)

    def trim_swa(self, spared: set[int], keep_ends: bool = True) -> int:
        return self.tree.trim_swa(spared, keep_ends)

    # -- promotion -----------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], *, salt: CacheSalt = SHARED) -> MatchResult:
        self._land_prefetched()
        tokens = list(token_ids)
        m = self._match_in_place(tokens, salt)
        if self.mover is None or len(m.indices) + WINDOW > len(tokens):
            return m
        return self._match_moved(tokens, m, salt)

    def _match_in_place(self, tokens: list[int], salt: CacheSalt) -> MatchResult:
        """The pool's match, then the chunks of the lower tiers that continue it (all under
        `salt`); the result stops where the sliding layers' K/V allows (radix.py)."""
        m = self.tree.match_prefix(tokens, whole=True, salt=salt)
        p = len(m.indices)
        keys = chunk_keys(namespace_of(self.namespace, salt), tokens)
        k0 = p // C
        found = self._fetch(tokens, keys, k0, self._global_keys(tokens, salt))
        slots = self._alloc(len(found) * C - (p - k0 * C), m.last_node)
        if slots is None:
            return self._usable(m, tokens[:p], [], salt)
        n_chunks = (p - k0 * C + len(slots) + C - 1) // C
        q = p + len(slots)
        # chunk k0 + k covers [(k0 + k) * C, (k0 + k + 1) * C); the slots take [p, q)
        spans = [(max((k0 + k) * C, p), min((k0 + k + 1) * C, q)) for k in range(n_chunks)]
        parts = [
            chunk[:, :, start - (k0 + k) * C : end - (k0 + k) * C]
            for k, ((_, chunk, _), (start, end)) in enumerate(zip(found, spans))
        ]
        for (_, _, whole), (start, end) in zip(found, spans):
            if not whole:  # before the load: its sliding layers write to the scratch row
                self.pool.free_swa(slots[start - p : end - p])
        self.pool.load(slots, parts, background=self.layerwise)
        result = self.tree.insert(tokens[:q], torch.cat([m.indices, slots]), salt=salt)
        loaded = [(name, span) for (name, _, _), span in zip(found, spans)]
        return self._usable(result, tokens[:q], loaded, salt)

    def _usable(
        self,
        m: MatchResult,
        tokens: list[int],
        loaded: list[tuple[str, tuple[int, int]]],
        salt: CacheSalt,
    ) -> MatchResult:
        """`m`, the tree's whole match of `tokens` under `salt`, cut where the sliding
        layers' K/V allows, with the tokens it reuses counted by tier: `loaded` the (tier,
        [start, end)) runs just loaded, the rest was in the pool."""
        result = self.tree.match_prefix(tokens, salt=salt) if self.pool.window else m
        n = len(result.indices)
        tiers: dict[str, int] = {}
        device = min(n, loaded[0][1][0] if loaded else n)
        for name, (start, end) in [("device", (0, device)), *loaded]:
            used = min(end, n) - start
            if used > 0:
                tiers[name] = tiers.get(name, 0) + used
                (self.device if name == "device" else self._tier(name)).hit_tokens += used
        return MatchResult(result.indices, result.last_node, tiers)

    def _global_keys(self, tokens: list[int], salt: CacheSalt) -> list[str] | None:
        """The keys of `tokens`' chunks kept without sliding rows; None for a model without
        sliding-window layers."""
        if not self.pool.window:
            return None
        return chunk_keys(namespace_of(self.namespace, salt) + GLOBAL_ONLY, tokens)

    def _match_moved(self, tokens: list[int], m: MatchResult, salt: CacheSalt) -> MatchResult:
        """Positional decoupling (reposition.py): continue `m` at q with a run of tokens
        cached at another position under the same `salt`, its keys turned to the new one.
        `m` unchanged if no run of WINDOW+ tokens is found with its K/V still in the pool or
        a tier."""
        assert self.mover is not None
        q = len(m.indices)
        run = self.mover.index.find(tokens, q, salt)
        if run is None:
            return m
        rows = self._rows_of(run.old, run.start, run.start + run.length, salt)
        if rows.shape[2] < WINDOW:
            return m
        slots = self._alloc(rows.shape[2], m.last_node)
        if slots is None:
            return m
        moved = self.mover.move(rows[:, :, : len(slots)], q - run.start)
        self.pool.load(slots, [moved], background=self.layerwise)
        q_end = q + len(slots)
        result = self.tree.insert(tokens[:q_end], torch.cat([m.indices, slots]), salt=salt)
        self.mover.moved_tokens += len(slots)
        return MatchResult(result.indices, result.last_node, {**m.tier_tokens, "moved": len(slots)})

    def _rows_of(self, old: list[int], start: int, end: int, salt: CacheSalt) -> torch.Tensor:
        """A copy of the K/V of old[start:end) (layers, 2, n, kv_heads, head_dim), n <= end -
        start: the leading rows that the pool (old's radix path) and then the tiers' chunks
        (old's keys), under `salt`, still hold."""
        m = self.tree.match_prefix(old[:end], salt=salt)
        p = len(m.indices)
        parts = [self._gather(m.indices[start:])] if p > start else []
        at = max(p, start)  # rows of old[start:at) are in parts
        keys = chunk_keys(namespace_of(self.namespace, salt), old[:end])
        k0 = at // C
        for k, (_, chunk, _) in enumerate(self._fetch(old, keys, k0) if at < end else []):
            lo, hi = (k0 + k) * C, min((k0 + k + 1) * C, end)
            parts.append(chunk[:, :, at - lo : hi - lo])
            at = hi
        if not parts:
            lay = self.layout
            return torch.empty((lay.num_layers, 2, 0, lay.kv_heads, lay.head_dim), dtype=lay.dtype)
        return torch.cat(parts, dim=2)

    def _fetch(
        self,
        tokens: list[int],
        keys: list[str],
        k0: int,
        global_keys: list[str] | None = None,
    ) -> list[tuple[str, torch.Tensor, bool]]:
        """The leading run of chunks k0, k0+1, ... that some tier holds: the tier's name, the
        chunk, and whether it is whole (else found under `global_keys`: its sliding rows are
        not kept)."""
        found: list[tuple[str, torch.Tensor, bool]] = []
        for k in range(k0, len(keys)):
            chunk_tokens = tokens[k * C : (k + 1) * C]
            hit, whole = self._fetch_local(keys[k], chunk_tokens), True
            if hit is None and global_keys is not None:
                hit, whole = self._fetch_local(global_keys[k], chunk_tokens), False
            if hit is None:
                break
            found.append((*hit, whole))
        k = k0 + len(found)
        if self.remote is not None and k < len(keys):
            start = time.perf_counter()
            chunks = self.remote.get_many(
                keys[k:], [tokens[i * C : (i + 1) * C] for i in range(k, len(keys))]
            )
            self._count_load(self.remote.counters, len(chunks), start)
            found.extend(("remote", chunk, True) for chunk in chunks)
        return found

    def _fetch_local(self, key: str, tokens: list[int]) -> tuple[str, torch.Tensor] | None:
        self._await_read(key)
        for tier in self.local:
            start = time.perf_counter()
            chunk = tier.get(key, tokens)
            if chunk is not None:
                self._count_load(tier.counters, 1, start)
                return tier.name, chunk
        return None

    @staticmethod
    def _count_load(counters: TierStats, chunks: int, start: float) -> None:
        if chunks:
            counters.loads += chunks
            counters.load_seconds += time.perf_counter() - start

    def _alloc(self, n: int, keep: TreeNode) -> torch.Tensor | None:
        """Up to `n` free slots (evicting unlocked leaves, never `keep`'s path); None if 0."""
        if n <= 0:
            return None
        self.tree.lock(keep)
        if self.pool.num_free < n:
            self.evict(n - self.pool.num_free)
        self.tree.unlock(keep)
        free = min(self.pool.num_free, self.pool.swa_free)
        return self.pool.alloc(min(n, free)) if free else None

    def _tier(self, name: str) -> TierStats:
        if name == "remote":
            assert self.remote is not None
            return self.remote.counters
        return next(t.counters for t in self.local if t.name == name)

    # -- prefetch ------------------------------------------------------------------------

    def prefetch(self, queued: Sequence[tuple[Sequence[int], CacheSalt]]) -> None:
        """The scheduler's look-ahead over its waiting queue (next to be admitted first):
        their cached paths are what `evict` spares while it can, and the chunks of theirs
        that only the disk tier or Redis holds start moving up into the host tier, in the
        background (the reader thread)."""
        self._land_prefetched()
        self._queued = [self.tree.deepest_node(t, salt=salt) for t, salt in queued]
        if self._prefetches:
            for token_ids, salt in queued:
                self._pull_up(list(token_ids), salt)

    def _pull_up(self, tokens: list[int], salt: CacheSalt) -> None:
        """Hand the reader the chunks of `tokens` (under `salt`) beyond the pool's match that
        the host tier lacks, in order (it reads them from disk, then the rest with one Redis
        MGET)."""
        keys = chunk_keys(namespace_of(self.namespace, salt), tokens)
        host, lower = self.local[0], self.local[1:]
        todo: list[tuple[str, list[int]]] = []
        for k in range(self.tree.cached_length(tokens, salt=salt) // C, len(keys)):
            key = keys[k]
            if key in self._wanted or host.contains(key):
                continue
            if self.remote is None and not any(t.contains(key) for t in lower):
                break  # the prefix ends here: nothing below it is reachable
            todo.append((key, tokens[k * C : (k + 1) * C]))
        if todo:
            self._wanted.update(key for key, _ in todo)
            self._to_read.put(todo)

    def _read_loop(self) -> None:
        """The reader thread: a run of chunks from disk while it has them, the rest from
        Redis; every chunk of the run comes back (None: not found)."""
        while True:
            todo = self._to_read.get()
            n = 0
            while n < len(todo) and (hit := self._read_local(*todo[n])) is not None:
                self._read.put((*todo[n], hit))
                n += 1
            rest = todo[n:]
            if self.remote is not None and rest:
                chunks = self.remote.get_many([k for k, _ in rest], [t for _, t in rest])
                for item, chunk in zip(rest, chunks):
                    self._read.put((*item, ("remote", chunk)))
                rest = rest[len(chunks) :]
            for item in rest:
                self._read.put((*item, None))

    def _read_local(self, key: str, tokens: list[int]) -> tuple[str, torch.Tensor] | None:
        for tier in self.local[1:]:
            chunk = tier.get(key, tokens)
            if chunk is not None:
                return tier.name, chunk
        return None

    def _land_prefetched(self) -> None:
        """Move chunks the reader has read into the host tier (scheduler thread)."""
        while True:
            try:
                item = self._read.get_nowait()
            except queue.Empty:
                return
            self._land(*item)

    def _await_read(self, key: str) -> None:
        """A chunk the reader is reading: wait for it (landing what comes before it) rather
        than read it a second time; after READ_WAIT_S without news, read it here."""
        while key in self._wanted:
            try:
                self._land(*self._read.get(timeout=READ_WAIT_S))
            except queue.Empty:
                self._wanted.discard(key)

    def _land(self, key: str, tokens: list[int], hit: tuple[str, torch.Tensor] | None) -> None:
        self._wanted.discard(key)
        if hit is not None and not self.local[0].contains(key):
            self.local[0].put(key, tokens, hit[1])
            self.prefetched += 1

    # -- demotion and write-through ------------------------------------------------------

    def _demote(self, tokens: list[int], slots: torch.Tensor, start: int, salt: CacheSalt) -> None:
        """RadixCache's evict hook: keep the leaf's whole chunks in the first local tier,
        under the keys of its part's `salt`.

        Runs in the step (the slots are freed right after): one gather of the new chunks'
        rows; the host tier keeps views of it, and the disk writer encodes them later."""
        if not self.local:
            return
        keys = chunk_keys(namespace_of(self.namespace, salt), tokens)
        global_keys = self._global_keys(tokens, salt)
        todo: list[tuple[int, str]] = []
        for k in range(start // C, len(keys)):
            key = keys[k] if global_keys is None or self._whole(slots, k) else global_keys[k]
            if not any(tier.contains(keys[k]) or tier.contains(key) for tier in self.local):
                todo.append((k, key))
        if not todo:
            return
        rows = self._gather(torch.cat([slots[k * C : (k + 1) * C] for k, _ in todo]))
        for j, (k, key) in enumerate(todo):
            self.local[0].put(key, tokens[k * C : (k + 1) * C], rows[:, :, j * C : (j + 1) * C])

    def _gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The pool's rows at `slots`, copied into one new buffer with one index_select per
        layer and K/V: (layers, 2, len(slots), kv_heads, head_dim)."""
        lay, pool = self.layout, self.pool
        pool.wait_loads()  # rows still being loaded are not there yet
        out = torch.empty(
            (lay.num_layers, 2, len(slots), lay.kv_heads, lay.head_dim), dtype=lay.dtype
        )
        for i in range(lay.num_layers):
            rows = pool.layer_slots(i, slots)
            torch.index_select(pool.k[i], 0, rows, out=out[i, 0])
            torch.index_select(pool.v[i], 0, rows, out=out[i, 1])
        return out

    def _whole(self, slots: torch.Tensor, k: int) -> bool:
        """Whether the pool holds every layer's K/V of chunk k of `slots`: a token whose
        sliding rows were freed (kvcache/pool.py) has none to write to a tier."""
        return bool(self.pool.has_swa(slots[k * C : (k + 1) * C]).all())

    def insert(
        self, token_ids: Sequence[int], kv_indices: torch.Tensor, *, salt: CacheSalt = SHARED
    ) -> MatchResult:
        result = self.tree.insert(token_ids, kv_indices, salt=salt)
        if self.mover is not None:
            self.mover.index.add(token_ids, salt)
        if self.remote is not None:
            tokens = list(token_ids)
            keys = chunk_keys(namespace_of(self.namespace, salt), tokens)
            slots = result.indices
            todo = [
                k
                for k, key in enumerate(keys)
                if not self.remote.known(key) and self._whole(slots, k)
            ]
            if todo:
                rows = self._gather(torch.cat([slots[k * C : (k + 1) * C] for k in todo]))
                for j, k in enumerate(todo):
                    chunk = rows[:, :, j * C : (j + 1) * C]
                    self.remote.put(keys[k], tokens[k * C : (k + 1) * C], chunk)
        return result

    # -- management ----------------------------------------------------------------------

    def flush(self) -> None:
        """Empty the pool part and this server's own tiers (host, disk); the shared remote
        tier is other servers' too and stays."""
        self._queued = []
        self.tree.flush()
        for tier in self.local:
            tier.clear()
        if self.mover is not None:
            self.mover.index.clear()

    def drain(self) -> None:
        """Wait until every tier's queued writes and the prefetch reads are done (tests;
        before reading a tier), and land what was prefetched."""
        while self._wanted:
            time.sleep(0.002)
            self._land_prefetched()
        for tier in [*self.local, *([self.remote] if self.remote else [])]:
            tier.drain()

    def close(self) -> None:
        for tier in [*self.local, *([self.remote] if self.remote else [])]:
            tier.close()

    def tier_stats(self) -> dict[str, TierStats]:
        out = {"device": TierStats(hit_tokens=self.device.hit_tokens)}
        for tier in [*self.local, *([self.remote] if self.remote else [])]:
            c = tier.counters
            out[tier.name] = TierStats(
                c.hit_tokens, c.loads, c.load_seconds, c.faults, tier.stored_bytes
            )
        if self.mover is not None:  # hits moved from another position (any tier below)
            out["moved"] = TierStats(hit_tokens=self.mover.moved_tokens)
        return out

    def check_integrity(self, in_use_elsewhere: int = 0) -> None:
        self.tree.check_integrity(in_use_elsewhere)
