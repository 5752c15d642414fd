"""A `/generate` stream continued on another replica when its own fails mid-way.

The native stream's events are cumulative: each holds the text and the token ids generated
so far (core/result.py). So a stream of one prompt and one sample whose replica fails after
its first event is continued by a second call: the prompt's token ids followed by the ids
already sent, `max_new_tokens` (and `min_new_tokens`) less those, the rest of the body as
the client sent it. Its events are rewritten to read as the first call's went on: text and
ids prefixed with what was sent, the token counts the client's, the prompt's cache counts
as the first call saw them. Greedy decoding continues as it would have (the same tokens,
the K/V of the sent ones recomputed or read from a shared tier); sampling continues from
the same tokens with fresh draws. Streams of several prompts or samples, with logprobs, or
on the OpenAI routes are not continued (the ingress ends them with an error event).

`StreamResume` works on bytes and dicts only; the ingress drives it (ingress.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

DONE = b"data: [DONE]\n\n"


class StreamResume:
    """One `/generate` stream's events, held whole (an event is relayed only complete, so
    a continuation never follows half an event), and the call that continues it."""

    def __init__(self, body: dict[str, Any], prompt_ids: list[int]) -> None:
        self.body, self.prompt_ids = body, prompt_ids
        self._buffer = b""
        self.text, self.ids = "", list[int]()  # what the client has been sent
        self.finished = False  # an event with a finish reason was sent
        self.continued = False  # the call relayed now continues an earlier one
        self._before: tuple[str, list[int]] = ("", [])  # what earlier calls sent
        self._first_meta: dict[str, Any] | None = None  # the first call's, for its counts

    @staticmethod
    def of(path: str, body: Any, prompt_ids: list[int] | None) -> StreamResume | None:
        """The resume of a stream that can be continued (module docstring), else None."""
        if path != "/generate" or not isinstance(body, dict) or not prompt_ids:
            return None
        if body.get("stream") is not True or body.get("return_logprob"):
            return None
        prompt = body.get("text", body.get("input_ids"))
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and all(type(i) is int for i in prompt)
        ):
            return None  # a batch of prompts
        sampling = body.get("sampling_params", {})
        if not isinstance(sampling, dict) or sampling.get("n", 1) != 1:
            return None
        return StreamResume(body, prompt_ids)

    def events(self, chunk: bytes) -> Iterator[bytes]:
        """The complete events `chunk` ends (with the bytes held from before), rewritten
        when they come from a continuation; each is recorded as sent."""
        self._buffer += chunk
        while b"\n\n" in self._buffer:
            raw, self._buffer = self._buffer.split(b"\n\n", 1)
            yield self._event(raw) + b"\n\n"

    def _event(self, raw: bytes) -> bytes:
        if not raw.startswith(b"data: ") or raw == DONE.rstrip():
            return raw
        try:
            event = json.loads(raw[len(b"data: ") :])
        except ValueError:
            return raw
        if not isinstance(event, dict):
            return raw
        text, ids, meta = event.get("text"), event.get("output_ids"), event.get("meta_info", {})
        if not isinstance(text, str) or not isinstance(ids, list) or not isinstance(meta, dict):
            return raw  # not a token event (an error event): relayed as it is, not recorded
        if self._first_meta is None:
            self._first_meta = dict(meta)
        if self.continued:
            sent_text, sent_ids = self._before
            event["text"] = text = sent_text + text
            event["output_ids"] = ids = sent_ids + ids
            first = self._first_meta
            for key in ("prompt_tokens", "cached_tokens", "cached_tokens_details"):
                if key in first:
                    meta[key] = first[key]
            meta["completion_tokens"] = len(event["output_ids"])
            raw = b"data: " + json.dumps(event).encode()
        self.text, self.ids = text, ids
        self.finished = meta.get("finish_reason") is not None
        return raw

    def continuation(self) -> tuple[bytes, list[int]] | None:
        """The body and prompt ids of the call that continues the stream from what was
        sent; None when nothing is left to generate. Raises ValueError when what the
        replica sent is not token ids (the stream cannot be continued)."""
        if self.finished:
            return None
        if not all(type(i) is int for i in self.ids):
            raise ValueError("the replica's output_ids are not token ids")
        sampling = dict(self.body.get("sampling_params", {}))
        sent = len(self.ids)
        if "max_new_tokens" in sampling:
            left = int(sampling["max_new_tokens"]) - sent
            if left <= 0:
                return None
            sampling["max_new_tokens"] = left
        if "min_new_tokens" in sampling:
            sampling["min_new_tokens"] = max(int(sampling["min_new_tokens"]) - sent, 0)
        ids = self.prompt_ids + self.ids
        body = {k: v for k, v in self.body.items() if k not in ("text", "input_ids")}
        body.update(input_ids=ids, sampling_params=sampling, stream=True)
        self._before, self.continued = (self.text, self.ids), True
        self._buffer = b""  # half an event of the failed call is dropped
        return json.dumps(body).encode(), ids
