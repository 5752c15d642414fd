"""A stream continued on another replica when its own fails mid-way.

A stream of one prompt and one sample whose replica fails after its first event is continued
by a second call: the prompt's token ids followed by the ids already sent, the token limits
less those, the other sampling fields as the client sent them. Its events are rewritten to
read as the first call's went on. Greedy decoding continues as it would have (the same
tokens, the K/V of the sent ones recomputed or read from a shared tier); sampling continues
from the same tokens with fresh draws. Text the replica held back (a token that may end in a
stop string, or an incomplete character) is decoded from the sent ids and sent with the
continuation's first event; a stop string that spans the break is not seen.

- `/generate` (`NativeResume`): the events are cumulative, each holding the text and ids so
  far (core/result.py); the continuation is a `/generate` call on `input_ids`, and its
  events get the sent text and ids in front and the client's token counts.
- `/v1/completions` and `/v1/chat/completions` (`OpenAIResume`): chunks carry deltas, so the
  call is sent with `return_token_ids` (their ids are stripped again unless the client asked
  for them). The continuation is a `/v1/completions` call on the ids, whose chunks are
  rewritten to the first call's id, object, creation time and chunk shape, and whose usage
  counts the client's prompt and every token sent.

Not continued: several prompts or samples, logprobs, echo, tools, output constraints (the
constraint would start again) and penalties (they count output tokens, which the
continuation takes as prompt); the ingress ends such a stream with an error event.
`StreamResume` works on bytes and dicts only; the ingress drives it (ingress.py).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from radixserve.core.params import CONSTRAINT_FIELDS
from radixserve.server.openai_protocol import COMPLETION_FIELDS, COMPLETIONS_DEFAULT_MAX_TOKENS

DONE = b"data: [DONE]\n\n"
OPENAI_ROUTES = ("/v1/completions", "/v1/chat/completions")
PENALTIES = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1}
# OpenAI fields that change what a continuation would have to remember, or its shape (the
# constraint fields and penalties: `_plain`)
OPENAI_REFUSED = ("logprobs", "top_logprobs", "echo", "suffix", "tools", "pml", "response_format")
# Fields a /v1/completions continuation keeps from the client's body
OPENAI_KEPT = COMPLETION_FIELDS - {"prompt", "max_tokens", "min_tokens", "rid", *OPENAI_REFUSED}

Decode = Callable[[list[int], bool], str]  # (ids, skip_special_tokens) -> text


def _plain(sampling: dict[str, Any]) -> bool:
    """No output constraint and no penalty: a continuation samples as the call would."""
    if any(sampling.get(name) is not None for name in CONSTRAINT_FIELDS):
        return False
    return all(sampling.get(name) in (None, neutral) for name, neutral in PENALTIES.items())


class StreamResume:
    """One stream's events, held whole (an event is relayed only complete, so a
    continuation never follows half an event), and the call that continues it."""

    def __init__(self, body: dict[str, Any], prompt_ids: list[int], decode: Decode) -> None:
        self.body, self.prompt_ids, self.decode = body, prompt_ids, decode
        self._buffer = b""
        self.text, self.ids = "", list[int]()  # what the client has been sent
        self.finished = False  # an event with a finish reason was sent
        self.continued = False  # the call relayed now continues an earlier one
        self._held = ""  # text of the sent ids the client has not had yet

    @staticmethod
    def of(
        path: str, body: Any, prompt_ids: list[int] | None, decode: Decode
    ) -> StreamResume | None:
        """The resume of a stream that can be continued (module docstring), else None."""
        if not isinstance(body, dict) or not prompt_ids or body.get("stream") is not True:
            return None
        if path == "/generate":
            return NativeResume(body, prompt_ids, decode) if NativeResume.fits(body) else None
        if path in OPENAI_ROUTES and OpenAIResume.fits(path, body):
            return OpenAIResume(path, body, prompt_ids, decode)
        return None

    def request(self) -> bytes:
        """The body the first call is sent with."""
        return json.dumps(self.body).encode()

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
        out = self.rewrite(event)
        return raw if out is None else b"data: " + json.dumps(out, ensure_ascii=False).encode()

    def rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """Records the event; returns it rewritten, or None to relay it as it came."""
        raise NotImplementedError

    def continuation(self, context_len: int | None = None) -> tuple[str, bytes, list[int]] | None:
        """The route, body and prompt ids of the call that continues the stream from what
        was sent; None when nothing is left to generate. `context_len`: the model's, for a
        chat without a token limit (`needs_context_len`). Raises ValueError when what the
        replica sent is not token ids, or a limit is needed and not given."""
        self.settle()
        if self.finished:
            return None
        if not all(type(i) is int for i in self.ids):
            raise ValueError("the replica's output token ids are not token ids")
        ids = self.prompt_ids + self.ids
        decoded = self.decode(self.ids, self.skip_special)
        self._held = decoded[len(self.text) :] if decoded.startswith(self.text) else ""
        made = self.make_call(ids, context_len)
        if made is None:
            return None
        self.continued = True
        self._buffer = b""  # half an event of the failed call is dropped
        return made[0], made[1], ids

    def make_call(self, ids: list[int], context_len: int | None) -> tuple[str, bytes] | None:
        raise NotImplementedError

    def settle(self) -> None:
        """Brings `text`, `ids` and `finished` up to the events relayed."""

    @property
    def needs_context_len(self) -> bool:
        """The continuation's token limit is what the model's context leaves."""
        return False

    @property
    def skip_special(self) -> bool:
        raise NotImplementedError

    def take_held(self) -> str:
        held, self._held = self._held, ""
        return held


def _left(limit: Any, sent: int) -> int:
    return int(limit) - sent


def _asked(value: Any) -> bool:
    """A field set to anything but null or false (completions' `logprobs: 0` asks)."""
    return value is not None and value is not False


class NativeResume(StreamResume):
    """A `/generate` stream. Its events are cumulative, so the first call's are relayed as
    they come and only the newest are kept, to be read if the call breaks (`settle`): a
    stream of n tokens is not parsed n times over."""

    def __init__(self, body: dict[str, Any], prompt_ids: list[int], decode: Decode) -> None:
        super().__init__(body, prompt_ids, decode)
        self._before: tuple[str, list[int]] = ("", [])  # what earlier calls sent
        self._first_meta: dict[str, Any] | None = None  # the first call's, for its counts
        self._first: bytes | None = None  # the first call's first event, unread
        self._newest: deque[bytes] = deque(maxlen=4)  # its newest events, unread

    def _event(self, raw: bytes) -> bytes:
        if self.continued:
            return super()._event(raw)
        if raw.startswith(b"data: {"):
            self._first = self._first or raw
            self._newest.append(raw)
        return raw

    def settle(self) -> None:
        if self.continued:
            return  # the continuation's events were read as they came
        for raw in (self._first, *self._newest):
            if raw is not None:
                super()._event(raw)  # records what it can read, the newest last
        self._first = None
        self._newest.clear()

    @staticmethod
    def fits(body: dict[str, Any]) -> bool:
        if body.get("return_logprob"):
            return False
        prompt = body.get("text", body.get("input_ids"))
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and all(type(i) is int for i in prompt)
        ):
            return False  # a batch of prompts
        sampling = body.get("sampling_params", {})
        return isinstance(sampling, dict) and sampling.get("n", 1) == 1 and _plain(sampling)

    @property
    def skip_special(self) -> bool:
        return self.body.get("sampling_params", {}).get("skip_special_tokens", True) is not False

    def rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        text, ids, meta = event.get("text"), event.get("output_ids"), event.get("meta_info", {})
        if not isinstance(text, str) or not isinstance(ids, list) or not isinstance(meta, dict):
            return None  # not a token event (an error event): not recorded
        if self._first_meta is None:
            self._first_meta = dict(meta)
        continued = self.continued
        if continued:
            sent_text, sent_ids = self._before
            event["text"] = text = sent_text + text
            event["output_ids"] = ids = sent_ids + ids
            first = self._first_meta
            for key in ("prompt_tokens", "cached_tokens", "cached_tokens_details"):
                if key in first:
                    meta[key] = first[key]
            meta["completion_tokens"] = len(ids)
        self.text, self.ids = text, ids
        self.finished = meta.get("finish_reason") is not None
        return event if continued else None

    def make_call(self, ids: list[int], context_len: int | None) -> tuple[str, bytes] | None:
        sampling = dict(self.body.get("sampling_params", {}))
        sent = len(self.ids)
        if "max_new_tokens" in sampling:
            left = _left(sampling["max_new_tokens"], sent)
            if left <= 0:
                return None
            sampling["max_new_tokens"] = left
        if "min_new_tokens" in sampling:
            sampling["min_new_tokens"] = max(_left(sampling["min_new_tokens"], sent), 0)
        body = {k: v for k, v in self.body.items() if k not in ("text", "input_ids")}
        body.update(input_ids=ids, sampling_params=sampling, stream=True)
        self._before = (self.text + self.take_held(), self.ids)
        return "/generate", json.dumps(body).encode()


