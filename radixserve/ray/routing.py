"""Ray Serve's replica choice by the replicas' own radix trees (`RadixTreeRouter`).

Every `request_routing_stats_period_s` each replica reports the shared part of its prefix
cache as block hashes (`EngineReplica.record_routing_stats`: the server's `/cache_digest`,
kvcache/digest.py), so what a replica evicted drops out of its next report. The router runs
the HTTP router's `cache_aware` policy (router/policy.py) unchanged over trees that answer
from those reports:

    match(replica, prompt) = max(
        whole blocks of the prompt whose hashes the replica reported   (its real cache),
        prefix of the prompt held by the prompts routed to it within   (not yet in a report)
            the last `horizon_s`)

The prompt is the token ids the ingress put on the call (`Call.ids`); a call without them
goes to the least-loaded replica. Loads are Ray's queue lengths of the replicas. The answer
ranks the policy's choice first and the others by load: Ray moves on to them when the first
is full, and drops a replica that died (its tree is forgotten with it).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.core.digest import block_hashes, split
from radixserve.ray.call import Call
from radixserve.router.config import RouterConfig
from radixserve.router.policy import CacheAware
from radixserve.router.tree import PrefixTree, ids_key
from radixserve.router.worker import Worker

HORIZON_S = 5.0  # prompts routed this recently count even when a report does not name them


@functools.lru_cache(maxsize=256)
def _key_hashes(key: str, block: int) -> tuple[bytes, ...]:
    return tuple(block_hashes([ord(c) for c in key], block))


class ReplicaTree(PrefixTree):
    """What one replica caches: its last report, plus the prompts routed to it since."""

    def __init__(self, horizon_s: float = HORIZON_S) -> None:
        super().__init__()
        self.horizon_s = horizon_s
        self.block = 0
        self.reported: set[bytes] = set()
        self.version: object = None
        self.sent: deque[tuple[float, str]] = deque()  # (monotonic time, key) routed here

    def report(self, stats: Mapping[str, Any]) -> None:
        """Take the replica's routing stats (`EngineReplica.record_routing_stats`)."""
        if stats.get("version") == self.version or "hashes" not in stats:
            return
        self.version = stats["version"]
        self.block, self.reported = int(stats["block"]), split(stats["hashes"])
        cutoff = time.monotonic() - self.horizon_s
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
        self.sent.append((time.monotonic(), key))


class ReportedCacheAware(CacheAware):
    """router/'s cache_aware policy over `ReplicaTree`s."""

    def __init__(self, config: RouterConfig, horizon_s: float = HORIZON_S) -> None:
        super().__init__(config)
        self.horizon_s = horizon_s

    def _tree(self, url: str) -> ReplicaTree:
        tree = self.trees.get(url)
        if not isinstance(tree, ReplicaTree):
            tree = self.trees[url] = ReplicaTree(self.horizon_s)
        return tree

    def report(self, url: str, stats: Mapping[str, Any]) -> None:
        """The replica `url`'s latest routing stats."""
        self._tree(url).report(stats)


class RadixTreeRouter(RequestRouter):
    """A Ray Serve request router for `EngineReplica`s (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        """`request_router_kwargs`: `horizon_s`, and the cache_aware policy's settings as
        `RouterConfig` names them (`cache_threshold`, `balance_abs_threshold`,
        `balance_rel_threshold`)."""
        horizon_s = float(kwargs.pop("horizon_s", HORIZON_S))
        self.policy = ReportedCacheAware(RouterConfig(**kwargs), horizon_s)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        workers = {r.replica_id.unique_id: r for r in candidate_replicas}
        for url, replica in workers.items():
            if replica.routing_stats:
                self.policy.report(url, replica.routing_stats)
        loads = {url: self._load(r) for url, r in workers.items()}
        views = [Worker(url, healthy=True, reported_load=loads[url]) for url in workers]
        ids = _prompt_ids(pending_request)
        if ids:
            chosen = self.policy.choose(views, ids_key(ids)).worker.url
        else:
            chosen = min(workers, key=lambda url: loads[url])
        rest = sorted((url for url in workers if url != chosen), key=lambda url: loads[url])
        ranks = [[workers[chosen]]]
        return ranks + [[workers[url] for url in rest]] if rest else ranks

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)

    def _load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0


def _prompt_ids(pending: PendingRequest | None) -> list[int] | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], Call):
        return None
    return pending.args[0].ids
