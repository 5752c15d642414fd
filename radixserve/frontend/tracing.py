"""A backend with no model: it records what a program sends and answers with placeholders.

`function.trace(...)` runs a program on it, so a program's exact prompts, sampling
parameters, forks and selects can be inspected (and tested) without loading a model.
Placeholders: a text gen named `x` produces "{x}" (an unnamed one "{gen}"); a typed gen a
value of its type ("0", "0.0", "True", '""'); a select its first option.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.request import PromptLogprob
from radixserve.frontend.backend import (
    Backend,
    BackendError,
    GenRequest,
    GenResult,
    SelectResult,
    TextCallback,
)
from radixserve.frontend.choices import ChoicesMethod
from radixserve.prompt.roles import RoleTemplate

TYPED_PLACEHOLDER = {"int": "0", "float": "0.0", "bool": "True", "str": '""'}


@dataclass(frozen=True)
class TraceEvent:
    kind: str  # "gen" | "select" | "commit"
    prompt: str  # the program's text when the call was made
    name: str | None = None
    request: GenRequest | None = None  # gen only
    choices: list[str] = field(default_factory=list)  # select only


@dataclass(frozen=True)
class Trace:
    """What `function.trace(...)` returns."""

    state: Any  # the finished ProgramState (placeholders where the model would write)
    events: list[TraceEvent]

    def of_kind(self, kind: str) -> list[TraceEvent]:
        return [e for e in self.events if e.kind == kind]


class TracingBackend(Backend):
    """Records every call in `events` (in the order calls arrive; fork children run
    concurrently, so their relative order is not defined)."""

    def __init__(self, template: RoleTemplate | None = None) -> None:
        self.template = template or RoleTemplate.plain()
        self.events: list[TraceEvent] = []
        self._lock = threading.Lock()

    def _record(self, event: TraceEvent) -> None:
        with self._lock:
            self.events.append(event)

    def generate(self, req: GenRequest, on_text: TextCallback | None = None) -> GenResult:
        self._record(TraceEvent("gen", req.prompt, req.name, req))
        if req.dtype is not None:
            text = TYPED_PLACEHOLDER[req.dtype]
        else:
            text = "{" + (req.name or "gen") + "}"
        if on_text is not None:
            on_text(text)
        meta: dict[str, Any] = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        return GenResult(text, meta)

    def commit(self, prompt: str) -> None:
        if prompt:
            self._record(TraceEvent("commit", prompt))

    def role_template(self) -> RoleTemplate:
        return self.template

    def select(
        self,
        prompt: str,
        choices: Sequence[str],
        method: ChoicesMethod,
        temperature: float,
        rng: random.Random,
    ) -> SelectResult:
        self._record(TraceEvent("select", prompt, None, None, list(choices)))
        return SelectResult(0, {"choices_method": "trace"})

    def encode(self, text: str) -> list[int]:
        raise BackendError("TracingBackend has no tokenizer")

    def prompt_logprobs(self, reqs: list[tuple[list[int], int]]) -> list[list[PromptLogprob]]:
        raise BackendError("TracingBackend has no model")
