"""Admission order of waiting samples.

lpm (longest prefix match, SGLang): samples whose prompt is most cached go first, so a
group sharing a prefix runs together while that prefix is hot. With a long queue matching
everything costs more than it saves, so lpm falls back to fcfs past LPM_QUEUE_LIMIT.
fcfs: arrival order. Retracted samples keep their original arrival key in both policies.
Under a NoPrefixCache every cached length is 0, so lpm keeps arrival order. A sample's cached
length is its salt's (`Sample.salt`), and only samples of one salt defer to each other.
"""

from __future__ import annotations

from radixserve.kvcache.prefix_cache import PrefixCache
from radixserve.scheduler.sample import Sample

LPM_QUEUE_LIMIT = 128


def order_waiting(waiting: list[Sample], cache: PrefixCache, policy: str) -> list[Sample]:
    """Return `waiting` in admission order. Reads the cache only (no split, no LRU touch)."""
    by_arrival = sorted(waiting, key=lambda r: r.arrival)
    if policy == "fcfs" or len(waiting) > LPM_QUEUE_LIMIT:
        return by_arrival
    matched = {
        id(r): cache.cached_length(r.all_ids[: r.reuse_limit()], salt=r.salt) for r in waiting
    }
    return sorted(by_arrival, key=lambda r: -matched[id(r)])


def shares_uncached_prefix(req: Sample, admitted: list[Sample], min_tokens: int) -> bool:
    """True when `req` shares >= min_tokens not-yet-cached leading tokens with a sample of
    its salt admitted this step: deferring it one step lets it reuse that sample's K/V
    instead of computing the same prefix twice (a sample of another salt cannot)."""
    ids = req.all_ids
    for other in admitted:
        if other.salt != req.salt:
            continue
        # The two share >= n leading tokens: one slice comparison (in C), not a Python loop
        # over the whole shared prefix (64 samples behind a cached 1K-token prompt: 157 ms -> 0.5 ms
        # per admission round).
        n = other.kv_len + min_tokens
        if len(ids) >= n and ids[:n] == other.all_ids[:n]:
            return True
    return False
