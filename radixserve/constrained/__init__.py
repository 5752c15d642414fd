"""Constrained decoding: regex and JSON-schema outputs through outlines-core automata.

`GrammarCompiler` (grammar.py) compiles a request's pattern once per tokenizer (LRU cache);
each sample walks its own `GrammarState`, whose packed mask (mask.py) the sampler applies as
-inf on forbidden logits. vocab.py recovers each token's raw bytes for the automaton.
outlines-core itself is imported only when the first pattern is compiled.
"""

from __future__ import annotations

from radixserve.constrained.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarState,
    schema_to_regex,
)
from radixserve.constrained.mask import (
    pack_token_mask,
    packed_width,
    token_mask_bias,
    unpack_token_masks,
)
from radixserve.constrained.vocab import build_vocabulary, token_bytes, tokenizer_kind

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarState",
    "build_vocabulary",
    "pack_token_mask",
    "packed_width",
    "schema_to_regex",
    "token_bytes",
    "token_mask_bias",
    "tokenizer_kind",
    "unpack_token_masks",
]