class OpenAIResume(StreamResume):
    """A `/v1/completions` or `/v1/chat/completions` stream (delta chunks)."""

    def __init__(
        self, path: str, body: dict[str, Any], prompt_ids: list[int], decode: Decode
    ) -> None:
        super().__init__(body, prompt_ids, decode)
        self.chat = path == "/v1/chat/completions"
        self.client_ids = body.get("return_token_ids") is True  # the client asked for them
        self._head: dict[str, Any] | None = None  # the first call's id, object, created, model

    @staticmethod
    def fits(path: str, body: dict[str, Any]) -> bool:
        if any(_asked(body.get(name)) for name in OPENAI_REFUSED):
            return False
        if body.get("n", 1) != 1 or body.get("best_of", 1) != 1 or not _plain(body):
            return False
        prompt = body.get("prompt")
        if path == "/v1/completions":
            return isinstance(prompt, str) or (
                isinstance(prompt, list) and bool(prompt) and all(type(i) is int for i in prompt)
            )
        return isinstance(body.get("messages"), list)

    @property
    def skip_special(self) -> bool:
        return self.body.get("skip_special_tokens", True) is not False

    @property
    def needs_context_len(self) -> bool:
        return self.chat and self._limit() is None  # a chat without a token limit

    def _limit(self) -> Any:
        limit = self.body.get("max_tokens")
        return self.body.get("max_completion_tokens") if limit is None and self.chat else limit

    def request(self) -> bytes:
        return json.dumps({**self.body, "return_token_ids": True}).encode()

    def rewrite(self, event: dict[str, Any]) -> dict[str, Any] | None:
        choices = event.get("choices")
        if not isinstance(choices, list):
            return None  # an error event
        if self._head is None:
            self._head = {k: event.get(k) for k in ("id", "object", "created", "model")}
        if self.continued:
            event.update(self._head)
        if not choices:  # the usage chunk
            usage = event.get("usage")
            if not self.continued:
                return None
            if isinstance(usage, dict):
                event["usage"] = self._usage(usage)
            return event
        choice = choices[0]
        if not isinstance(choice, dict):
            return None
        ids = choice.get("token_ids")
        text = self._text(choice)
        if not isinstance(ids, list) or not isinstance(text, str):
            return None
        finish = choice.get("finish_reason")
        if self.continued:
            text = self.take_held() + text
            if self.chat:
                choice = {"index": 0, "delta": {"content": text} if text else {},
                          "logprobs": None, "finish_reason": finish, "token_ids": ids}  # fmt: skip
            else:
                choice = {**choice, "index": 0, "text": text}
            event["choices"] = [choice]
        self.text += text
        self.ids = self.ids + ids
        self.finished = finish is not None
        if self.client_ids and not self.continued:
            return None
        if not self.client_ids:
            choice.pop("token_ids", None)
        return event

    def _text(self, choice: dict[str, Any]) -> Any:
        """The choice's text: a chat chunk's delta, a completions chunk's (continuations')."""
        if not self.chat or self.continued:
            return choice.get("text")
        delta = choice.get("delta")
        return delta.get("content") or "" if isinstance(delta, dict) else None

    def _usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's usage as the client's call: its prompt, every token sent."""
        prompt, completion = len(self.prompt_ids), len(self.ids)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = min(cached, prompt) if type(cached) is int else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip

    def make_call(self, ids: list[int], context_len: int | None) -> tuple[str, bytes] | None:
        sent = len(self.ids)
        limit = self._limit()
        if limit is None and self.chat:
            if context_len is None:
                raise ValueError("a chat without max_tokens needs the model's context length")
            limit = context_len - len(self.prompt_ids)
        elif limit is None:
            limit = COMPLETIONS_DEFAULT_MAX_TOKENS
        left = _left(limit, sent)
        if left <= 0:
            return None
        body = {k: v for k, v in self.body.items() if k in OPENAI_KEPT}
        body.update(prompt=ids, max_tokens=left, stream=True, return_token_ids=True)
        if self.body.get("min_tokens") is not None:
            body["min_tokens"] = max(_left(self.body["min_tokens"], sent), 0)
        return "/v1/completions", json.dumps(body).encode()
