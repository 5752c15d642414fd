"""What the request router knows of one replica's cache, and router/'s policy over it.

Every `request_routing_stats_period_s` each replica reads the shared part of its prefix
cache as block hashes (`EngineReplica.record_routing_stats`: the server's `/cache_digest`,
kvcache/digest.py) and reports what changed since its last report (`DigestReports`): the
hashes added and those removed (evicted), and every `FULL_EVERY`-th time all of them. Ray
hands a router the latest report only, so one that missed a report lacks its changes until
the next full one. A replica's tree answers from the hashes so reported and from the prompts
routed to it since:

    match(replica, prompt) = max(
        whole blocks of the prompt whose hashes the replica reported   (its real cache),
        prefix of the prompt held by the prompts routed to it that     (queued, in prefill)
            no report has named yet, within the last `horizon_s`)

A prompt routed to a replica counts there until a report names all its whole blocks, so a
prompt that waits long in a queue still draws the requests that share its prefix.

Plain Python over core/digest.py and router/ (no Ray): routing.py puts it behind Ray Serve.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from radixserve.core.digest import block_hashes, join, split
from radixserve.router.config import RouterConfig
from radixserve.router.policy import CacheAware
from radixserve.router.tree import PrefixTree

HORIZON_S = 60.0  # prompts routed this recently count until a report names them
FULL_EVERY = 10  # a replica's reports between two that name all its hashes


@functools.lru_cache(maxsize=1024)
def _key_hashes(key: str, block: int) -> tuple[bytes, ...]:
    return tuple(block_hashes([ord(c) for c in key], block))


class DigestReports:
    """One replica's routing stats, report after report: "version", "block",
    "cached_tokens", and either "hashes" (all) or "added" and "removed" (since the report
    before; `join`ed hashes)."""

    def __init__(self, block: int, full_every: int = FULL_EVERY) -> None:
        self.block, self.full_every = block, full_every
        self.version = 0
        self.last: set[bytes] = set()

    def next(self, packed: bytes, cached_tokens: int) -> dict[str, Any]:
        """The report of the digest `packed` (the server's `/cache_digest` body)."""
        hashes = split(packed)
        added, removed = hashes - self.last, self.last - hashes
        stats: dict[str, Any] = {"version": self.version, "block": self.block,
                                 "cached_tokens": cached_tokens}  # fmt: skip
        if self.version % self.full_every == 0 or len(added) + len(removed) >= len(hashes):
            stats["hashes"] = packed
        else:
            stats["added"], stats["removed"] = join(sorted(added)), join(sorted(removed))
        self.version += 1
        self.last = hashes
        return stats


class ReplicaTree(PrefixTree):
    """What one replica caches: its last report, plus the prompts routed to it since.
    Keys are token ids as `router.tree.ids_key` spells them."""

    def __init__(
        self, horizon_s: float = HORIZON_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.horizon_s = horizon_s
        self.clock = clock
        self.block = 0
        self.reported: set[bytes] = set()
        self.version: object = None
        self.sent: deque[tuple[float, str]] = deque()  # (clock time, key) routed here

    def report(self, stats: Mapping[str, Any]) -> None:
        """Take the replica's routing stats (`DigestReports`). One already taken (same
        version), changes before any full report, or stats of the wrong shape (a replica's
        word is not trusted) change nothing."""
        version, block = stats.get("version"), stats.get("block")
        if version == self.version or type(block) is not int or block < 1:
            return
        full, added, removed = stats.get("hashes"), stats.get("added"), stats.get("removed")
        if isinstance(full, bytes):
            self.reported = split(full)
        elif isinstance(added, bytes) and isinstance(removed, bytes) and self.block == block:
            self.reported -= split(removed)
            self.reported |= split(added)
        else:
            return
        self.version, self.block = version, block
        cutoff = self.clock() - self.horizon_s
        self.sent = deque((t, key) for t, key in self.sent if t >= cutoff and not self._named(key))
        PrefixTree.__init__(self)  # rebuilt from the prompts not yet named
        for _, key in self.sent:
            PrefixTree.insert(self, key)

    def match(self, key: str) -> int:
        return max(super().match(key), self.reported_match(key))

    def held(self) -> int:
        """The ids of the reported blocks, and those of the prompts routed here since that
        lie beyond the reported blocks of their path."""
        unreported, stack = 0, [(self.root, "")]
        while stack:
            node, key = stack.pop()
            for child in node.children.values():
                path = key + child.label
                unreported += len(path) - max(len(key), self.reported_match(path))
                stack.append((child, path))
        return len(self.reported) * self.block + unreported

    def _named(self, key: str) -> bool:
        """The last report names every whole block of `key`."""
        return self.reported_match(key) == len(key) // self.block * self.block

    def reported_match(self, key: str) -> int:
        """Ids of `key` in the whole blocks the last report named, from the start."""
        if not self.block or not self.reported:
            return 0
        n = 0
        for h in _key_hashes(key, self.block):
            if h not in self.reported:
                break
            n += 1
        return n * self.block

    def insert(self, key: str) -> None:
        super().insert(key)
        self.sent.append((self.clock(), key))


class ReportedCacheAware(CacheAware):
    """router/'s cache_aware policy over `ReplicaTree`s."""

    def __init__(
        self,
        config: RouterConfig,
        horizon_s: float = HORIZON_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(config)
        self.horizon_s = horizon_s
        self.clock = clock

    def _tree(self, url: str) -> ReplicaTree:
        tree = self.trees.get(url)
        if not isinstance(tree, ReplicaTree):
            tree = self.trees[url] = ReplicaTree(self.horizon_s, self.clock)
        return tree

    def report(self, url: str, stats: Mapping[str, Any]) -> None:
        """The replica `url`'s latest routing stats."""
        self._tree(url).report(stats)
