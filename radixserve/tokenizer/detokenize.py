"""Incremental detokenization: token ids arrive a few at a time, text leaves only once stable.

Text handed out is never taken back, so two things must be held until they are settled:

1. Incomplete characters. Byte-level BPE splits one UTF-8 character over several tokens; a
   prefix of them decodes to U+FFFD. While the decoded tail ends in U+FFFD we wait.
2. Possible stop strings. If the stable text ends with a proper prefix of a stop string
   (e.g. "###" is a stop string and the text ends in "##"), that suffix is held: the next
   token decides whether it is output or the start of the stop string, which is cut.

Decoding uses a sliding window (the scheme of SGLang/vLLM): `ids[prefix:read]` was already
turned into text; `decode(ids[prefix:]) - decode(ids[prefix:read])` is the new text. Decoding
a short window instead of all ids keeps each step O(window), and starting the window a few
tokens back (seeded from the prompt) gives tokenizers that merge a leading space into the
first word (SentencePiece) the context they need.

    ids:   [ prompt tail | already emitted ........ | new ]
                          ^prefix          ^read          ^len(ids)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.core.params import SamplingParams
from radixserve.core.request import FinishReason

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens seeding the window (enough for any merge we know)
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of ONE sample's output tokens, delivered as stable deltas.

    Contract:
    - `add(ids)` appends token ids and returns the text that became stable (maybe "").
    - `finish(reason)` returns the remaining text: held bytes are decoded as they are (U+FFFD
      if incomplete) and, for a stop-string finish, the text is cut where that stop string
      starts (the stop string itself is never output). Afterwards `add`/`finish` raise.
    - `text` is the concatenation of everything returned so far; after `finish` it is the
      sample's final output text.
    The tokenizer is only read (`decode`), never modified.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
    ) -> None:
        self._tok = tokenizer
        self._decode_kwargs = {
            "skip_special_tokens": skip_special_tokens,
            "spaces_between_special_tokens": spaces_between_special_tokens,
        }
        self._stop = [s for s in stop if s]
        tail = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = tail
        self._prefix = 0  # window start (see module docstring)
        self._read = len(tail)  # ids before this index are already in _decoded
        self._decoded = ""  # text of output ids [0, _read - len(tail)): no partial characters
        self._emitted = 0  # _decoded[:_emitted] has been returned to the caller
        self._finished = False
        self.output_ids: list[int] = []

    @classmethod
    def for_sample(
        cls, tokenizer: Any, prompt_ids: Sequence[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        """The detokenizer of one sample of a request with these sampling parameters."""
        return cls(
            tokenizer,
            prompt_ids=prompt_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
        )

    @property
    def text(self) -> str:
        return self._decoded[: self._emitted]

    def add(self, ids: Sequence[int]) -> str:
        """Append output token ids; return newly stable text."""
        assert not self._finished, "add() after finish()"
        if not ids:
            return ""
        self._ids.extend(ids)
        self.output_ids.extend(ids)
        self._decoded += self._decode_window(allow_partial=False)
        return self._emit(self._stable_end())

    def finish(self, reason: FinishReason | None) -> str:
        """Flush everything held; cut at a matched stop string. Returns the last delta."""
        assert not self._finished, "finish() called twice"
        self._finished = True
        self._decoded += self._decode_window(allow_partial=True)
        end = len(self._decoded)
        if reason is not None and reason.type == "stop" and isinstance(reason.matched, str):
            cut = self._decoded.find(reason.matched, self._emitted)
            end = cut if cut >= 0 else end
        return self._emit(end)

    def push(self, ids: Sequence[int], reason: FinishReason | None) -> str:
        """One scheduler delta: `add(ids)`, then `finish(reason)` if the sample finished.

        A matched stop token (eos or stop_token_ids) is counted in the output ids but never
        shown, so it is left out of the text here.
        """
        if reason is not None and isinstance(reason.matched, int) and ids[-1:] == [reason.matched]:
            ids = ids[:-1]
        text = self.add(ids)
        return text + self.finish(reason) if reason is not None else text

    # ---------------------------------------------------------------- internals

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, **self._decode_kwargs)

    def _decode_window(self, allow_partial: bool) -> str:
        """Text of ids[read:] given the context ids[prefix:read]; "" while incomplete."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if not allow_partial and (len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR)):
            return ""  # an incomplete character (or nothing visible yet): wait for more ids
        # Slide: the new ids become the context of the next window.
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before) :]

    def _stable_end(self) -> int:
        """End of the text that cannot turn out to belong to a stop string."""
        text, end = self._decoded, len(self._decoded)
        for s in self._stop:
            # A full occurrence: nothing from its start on may be shown.
            at = text.find(s, self._emitted)
            if at >= 0:
                end = min(end, at)
                continue
            # A proper prefix of s at the very end of the text: hold it.
            for k in range(min(len(s) - 1, len(text) - self._emitted), 0, -1):
                if text.endswith(s[:k]):
                    end = min(end, len(text) - k)
                    break
        return end

    def _emit(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._decoded[self._emitted : end]
        self._emitted = end
        return delta
