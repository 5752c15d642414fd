"""The router's /metrics: its own view of each worker, then every worker's own metrics
with a `worker` label added (so fleet totals are sums over label sets)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from radixserve.router.pool import BackendPool

PREFIX = "radixserve_router_"


class _PoolCollector(Collector):
    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        workers = list(self.pool.workers.values())
        per_worker = {
            "worker_healthy": ("1 if the worker is routable", lambda w: int(w.healthy)),
            "worker_in_flight": ("Requests the router has open on it", lambda w: w.in_flight),
            "worker_load": ("The load the router balances on", lambda w: w.load),
        }
        for name, (doc, value) in per_worker.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["worker"])
            for w in workers:
                g.add_metric([w.url], value(w))
            yield g
        sent = CounterMetricFamily(PREFIX + "requests", "Requests routed", labels=["worker"])
        for w in workers:
            sent.add_metric([w.url], w.sent)
        yield sent
        why = CounterMetricFamily(PREFIX + "decisions", "Routing decisions", labels=["reason"])
        for reason, count in sorted(self.pool.decisions.items()):
            why.add_metric([reason], count)
        yield why
        yield CounterMetricFamily(PREFIX + "retries", "Attempts retried", value=self.pool.retries)


class _Relabeled(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


async def render(pool: BackendPool) -> bytes:
    """The router's metrics, then each healthy worker's (a worker that fails is skipped)."""
    registry = CollectorRegistry()
    registry.register(_PoolCollector(pool))
    workers = pool.healthy()
    texts = await asyncio.gather(*(_scrape(pool, w.url) for w in workers))
    merged: dict[str, Metric] = {}
    for worker, text in zip(workers, texts):
        for fam in text_string_to_metric_families(text):
            out = merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type))
            for s in fam.samples:
                out.add_sample(s.name, {**s.labels, "worker": worker.url}, s.value)
    registry.register(_Relabeled(list(merged.values())))
    return generate_latest(registry)


async def _scrape(pool: BackendPool, url: str) -> str:
    try:
        resp = await pool.client.get(url + "/metrics", headers=pool.auth, timeout=10)
    except httpx.HTTPError:
        return ""
    return resp.text if resp.status_code == 200 else ""
