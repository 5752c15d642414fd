"""The outlines-core backend: a regex (or a JSON schema turned into one) compiled into a DFA
over token ids; no EBNF.

A JSON schema becomes a regex (outlines' build_regex_from_schema, whitespace `[ ]?` between
tokens). The automaton allows eos exactly in accepting states. A state's mask is built on
its first visit and cached (a grammar has finitely many states), so a step costs a lookup
once the walk is warm; the whole DFA is built at compile time (seconds for a large schema).
outlines releases the GIL while it builds.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.constrained.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarState,
)
from radixserve.constrained.bounds import check_pattern_size, explain
from radixserve.constrained.json_schema import parse_schema
from radixserve.constrained.mask import pack_token_mask
from radixserve.constrained.vocab import build_vocabulary
from radixserve.core.params import InvalidRequest


class OutlinesGrammar(CompiledGrammar):
    """One pattern over one vocabulary. Immutable except its per-state mask cache."""

    def __init__(self, index: Any, vocab_size: int, end_id: int, eos_ids: frozenset[int]) -> None:
        self.index = index  # outlines_core.Index; never mutated
        self.vocab_size = vocab_size
        self.end_id = end_id  # the Vocabulary's eos token
        self.eos_ids = eos_ids | {end_id}  # all allowed wherever end_id is
        self.initial: int = index.get_initial_state()
        self._masks: dict[int, tuple[torch.Tensor, bool]] = {}  # state -> (mask, only eos)

    def new_state(self) -> OutlinesState:
        return OutlinesState(self)

    def mask(self, state: int) -> torch.Tensor:
        """Packed allowed-token mask of `state` (radixserve.constrained.mask format)."""
        return self._state_info(state)[0]

    def only_eos(self, state: int) -> bool:
        """True when eos is the one token `state` allows: the pattern is complete."""
        return self._state_info(state)[1]

    def next_state(self, state: int, token: int) -> int:
        nxt = self.index.get_next_state(state, token)
        if nxt is None:  # the mask forbade it: a bug, which fails this request alone
            raise GrammarError(f"token {token} is not allowed in state {state}")
        return int(nxt)

    def _state_info(self, state: int) -> tuple[torch.Tensor, bool]:
        info = self._masks.get(state)
        if info is None:  # at most one build per state: a grammar has finitely many
            allowed = self.index.get_allowed_tokens(state)  # list, up to the whole vocab
            if not allowed:
                raise GrammarError(f"automaton state {state} allows no token")
            only_eos = len(allowed) == 1 and allowed[0] == self.end_id
            if self.end_id in allowed:  # duplicates are harmless to pack_token_mask
                allowed = allowed + sorted(self.eos_ids)
            info = self._masks[state] = (pack_token_mask(allowed, self.vocab_size), only_eos)
        return info


class OutlinesState(GrammarState):
    """The sample's DFA state."""

    grammar: OutlinesGrammar

    def __init__(self, grammar: OutlinesGrammar) -> None:
        super().__init__(grammar)
        self.state = grammar.initial

    def _mask(self) -> torch.Tensor:
        return self.grammar.mask(self.state)

    def _is_complete(self) -> bool:
        return bool(self.grammar.index.is_final_state(self.state))

    def _consume(self, token: int) -> bool:
        self.state = self.grammar.next_state(self.state, token)
        return self.grammar.only_eos(self.state)


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, tokenizer: Any, end_id: int, eos_ids: frozenset[int], vocab_size: int):
        from outlines_core import Vocabulary  # optional dependency: imported on first use

        self.end_id, self.eos_ids, self.vocab_size = end_id, eos_ids, vocab_size
        self._vocabulary: Vocabulary = build_vocabulary(  # ~0.3 s for 49k tokens
            tokenizer, end_id, vocab_size, eos_ids - {end_id}
        )

    def compile(self, field: str, text: str) -> OutlinesGrammar:
        from outlines_core import Index

        if field == "ebnf":
            raise InvalidRequest(
                "ebnf: the outlines grammar backend does regex and json_schema only; start the "
                "server with --grammar-backend llguidance for EBNF grammars"
            )
        regex = text if field == "regex" else schema_to_regex(text)
        check_pattern_size(field, regex)
        try:
            index = Index(regex, self._vocabulary)
        except ValueError as e:
            raise InvalidRequest(f"{field}: {explain(regex, e)}") from e
        grammar = OutlinesGrammar(index, self.vocab_size, self.end_id, self.eos_ids)
        if grammar.only_eos(grammar.initial):
            raise InvalidRequest(f"{field}: the pattern matches only the empty string")
        return grammar


def schema_to_regex(schema: str) -> str:
    """JSON schema text -> regex of its JSON documents. InvalidRequest naming json_schema."""
    from outlines_core.json_schema import build_regex_from_schema

    parse_schema(schema)
    try:
        return build_regex_from_schema(schema)
    except (ValueError, TypeError, RecursionError) as e:
        raise InvalidRequest(f"json_schema: unsupported schema: {str(e).splitlines()[0]}") from e
