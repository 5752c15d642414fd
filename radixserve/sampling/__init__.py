"""Sampling: parameters (one parser for every entry point), the batched sampler, stop rules.

`StopChecker` and `trim_text` are loaded lazily: stop.py needs radixserve.scheduler.io, which
itself imports radixserve.sampling.params, so importing stop.py here would be circular.
"""

from __future__ import annotations

from typing import Any

from radixserve.sampling.params import InvalidRequest, SamplingParams
from radixserve.sampling.sampler import (
    SampleResult,
    SamplingInfo,
    process_logits,
    prompt_logprobs,
    sample,
)

__all__ = [
    "InvalidRequest",
    "SampleResult",
    "SamplingInfo",
    "SamplingParams",
    "StopChecker",
    "process_logits",
    "prompt_logprobs",
    "sample",
    "trim_text",
]


def __getattr__(name: str) -> Any:
    if name in ("StopChecker", "trim_text"):
        from radixserve.sampling import stop

        return getattr(stop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
