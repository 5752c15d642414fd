"""The llguidance backend: regex, JSON schema and EBNF as one context-free grammar, a lexer
over the token trie plus an Earley parser, the mask computed at each step (no automaton to
build up front: compiling is milliseconds).

EBNF arrives in SGLang's / llama.cpp's GBNF form (`root ::= "yes" | "no"`) and is converted to
llguidance's Lark dialect (a text already in Lark form, with a `start:` rule or a
`%llguidance` header, is taken as it is). JSON documents are compact: ", " and ": " between
items and no other whitespace, and objects take no key their `properties` do not list unless
`additionalProperties` says so -- as with the outlines backend -- so a weak model can pad a
document neither with whitespace nor with keys until it runs out of tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve.constrained.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarState,
    UnservablePattern,
)
from radixserve.constrained.bounds import check_pattern_size, shorten
from radixserve.constrained.json_schema import parse_schema
from radixserve.constrained.mask import packed_width
from radixserve.core.params import InvalidRequest

_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class LLGuidanceGrammar(CompiledGrammar):
    """A validated grammar and a matcher at its start, which each new state copies."""

    def __init__(self, start: Any, vocab_size: int, eos_ids: frozenset[int], field: str) -> None:
        self.start = start  # llguidance.LLMatcher; never advanced
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.field = field  # the request's constraint: "regex", "json_schema" or "ebnf"

    def new_state(self) -> LLGuidanceState:
        return LLGuidanceState(self)


class LLGuidanceState(GrammarState):
    """The sample's own matcher (a copy of the grammar's start)."""

    grammar: LLGuidanceGrammar

    def __init__(self, grammar: LLGuidanceGrammar) -> None:
        super().__init__(grammar)
        self.matcher = grammar.start.deep_copy()
        self._words = torch.empty((grammar.vocab_size + 31) // 32, dtype=torch.int32)

    def _mask(self) -> torch.Tensor:
        words = torch.empty_like(self._words)  # (ceil(V / 32),) int32, one bit per token
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if self.matcher.is_error():
            raise GrammarError(f"llguidance: {self.matcher.get_error()}")
        # Little-endian int32 words read as bytes are the packed uint8 format (mask.py).
        return words.view(torch.uint8)[: packed_width(self.grammar.vocab_size)]

    def _is_complete(self) -> bool:
        return bool(self.matcher.is_accepting())

    def _consume(self, token: int) -> bool:
        if not self.matcher.consume_token(token):
            # The token came from this matcher's own mask: llguidance cannot follow the
            # pattern with this vocabulary (seen for 4-byte UTF-8 characters against a
            # byte-level one: the mask offers a continuation byte that the matcher refuses).
            raise UnservablePattern(
                f"{self.grammar.field}: the grammar engine cannot follow this pattern with "
                f"this model's tokens (llguidance: {_first_line(self.matcher)})"
            )
        return bool(self.matcher.is_stopped())


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer: Any, end_id: int, eos_ids: frozenset[int], vocab_size: int):
        from llguidance.hf import from_tokenizer  # optional dependency: imported on first use

        self.eos_ids = eos_ids | {end_id}
        self.vocab_size = vocab_size
        self._tokenizer = from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=[end_id, *sorted(eos_ids - {end_id})]
        )

    def compile(self, field: str, text: str) -> LLGuidanceGrammar:
        from llguidance import LLMatcher

        grammar = _grammar(field, text)
        start = LLMatcher(self._tokenizer, grammar, log_level=0)
        if start.is_error():
            raise InvalidRequest(f"{field}: cannot compile {shorten(text)}: {_first_line(start)}")
        if start.is_stopped():  # only eos may come: the empty string
            raise InvalidRequest(f"{field}: the pattern matches only the empty string")
        return LLGuidanceGrammar(start, self.vocab_size, self.eos_ids, field)


def _grammar(field: str, text: str) -> str:
    """llguidance's grammar text for the constraint `field`; InvalidRequest naming it."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if field == "regex":
        check_pattern_size(field, text)
        return LLMatcher.grammar_from_regex(text)
    if field == "json_schema":
        closed = _closed(parse_schema(text))
        return LLMatcher.grammar_from_json_schema(closed, defaults=_JSON_OPTIONS)  # type: ignore[arg-type]
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(text))
    except Exception as e:  # the GBNF converter raises its own error types
        raise InvalidRequest(f"ebnf: cannot parse the grammar: {e}") from e


def _closed(schema: Any) -> Any:
    """`schema` with additionalProperties false on every object schema listing properties
    that does not say otherwise: the outlines backend, xgrammar (SGLang's default) and
    OpenAI's strict mode allow no unlisted key, and a weak model given the choice writes
    keys until it runs out of tokens."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _first_line(matcher: Any) -> str:
    return str(matcher.get_error()).strip().splitlines()[0][:300]
