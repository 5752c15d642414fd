"""One sample's result (the cumulative sum of its `TextDelta`s) and its SGLang-native shape.

Native result (one per sample; a batch or n > 1 gives a list, prompt-major):

    {"text": str, "output_ids": [int], "index": int (streamed batch / n > 1 only),
     "meta_info": {"id", "finish_reason": {"type", "matched"} | null, "prompt_tokens",
                   "completion_tokens", "cached_tokens", "e2e_latency",
                   # with return_logprob: lists of [logprob, token_id, text | null]
                   "input_token_logprobs", "output_token_logprobs",
                   "input_top_logprobs", "output_top_logprobs",
                   "output_token_logprobs_length"}}

In a stream (as SGLang sends it), each chunk's output_token_logprobs / output_top_logprobs
hold only the entries new in that chunk, and output_token_logprobs_length counts all so far;
text, output_ids and the input logprobs are cumulative.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.request import FinishReason, TextDelta, TextLogprob


@dataclass
class SampleResult:
    """Everything one sample produced so far (cumulative)."""

    rid: str
    index: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] = field(default_factory=dict)
    output_logprobs: list[TextLogprob] = field(default_factory=list)
    output_top_logprobs: list[list[TextLogprob]] = field(default_factory=list)
    input_logprobs: list[TextLogprob] = field(default_factory=list)
    input_top_logprobs: list[list[TextLogprob]] = field(default_factory=list)

    def apply(self, d: TextDelta) -> None:
        assert (d.rid, d.index) == (self.rid, self.index), (d.rid, d.index, self.rid, self.index)
        assert self.finish_reason is None, f"{self.rid}/{self.index}: output after finish"
        self.text += d.text
        self.output_ids.extend(d.token_ids)
        self.finish_reason = d.finish_reason
        self.prompt_tokens = d.prompt_tokens
        self.completion_tokens = d.completion_tokens
        self.cached_tokens = d.cached_tokens
        self.cached_tokens_details = d.cached_tokens_details
        self.output_logprobs.extend(d.output_logprobs)
        self.output_top_logprobs.extend(d.output_top_logprobs)
        self.input_logprobs.extend(d.input_logprobs)
        self.input_top_logprobs.extend(d.input_top_logprobs)


def native_result(
    r: SampleResult,
    created: float,
    return_logprob: bool,
    index: int | None = None,
    chunk: TextDelta | None = None,
) -> dict[str, Any]:
    """The result so far; `chunk`: a stream chunk, whose output logprobs are its own."""
    meta: dict[str, Any] = {
        "id": r.rid,
        "finish_reason": r.finish_reason.to_dict() if r.finish_reason else None,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "cached_tokens_details": r.cached_tokens_details,
        "e2e_latency": time.perf_counter() - created,
    }
    if return_logprob:
        meta["input_token_logprobs"] = [list(e) for e in r.input_logprobs]
        new: SampleResult | TextDelta = r if chunk is None else chunk
        meta["output_token_logprobs"] = [list(e) for e in new.output_logprobs]
        meta["input_top_logprobs"] = [[list(e) for e in top] for top in r.input_top_logprobs]
        meta["output_top_logprobs"] = [[list(e) for e in top] for top in new.output_top_logprobs]
        meta["output_token_logprobs_length"] = len(r.output_logprobs)
    out: dict[str, Any] = {"text": r.text, "output_ids": r.output_ids, "meta_info": meta}
    if index is not None:
        out["index"] = index
    return out
