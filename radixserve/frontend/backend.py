"""The interface between the interpreter and a runtime, and the shapes that cross it.

Implementations: `EngineBackend` (in-process radixserve.Engine), `RuntimeEndpoint` (HTTP,
SGLang-native routes) and `TracingBackend` (no model: records what a program would send).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.frontend.choices import (
    ChoiceScores,
    ChoicesMethod,
    PromptLogprob,
    choose,
    score_choices,
)
from radixserve.prompt.pml import Prompt, Schema
from radixserve.prompt.roles import RoleTemplate

TextCallback = Callable[[str], None]


class BackendError(RuntimeError):
    """The runtime refused or failed a request; the message says why (and what to fix)."""


@dataclass(frozen=True)
class GenRequest:
    """One gen: the prompt text so far and SGLang-named parameters."""

    prompt: str
    sampling: dict[str, Any]  # `sampling_params` as sent (unset fields left out)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    name: str | None = None  # the variable it fills (informational)
    dtype: str | None = None  # informational: the typed gen it serves
    # Prompt modules: the imports the program began with (no text); `prompt` is the text
    # after them. None: `prompt` is the whole prompt.
    modules: Prompt | None = None

    def pml(self) -> Prompt:
        """The imports followed by the text: what a backend sends as a PML prompt."""
        assert self.modules is not None, "not a prompt-modules request"
        return Prompt(self.modules.schema, (*self.modules.children, self.prompt))


@dataclass
class GenResult:
    text: str
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SelectResult:
    index: int
    meta_info: dict[str, Any]


class Backend(ABC):
    """Where the gens and selects of programs run.

    Contract:
    - Thread-safe: the interpreter calls every method from many threads at once (fork
      children, run_batch programs); concurrent requests should be batched by the runtime.
    - Never sees or mutates a program state: it answers requests, the interpreter appends.
    - Raises BackendError for a request the runtime refuses (bad parameter, prompt too
      long); the program that sent it fails, other programs are not affected.
    """

    @abstractmethod
    def generate(self, req: GenRequest, on_text: TextCallback | None = None) -> GenResult:
        """Run one gen to completion. With `on_text`, stream: it is called with each new
        piece of output text (in order; their concatenation is the result's text)."""

    @abstractmethod
    def commit(self, prompt: str) -> None:
        """Prefill `prompt` into the runtime's prefix cache, generating nothing (fork calls
        this once so its children find the shared prefix cached). No-op for ''."""

    @abstractmethod
    def role_template(self) -> RoleTemplate:
        """Role markup of the model's chat template (computed once)."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` exactly as the runtime tokenizes a text prompt."""

    @abstractmethod
    def prompt_logprobs(self, reqs: list[tuple[list[int], int]]) -> list[list[PromptLogprob]]:
        """For each (ids, start): [(logprob, id)] of ids[start:] given the tokens before
        (None for position 0), all requests sent as one batch; nothing is generated."""

    def flush_cache(self) -> bool:
        """Empty the runtime's prefix cache; False if it is busy (nothing done)."""
        return False

    def register_schema(self, schema: Schema) -> list[str]:
        """Register a prompt-module schema (its modules' K/V encoded once); returns the module
        names. BackendError if the runtime refuses it or has no prompt modules."""
        raise BackendError(f"{type(self).__name__} has no prompt modules")

    def select(
        self,
        prompt: str,
        choices: Sequence[str],
        method: ChoicesMethod,
        temperature: float,
        rng: random.Random,
    ) -> SelectResult:
        """Score each option after `prompt` (choices.score_choices) and decide."""
        scores: ChoiceScores = score_choices(self.encode, self.prompt_logprobs, prompt, choices)
        index = choose(scores, method, temperature, rng)
        return SelectResult(index, scores.meta_info(method))
