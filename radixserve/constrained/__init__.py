"""Constrained decoding: regex, JSON-schema and EBNF outputs.

`GrammarCompiler` (grammar.py) compiles a request's constraint once per tokenizer (LRU cache)
with the chosen backend (backend.py, the one interface: llguidance, the default, xgrammar or
outlines-core); each sample walks its own `GrammarState`, whose packed mask (mask.py) the
sampler applies as -inf on forbidden logits. vocab.py recovers each token's raw bytes for
outlines. A backend's library is imported only when the first pattern is compiled.
"""

from __future__ import annotations

from radixserve.constrained.backend import (
    BACKENDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarState,
    make_grammar_backend,
)
from radixserve.constrained.grammar import DEFAULT_BACKEND, GrammarCompiler
from radixserve.constrained.mask import (
    pack_token_mask,
    packed_width,
    token_mask_bias,
    unpack_token_masks,
)
from radixserve.constrained.vocab import build_vocabulary, token_bytes, tokenizer_kind

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCompiler",
    "GrammarError",
    "GrammarState",
    "build_vocabulary",
    "make_grammar_backend",
    "pack_token_mask",
    "packed_width",
    "token_bytes",
    "token_mask_bias",
    "tokenizer_kind",
    "unpack_token_masks",
]
