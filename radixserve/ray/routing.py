"""Ray Serve's replica choice by the replicas' own radix trees (`RadixTreeRouter`).

The router runs the HTTP router's `cache_aware` policy (router/policy.py) unchanged over
trees that answer from what each replica reports of its real cache and from the prompts
routed to it since (replica_tree.py). The prompt is the token ids the ingress put on the
call (`Call.ids`); a call without them goes to the least-loaded replica. Loads are Ray's
queue lengths of the replicas. The answer ranks the policy's choice first and the others by
load: Ray moves on to them when the first is full, and drops a replica that died (its tree
is forgotten with it).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.ray.call import Call
from radixserve.ray.replica_tree import HORIZON_S, ReportedCacheAware
from radixserve.router.backend import Backend
from radixserve.router.config import RouterConfig
from radixserve.router.tree import ids_key


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
        views = [Backend(url, healthy=True, reported_load=loads[url]) for url in workers]
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
