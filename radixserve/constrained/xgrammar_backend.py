"""The xgrammar backend (SGLang's default): regex, JSON schema and EBNF (GBNF, `root ::= ...`)
compiled into a pushdown automaton whose context-independent token masks are precomputed;
the rest of each mask is computed at the step.

JSON documents are compact (", " and ": ", no other whitespace) and objects take no key their
`properties` do not list (xgrammar's strict mode), as with the other backends. xgrammar has no
"only eos may follow" query: when the input so far completes the pattern, the next mask is
computed at once (it is needed next anyway) and the state terminates if it allows nothing
but eos.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from radixserve.constrained.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarState,
)
from radixserve.constrained.bounds import check_pattern_size, shorten
from radixserve.constrained.json_schema import parse_schema
from radixserve.constrained.mask import packed_width
from radixserve.core.params import InvalidRequest


class XGrammarGrammar(CompiledGrammar):
    def __init__(self, compiled: Any, vocab_size: int, eos_ids: frozenset[int]) -> None:
        self.compiled = compiled  # xgrammar.CompiledGrammar; shared, never mutated
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids

    def new_state(self) -> XGrammarState:
        return XGrammarState(self)


class XGrammarState(GrammarState):
    """The sample's own GrammarMatcher."""

    grammar: XGrammarGrammar

    def __init__(self, grammar: XGrammarGrammar) -> None:
        import xgrammar as xgr

        super().__init__(grammar)
        self.matcher = xgr.GrammarMatcher(
            grammar.compiled, override_stop_tokens=sorted(grammar.eos_ids)
        )
        self._next: torch.Tensor | None = None  # the next mask, when already computed

    def _mask(self) -> torch.Tensor:
        if self._next is None:
            self._next = self._fill()
        return self._next

    def _is_complete(self) -> bool:
        return bool(self.matcher.is_completed())

    def _consume(self, token: int) -> bool:
        if not self.matcher.accept_token(token):
            raise GrammarError(f"token {token} is not allowed here")
        self._next = None
        if not self.matcher.is_completed():
            return False
        self._next = self._fill()  # complete: does anything but eos may follow?
        return self.only_eos(self._next)

    def only_eos(self, mask: torch.Tensor) -> bool:
        """True when packed `mask` allows eos ids and nothing else."""
        allowed = np.unpackbits(mask.numpy(), bitorder="little").nonzero()[0]
        return len(allowed) > 0 and set(allowed.tolist()) <= self.grammar.eos_ids

    def _fill(self) -> torch.Tensor:
        words = torch.empty((1, (self.grammar.vocab_size + 31) // 32), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(words, 0)
        # Little-endian int32 words read as bytes are the packed uint8 format (mask.py).
        return words[0].view(torch.uint8)[: packed_width(self.grammar.vocab_size)]


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, end_id: int, eos_ids: frozenset[int], vocab_size: int):
        import xgrammar as xgr  # optional dependency: imported on first use

        self.eos_ids = eos_ids | {end_id}
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(self.eos_ids)
        )
        # no cache of its own: the GrammarCompiler above keeps an LRU of compiled patterns
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, field: str, text: str) -> XGrammarGrammar:
        try:
            compiled = self._compile(field, text)
        except (RuntimeError, ValueError) as e:
            if isinstance(e, InvalidRequest):
                raise
            reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise InvalidRequest(f"{field}: cannot compile {shorten(text)}: {reason}") from e
        grammar = XGrammarGrammar(compiled, self.vocab_size, self.eos_ids)
        start = grammar.new_state()
        if start.only_eos(start.allowed_tokens()):
            raise InvalidRequest(f"{field}: the pattern matches only the empty string")
        return grammar

    def _compile(self, field: str, text: str) -> Any:
        if field == "regex":
            check_pattern_size(field, text)
            return self._compiler.compile_regex(text)
        if field == "json_schema":
            parse_schema(text)
            return self._compiler.compile_json_schema(
                text, any_whitespace=False, separators=(", ", ": "), strict_mode=True
            )
        return self._compiler.compile_grammar(text)
