"""Block hashes of token ids: how a prefix cache names what it holds, compactly.

A sequence of token ids is cut into blocks of `block` ids; block k's hash covers block k and,
through the previous hash, every id before it, so two sequences share their first k hashes
exactly when they share their first k * block ids (up to 64-bit collisions):

    ids:     [ t0 .. t15 | t16 .. t31 | t32 .. t40 ]      block = 16
    hashes:    h0 = H(t0..t15)   h1 = H(h0, t16..t31)     (t32..t40: a partial block, unnamed)

The prefix cache reports the hashes of the blocks it holds (kvcache/digest.py); a router
hashes a prompt the same way and counts the leading hashes a replica reports.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

HASH_BYTES = 8


def chain(prev: bytes, block_ids: Sequence[int]) -> bytes:
    """The hash of one block of ids after the block hashed `prev` (b"" for the first)."""
    data = prev + array("q", block_ids).tobytes()
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


def block_hashes(ids: Sequence[int], block: int, prev: bytes = b"") -> list[bytes]:
    """The hashes of the whole blocks of `ids`, the first chained after `prev`."""
    out = []
    for start in range(0, len(ids) - block + 1, block):
        prev = chain(prev, ids[start : start + block])
        out.append(prev)
    return out


def join(hashes: Sequence[bytes]) -> bytes:
    """Hashes as one compact byte string (HASH_BYTES each)."""
    return b"".join(hashes)


def split(packed: bytes) -> set[bytes]:
    """The hashes of a `join`ed string (a trailing partial hash is ignored)."""
    n = len(packed) // HASH_BYTES
    return {packed[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(n)}
