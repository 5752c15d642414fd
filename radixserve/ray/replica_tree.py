"""What the request router knows of one replica's cache, and router/'s policy over it.

Every `request_routing_stats_period_s` each replica reports the shared part of its prefix
cache as block hashes (`EngineReplica.record_routing_stats`: the server's `/cache_digest`,
kvcache/digest.py), so what a replica evicted drops out of its next report. A replica's
tree answers from that report and from the prompts routed to it since:

    match(replica, prompt) = max(
        whole blocks of the prompt whose hashes the replica reported   (its real cache),
        prefix of the prompt held by the prompts routed to it within   (not yet in a report)
            the last `horizon_s`)

Plain Python over core/digest.py and router/ (no Ray): routing.py puts it behind Ray Serve.
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from radixserve.core.digest import block_hashes, split
from radixserve.router.config import RouterConfig
from radixserve.router.policy import CacheAware
from radixserve.router.tree import PrefixTree

HORIZON_S = 5.0  # prompts routed this recently count even when a report does not name them


@functools.lru_cache(maxsize=256)
def _key_hashes(key: str, block: int) -> tuple[bytes, ...]:
    return tuple(block_hashes([ord(c) for c in key], block))


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
        """Take the replica's routing stats (`EngineReplica.record_routing_stats`: "version",
        "block", "hashes"); one already taken (same version) changes nothing."""
        if stats.get("version") == self.version or "hashes" not in stats:
            return
        self.version = stats["version"]
        self.block, self.reported = int(stats["block"]), split(stats["hashes"])
        cutoff = self.clock() - self.horizon_s
        while self.sent and self.sent[0][0] < cutoff:
            self.sent.popleft()
        PrefixTree.__init__(self)  # rebuilt from the recent prompts alone
        for _, key in self.sent:
            PrefixTree.insert(self, key)

    def match(self, key: str) -> int:
        return max(super().match(key), self.reported_match(key))

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
