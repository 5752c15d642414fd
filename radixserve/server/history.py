"""The last minutes of serving, in 5-second buckets, for the web console's plots.

The api server sees every output chunk, so it records what the plots need itself (no
polling of the scheduler): generated tokens, time to first token, the gap between a sample's
consecutive chunks per token (inter-token latency), and each finished sample's prompt and
cached tokens (cache hit rate).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

BUCKET_S = 5.0
WINDOW_S = 600.0  # ten minutes


@dataclass
class _Bucket:
    start: float
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class History:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.buckets: deque[_Bucket] = deque(maxlen=int(WINDOW_S / BUCKET_S))

    def _now(self) -> _Bucket:
        start = self.clock() // BUCKET_S * BUCKET_S
        if not self.buckets or self.buckets[-1].start != start:
            self.buckets.append(_Bucket(start))
        return self.buckets[-1]

    def tokens(self, n: int) -> None:
        self._now().tokens += n

    def ttft(self, seconds: float) -> None:
        self._now().ttft.append(seconds)

    def itl(self, seconds: float) -> None:
        self._now().itl.append(seconds)

    def finished(self, prompt_tokens: int, cached_tokens: int) -> None:
        b = self._now()
        b.prompt_tokens += prompt_tokens
        b.cached_tokens += cached_tokens

    def series(self) -> dict[str, Any]:
        """One point per bucket of the window (empty buckets included, so time is linear)."""
        end = self.clock() // BUCKET_S * BUCKET_S
        by_start = {b.start: b for b in self.buckets}
        points = []
        for i in range(int(WINDOW_S / BUCKET_S) - 1, -1, -1):
            start = end - i * BUCKET_S
            b = by_start.get(start, _Bucket(start))
            points.append(
                {
                    "t": start,
                    "tokens_per_s": b.tokens / BUCKET_S,
                    "ttft_p50": _percentile(b.ttft, 0.5),
                    "ttft_p99": _percentile(b.ttft, 0.99),
                    "itl_p50": _percentile(b.itl, 0.5),
                    "itl_p99": _percentile(b.itl, 0.99),
                    "cache_hit_rate": b.cached_tokens / b.prompt_tokens
                    if b.prompt_tokens
                    else None,
                }
            )
        return {"bucket_s": BUCKET_S, "window_s": WINDOW_S, "points": points}
