"""Sampling: the batched sampler (`sampler`) and stop rules (`stop`).

The parameters they read are `radixserve.core.params.SamplingParams`, parsed once at the edge.
"""

from __future__ import annotations

from radixserve.sampling.sampler import (
    SampledTokens,
    SamplingInfo,
    process_logits,
    prompt_logprobs,
    sample,
)
from radixserve.sampling.stop import StopChecker, trim_text

__all__ = [
    "SampledTokens",
    "SamplingInfo",
    "StopChecker",
    "process_logits",
    "prompt_logprobs",
    "sample",
    "trim_text",
]
