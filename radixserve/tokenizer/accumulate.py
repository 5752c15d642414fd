"""The one detokenize-and-accumulate step of every path: `TokenDelta`s of one sample
in, `TextDelta`s (the newly stable text, logprob token texts) out, and optionally the
sample's cumulative `SampleResult`.

Used by the tokenizer process (chunks go on to the api server, which accumulates them itself)
and by the in-process paths (`Engine`, the DSL's `EngineBackend`), which keep the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from radixserve.core.request import TextDelta, TextLogprob, TokenDelta, TokenizedRequest
from radixserve.core.result import SampleResult
from radixserve.tokenizer.detokenize import IncrementalDetokenizer


class SampleAccumulator:
    """One sample of one request.

    Contract: `push` the sample's outputs in the order the scheduler made them; the last one
    carries its finish reason, and nothing may follow it. `result` (when kept) is the sum of
    the chunks returned so far. The tokenizer is only read.
    """

    def __init__(
        self,
        detok: IncrementalDetokenizer,
        token_text: Callable[[int], str] | None = None,
        keep_result: SampleResult | None = None,
    ) -> None:
        self.detok = detok
        self.token_text = token_text  # fills the logprob entries' texts; None: left None
        self.result = keep_result

    @classmethod
    def for_sample(
        cls,
        tokenizer: Any,
        request: TokenizedRequest,
        index: int,
        texts_in_logprobs: bool = False,
        keep_result: bool = False,
    ) -> SampleAccumulator:
        """Sample `index` of `request`: its detokenizer, token texts for logprobs if asked."""

        def token_text(token: int) -> str:
            return str(tokenizer.decode([token]))

        detok = IncrementalDetokenizer.for_sample(tokenizer, request.input_ids, request.sampling)
        result = SampleResult(request.rid, index) if keep_result else None
        return cls(detok, token_text if texts_in_logprobs else None, result)

    @property
    def kept(self) -> SampleResult:
        """The cumulative result of a sample built with `keep_result`."""
        assert self.result is not None, "this accumulator keeps no result"
        return self.result

    def push(self, o: TokenDelta) -> TextDelta:
        """The chunk of one output (its text is what became stable with it)."""
        chunk = TextDelta(
            rid=o.rid,
            index=o.index,
            token_ids=list(o.new_token_ids),
            finish_reason=o.finish_reason,
            prompt_tokens=o.prompt_tokens,
            completion_tokens=o.completion_tokens,
            cached_tokens=o.cached_tokens,
            cached_tokens_details=o.cached_tokens_details,
            text=self.detok.push(o.new_token_ids, o.finish_reason),
            output_logprobs=self._entries(o.output_logprobs),
            output_top_logprobs=[self._entries(top) for top in o.output_top_logprobs],
            input_logprobs=self._entries(o.input_logprobs),
            input_top_logprobs=[self._entries(top) for top in o.input_top_logprobs],
        )
        if self.result is not None:
            self.result.apply(chunk)
        return chunk

    def _entries(self, pairs: Sequence[tuple[float | None, int]]) -> list[TextLogprob]:
        text = self.token_text
        return [(lp, t, None if text is None else text(t)) for lp, t in pairs]
