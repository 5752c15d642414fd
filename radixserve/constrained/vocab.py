"""Raw bytes of every token, and the outlines-core Vocabulary built from them.

A regex constrains BYTES of output text, so the automaton must see each token as the bytes it
adds to the output -- not as `tokenizer.decode([id])`, which turns half of a multi-byte UTF-8
character into U+FFFD and drops SentencePiece's leading space. Two token spellings exist:

- byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2): every byte is spelled as one printable
  unicode character (GPT-2's bytes_to_unicode table: printable Latin-1 bytes map to
  themselves, the 68 others to U+0100 onward in byte order), so "Ġthe" is b" the";
- SentencePiece (Llama 2, Mistral): "▁" stands for a space and "<0xNN>" is the raw byte NN
  (byte fallback); every other piece is UTF-8 text.

Special tokens (bos, eos, chat markers) produce no text: they are left out of the Vocabulary.
eos is the Vocabulary's end token, which the automaton allows exactly in accepting states.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

logger = logging.getLogger("radixserve.constrained")

BYTE_LEVEL = "byte_level"
SENTENCEPIECE = "sentencepiece"
_SP_SPACE = "\u2581"  # "▁", SentencePiece's visible space
_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the character spelling byte b -> b."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}  # 188 bytes spelled as themselves
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(0x100 + i): b for i, b in enumerate(others)})  # 68 bytes, in order
    assert len(table) == 256, f"GPT-2 byte table has {len(table)} entries"
    return table


def tokenizer_kind(tokenizer: Any) -> str:
    """BYTE_LEVEL or SENTENCEPIECE, read from the fast tokenizer's decoder.

    Raises ValueError for a tokenizer whose tokens are neither (their bytes are unknown).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = None if backend is None else backend.decoder
    if decoder is not None:
        spec = json.dumps(json.loads(decoder.__getstate__()))  # nested decoder configs
        if '"ByteLevel"' in spec:
            return BYTE_LEVEL
        if '"ByteFallback"' in spec or '"Metaspace"' in spec or _SP_SPACE in spec:
            return SENTENCEPIECE
    vocab = tokenizer.get_vocab()  # no decoder to read: recognise the spellings instead
    if "<0x0A>" in vocab or any(t.startswith(_SP_SPACE) for t in vocab):
        return SENTENCEPIECE
    if "Ċ" in vocab or any(t.startswith("Ġ") for t in vocab):  # "\n" and " x" in GPT-2 spelling
        return BYTE_LEVEL
    raise ValueError(
        f"constrained decoding: cannot tell how {type(tokenizer).__name__} spells token bytes "
        "(neither byte-level BPE nor SentencePiece)"
    )


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """Entry i: the bytes token i adds to the output text; None for special tokens and for
    tokens whose spelling does not decode (logged). Length: len(tokenizer)."""
    kind = tokenizer_kind(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    added = dict(tokenizer.added_tokens_decoder)  # id -> AddedToken
    special = set(tokenizer.all_special_ids) | {i for i, tok in added.items() if tok.special}
    to_bytes = _byte_level_bytes if kind == BYTE_LEVEL else _sentencepiece_bytes
    table = gpt2_unicode_to_byte()
    out: list[bytes | None] = []
    bad = []
    for i, piece in enumerate(pieces):
        if i in special or piece is None:
            out.append(None)
        elif i in added:  # added tokens are stored as plain text, never re-spelled
            out.append(added[i].content.encode("utf-8"))
        else:
            b = to_bytes(piece, table)
            bad += [piece] if b is None else []
            out.append(b)
    if bad:
        logger.warning("constrained decoding: %d tokens without bytes, e.g. %r", len(bad), bad[:5])
    return out


def _byte_level_bytes(piece: str, table: dict[str, int]) -> bytes | None:
    try:
        return bytes(table[c] for c in piece)
    except KeyError:  # a character outside the 256 byte spellings
        return None


def _sentencepiece_bytes(piece: str, table: dict[str, int]) -> bytes | None:
    m = _SP_BYTE.fullmatch(piece)
    if m is not None:
        return bytes([int(m.group(1), 16)])
    return piece.replace(_SP_SPACE, " ").encode("utf-8")


def build_vocabulary(
    tokenizer: Any, eos_token_id: int, vocab_size: int, excluded: frozenset[int] = frozenset()
) -> Any:
    """outlines_core.Vocabulary of every token id < vocab_size with non-empty bytes, except
    `excluded` (the other eos ids) and eos_token_id, which becomes its end token.

    Tokens sharing the same bytes map to one entry with several ids. Raises ValueError when
    the tokenizer's token spelling is unknown (see `tokenizer_kind`).
    """
    from outlines_core import Vocabulary  # optional dependency: imported on first use

    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(token_bytes(tokenizer)[:vocab_size]):
        if b and i != eos_token_id and i not in excluded:
            by_bytes.setdefault(b, []).append(i)
    assert by_bytes, f"no token of {type(tokenizer).__name__} has bytes"
    return Vocabulary(eos_token_id, by_bytes)
