"""When does one sample stop: stop tokens, stop strings (across token boundaries), length.

`StopChecker.check(output_ids)` is called once after every new token of a sample (and once
with [] for max_new_tokens == 0). Checks, in order:

  1. stop token: the last token is in stop_token_ids, or is an eos id unless ignore_eos
     -> FinishReason("stop", matched=token_id);
  2. stop string: a stop string occurs in the text that the last token added
     -> FinishReason("stop", matched=stop_string);
  3. length: len(output_ids) >= max_new_tokens -> FinishReason("length").

1 and 2 count only once the tokens BEFORE the last one number at least min_new_tokens, i.e.
len(output_ids) > min_new_tokens -- the same rule by which the sampler masks eos and
stop_token_ids while len(output_ids) < min_new_tokens before a draw. A stop string completed
inside that window is not matched later. A stop on the last allowed token reports "stop".

Stop strings are found without decoding the whole output: only the last W + 1 tokens are
decoded, W = (UTF-8 length of the longest stop string) + _TAIL_MARGIN. A string of b bytes
spans at most b tokens (every token of a byte-level BPE carries >= 1 byte), so the window
always starts before any stop string that the newest token completes; the margin absorbs
a token straddling the string's start and a few zero-width special tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from radixserve.core.params import SamplingParams
from radixserve.core.request import FinishReason

_TAIL_MARGIN = 4


def trim_text(text: str, reason: FinishReason | None) -> str:
    """Cut `text` at the first occurrence of the matched stop string (excluded from output).

    Stop tokens and other finish reasons leave the text unchanged (stop token ids are never
    detokenized into the text in the first place).
    """
    if reason is None or reason.type != "stop" or not isinstance(reason.matched, str):
        return text
    cut = text.find(reason.matched)
    return text if cut < 0 else text[:cut]


class StopChecker:
    """Stop conditions of ONE sample. Holds no per-token state: `check` reads only its input.

    `tokenizer` is a transformers tokenizer (only `decode(ids, skip_special_tokens=...)` is
    used); it may be None when the params have no stop strings.
    """

    trim_text = staticmethod(trim_text)

    def __init__(
        self, params: SamplingParams, eos_token_ids: Iterable[int], tokenizer: Any | None
    ) -> None:
        self.params = params
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.stop_ids: frozenset[int] = frozenset(params.stop_token_ids) | eos
        self.stop_strs: tuple[str, ...] = tuple(params.stop)
        assert tokenizer is not None or not self.stop_strs, (
            f"stop strings {self.stop_strs} need a tokenizer"
        )
        self.tokenizer: Any = tokenizer
        longest = max((len(s.encode("utf-8")) for s in self.stop_strs), default=0)
        self.window = longest + _TAIL_MARGIN  # tokens decoded before the newest one

    def check(self, output_ids: list[int]) -> FinishReason | None:
        """Finish reason after the newest token (output_ids[-1]), or None to continue."""
        n = len(output_ids)
        if n > self.params.min_new_tokens:
            last = output_ids[-1]
            if last in self.stop_ids:
                return FinishReason("stop", matched=last)
            matched = self._match_stop_str(output_ids) if self.stop_strs else None
            if matched is not None:
                return FinishReason("stop", matched=matched)
        if n >= self.params.max_new_tokens:
            return FinishReason("length")
        return None

    def _match_stop_str(self, output_ids: list[int]) -> str | None:
        """The stop string occurring earliest among those the newest token completes."""
        tail = output_ids[-(self.window + 1) :]  # window tokens + the newest one
        skip = self.params.skip_special_tokens
        before = self.tokenizer.decode(tail[:-1], skip_special_tokens=skip)
        after = self.tokenizer.decode(tail, skip_special_tokens=skip)
        # Text up to `fresh` is unchanged by the newest token. A trailing partial UTF-8
        # character ('\ufffd') that the newest token completes is NOT unchanged.
        fresh = _common_prefix_len(before, after)
        best: tuple[int, str] | None = None
        for s in self.stop_strs:
            # An occurrence must end after `fresh`, i.e. start at >= fresh - len(s) + 1.
            start = after.find(s, max(0, fresh - len(s) + 1))
            if start >= 0 and (best is None or start < best[0]):
                best = (start, s)
        return None if best is None else best[1]


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
