"""The one interface every grammar backend implements, and the registry that picks one.

    GrammarBackend             one per tokenizer, built by `make_grammar_backend(name, ...)`
      .compile(field, text)    -> CompiledGrammar; InvalidRequest naming `field` when the
                                  pattern is bad; may take long (called off the scheduler
                                  thread), thread-safe
    CompiledGrammar            one pattern over one vocabulary, shared by every sample that
                                  uses it (cached by the GrammarCompiler); immutable
      .new_state()             -> GrammarState at the pattern's start
    GrammarState               where ONE sample is: allowed_tokens() / advance() / terminated

`field` is "regex", "json_schema" or "ebnf" (SamplingParams.CONSTRAINT_FIELDS); a backend
that cannot do one refuses it with InvalidRequest naming the backends that can.

Masks are packed (radixserve.constrained.mask): uint8 (ceil(V / 8),), bit t % 8 of byte t // 8
set when token t is allowed, V the model's logits width. Every backend allows the model's
eos ids exactly where the pattern is complete; a state is *terminated* once eos was taken or
nothing but eos may follow, and the scheduler then finishes the sample ("stop").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch


class GrammarError(RuntimeError):
    """A sample's walk through its grammar broke (a token the mask should have forbidden).
    The scheduler fails that request alone (HTTP 500)."""


class UnservablePattern(GrammarError):
    """The grammar engine refused a token its own mask allowed: it cannot follow this
    request's pattern with this model's tokens. The scheduler fails that request alone with
    HTTP 422, the message naming the constraint field."""


class GrammarState(ABC):
    """Where ONE sample is in its grammar. Only `advance` mutates it (once per token).

    The rules every backend shares live here: a terminated state allows and takes no token;
    an eos id is taken only where the input so far completes the pattern, and terminates the
    state; any other token goes to the backend (`_consume`), which says whether nothing but
    eos may follow it, and then the state terminates too. A backend implements `_mask`,
    `_is_complete` and `_consume` over its own matcher.
    """

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar  # what it walks (a forked sample starts its own state of it)
        self.terminated = False  # eos taken, or only eos may follow

    def allowed_tokens(self) -> torch.Tensor:
        """Packed mask (ceil(V / 8),) uint8 of the tokens allowed next. GrammarError once
        terminated. The caller must not write to it (a backend may cache it)."""
        if self.terminated:
            raise GrammarError("a terminated grammar allows no further token")
        return self._mask()

    def advance(self, token: int) -> None:
        """Consume the sample's newest token. GrammarError if the mask forbade it."""
        if self.terminated:
            raise GrammarError(f"token {token} after the grammar terminated")
        if token in self.grammar.eos_ids:
            if not self._is_complete():
                raise GrammarError(f"eos {token} before the grammar is complete")
            self.terminated = True
            return
        self.terminated = self._consume(token)

    @abstractmethod
    def _mask(self) -> torch.Tensor:
        """`allowed_tokens` of a state not terminated."""

    @abstractmethod
    def _is_complete(self) -> bool:
        """Whether the input so far completes the pattern (an eos may come now)."""

    @abstractmethod
    def _consume(self, token: int) -> bool:
        """Take `token`, not an eos id (GrammarError if the pattern forbids it); True when
        nothing but eos may follow it."""


class CompiledGrammar(ABC):
    """A compiled pattern; samples walk it through their own states."""

    eos_ids: frozenset[int]  # every eos id it allows, exactly where the pattern is complete

    @abstractmethod
    def new_state(self) -> GrammarState:
        """A fresh state at the pattern's start."""


class GrammarBackend(ABC):
    """Compiles patterns for ONE tokenizer (see the module docstring)."""

    name: str

    @abstractmethod
    def compile(self, field: str, text: str) -> CompiledGrammar:
        """The compiled `text` of constraint `field`; InvalidRequest naming `field`."""


# name -> constructor(tokenizer, end_id, eos_ids, vocab_size); modules imported lazily so
# that a backend's library is needed only when it is chosen.
def _outlines(*args: Any) -> GrammarBackend:
    from radixserve.constrained.outlines_backend import OutlinesBackend

    return OutlinesBackend(*args)


def _llguidance(*args: Any) -> GrammarBackend:
    from radixserve.constrained.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend(*args)


def _xgrammar(*args: Any) -> GrammarBackend:
    from radixserve.constrained.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(*args)


BACKENDS: dict[str, Callable[..., GrammarBackend]] = {
    "llguidance": _llguidance,
    "outlines": _outlines,
    "xgrammar": _xgrammar,
}


def make_grammar_backend(
    name: str, tokenizer: Any, end_id: int, eos_ids: frozenset[int], vocab_size: int
) -> GrammarBackend:
    """The backend `name` (a key of BACKENDS) for `tokenizer`: `end_id` is the eos the
    automaton ends with, `eos_ids` every eos it allows there, `vocab_size` the mask width."""
    assert name in BACKENDS, f"grammar backend {name!r} is not one of {list(BACKENDS)}"
    return BACKENDS[name](tokenizer, end_id, eos_ids, vocab_size)
