"""Prometheus metrics of the api server (own registry, so several servers can share a process).

Latency histograms are observed in the api server (TTFT: request arrival -> first output
token delta; e2e: arrival -> last sample finished). Scheduler gauges and token counters are
read from a `SchedulerStats` snapshot taken at scrape time (`/metrics` asks the scheduler
first, then renders), so they are never stale by more than one scrape. Per tenant (label
`tenant`, radixserve/server/guard.py), the api server counts what each tenant's finished
samples report: requests, prompt, cached and generated tokens. `render_tenant` gives one
tenant's series alone (what an inference key sees when a keys file gives several tenants).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from radixserve.core.info import SchedulerStats
from radixserve.core.request import TextDelta
from radixserve.server.history import History

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
PREFIX = "radixserve_"


class _SchedulerCollector(Collector):
    def __init__(self) -> None:
        self.stats: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        gauges = {
            "num_running_reqs": ("Samples in the running batch", s.num_running),
            "num_queued_reqs": ("Samples waiting to be admitted", s.num_queued),
            "kv_used_tokens": ("KV slots in use (running + cached)", s.kv_used_tokens),
            "kv_held_tokens": ("KV slots held by requests (0 when idle)", s.kv_held_tokens),
            "kv_capacity_tokens": ("KV pool capacity in tokens", s.kv_capacity_tokens),
            "kv_usage": ("Fraction of the KV pool in use", s.kv_usage),
            "cache_hit_rate": ("Cached / prompt tokens since start", s.cache_hit_rate),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        counters = {
            "prompt_tokens": ("Prompt tokens of admitted requests", s.prompt_tokens_total),
            "cached_tokens": ("Prompt tokens served from the radix cache", s.cached_tokens_total),
            "generation_tokens": ("Generated tokens", s.generation_tokens_total),
            "spec_draft_tokens": ("Speculative draft tokens verified", s.draft_tokens_total),
            "spec_accepted_tokens": (
                "Speculative draft tokens accepted",
                s.accepted_draft_tokens_total,
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield from _tier_metrics(s)


def _tier_metrics(s: SchedulerStats) -> Iterator[Metric]:
    """Per KV tier (label `tier`: device, host, disk, remote; moved: hits moved from another
    position by --hicache-reposition), with --hicache-* only."""
    if not s.tiers:
        return
    families = [
        (CounterMetricFamily, "hicache_hit_tokens", "Prompt tokens served from the tier"),
        (GaugeMetricFamily, "hicache_hit_rate", "Tier hit tokens / prompt tokens since start"),
        (CounterMetricFamily, "hicache_loads", "Chunks loaded from the tier"),
        (CounterMetricFamily, "hicache_load_seconds", "Time spent loading chunks from the tier"),
        (CounterMetricFamily, "hicache_faults", "Refused records and failed reads/writes"),
        (GaugeMetricFamily, "hicache_stored_bytes", "Bytes the tier holds (remote: written)"),
    ]
    for kind, name, doc in families:
        family = kind(PREFIX + name, doc, labels=["tier"])
        for tier, t in s.tiers.items():
            values = {
                "hicache_hit_tokens": t.hit_tokens,
                "hicache_hit_rate": t.hit_tokens / max(s.prompt_tokens_total, 1),
                "hicache_loads": t.loads,
                "hicache_load_seconds": t.load_seconds,
                "hicache_faults": t.faults,
                "hicache_stored_bytes": t.stored_bytes,
            }
            family.add_metric([tier], values[name])
        yield family


@dataclass
class TenantCounts:
    requests: int = 0  # finished (every sample ended)
    prompt_tokens: int = 0  # of the first sample of each request
    cached_tokens: int = 0  # of those, found in the tenant's part of the prefix cache
    generation_tokens: int = 0  # of every sample


TENANT_SERIES = {
    "requests": "Requests finished",
    "prompt_tokens": "Prompt tokens of finished requests",
    "cached_tokens": "Prompt tokens of finished requests served from the prefix cache",
    "generation_tokens": "Tokens generated for finished samples",
}


class TenantCollector(Collector):
    """radixserve_tenant_* counters by tenant; `only`: that tenant's alone."""

    def __init__(
        self, only: str | None = None, counts: dict[str, TenantCounts] | None = None
    ) -> None:
        self.only = only
        self.counts: dict[str, TenantCounts] = {} if counts is None else counts

    def finished(self, tenant: str, d: TextDelta) -> None:
        """Count the last output `d` of a sample of `tenant` (its request's last: `done`)."""
        c = self.counts.setdefault(tenant, TenantCounts())
        c.generation_tokens += d.completion_tokens
        if d.index == 0:
            c.requests += 1
            c.prompt_tokens += d.prompt_tokens
            c.cached_tokens += d.cached_tokens

    def collect(self) -> Iterator[Metric]:
        shown = [(t, c) for t, c in self.counts.items() if self.only in (None, t)]
        for field, doc in TENANT_SERIES.items():
            family = CounterMetricFamily(PREFIX + "tenant_" + field, doc, labels=["tenant"])
            for tenant, counts in shown:
                family.add_metric([tenant], getattr(counts, field))
            yield family


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Request arrival to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Request arrival to its last sample finishing",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.history = History()  # the web console's plots
        self._sched = _SchedulerCollector()
        self.registry.register(self._sched)
        self.tenants = TenantCollector()
        self.registry.register(self.tenants)

    def render(self, stats: SchedulerStats) -> bytes:
        self._sched.stats = stats
        return generate_latest(self.registry)

    def render_tenant(self, tenant: str) -> bytes:
        """`tenant`'s own series, and nothing of the others' or of the whole server."""
        registry = CollectorRegistry()
        registry.register(TenantCollector(tenant, self.tenants.counts))
        return generate_latest(registry)
