"""The lower KV tiers' shared vocabulary: chunks, their keys, their codec, the host tier.

A lower tier (host memory L2, disk L3, a shared Redis L4) stores the K/V of token prefixes
in fixed-size **chunks** of `CHUNK_TOKENS` tokens, addressed by content:

    chunk k of a prefix covers positions [k*C, (k+1)*C)      C = CHUNK_TOKENS
    key_k = sha256(key_{k-1} || tokens of chunk k)           key_{-1} = sha256(namespace)

so a key names the whole prefix up to the chunk's end (two conversations share a chunk only
when everything before it is equal), and any server with the same model and secret (the
namespace: models/identity.py, keyed by the secret in prefix_cache.py) finds the chunks
another one stored. A chunk's
tensor is (layers, 2, C, kv_heads, head_dim) in the KV pool's dtype: rows copied from the
pool, bit for bit, so a promoted prefix gives exactly the outputs it gave before it was
evicted.

Records that leave the process (disk files, Redis values) are untrusted input: another
process may have written them. One codec, `ChunkCodec`, writes and checks them:

    MAGIC | mac (32 B) | header length (u32) | header (JSON: dtype, shape) | payload
    payload = the chunk's token ids (int32) | the tensor's bytes
    mac     = HMAC-SHA256(secret, key || everything after the mac)

The MAC is checked before anything else is parsed, so only a holder of the secret can plant
a record, and a record moved to another key (another prefix) fails too. The header is then
parsed within a size cap and its types checked; the token ids and the shape must be the
ones the reader expects. Any failure is a `ChunkError`, which the tiers count and log as a
miss: a damaged or planted record is recomputed, never loaded and never raised.

`SealedChunkCodec` (--hicache-encrypt) also hides what a record holds: the same body (header,
token ids, rows) sealed with AES-256-GCM instead of MAC'd:

    SEALED_MAGIC | nonce (24 B) | AES-256-GCM(record key, nonce[12:], body, aad) | tag (16 B)
    seal key   = HKDF-SHA256(secret, no salt, info = SEAL_INFO)   (the MAC: the secret as is)
    record key = HMAC-SHA256(seal key, nonce[:12])
    aad        = SEALED_MAGIC || key

The nonce is random per record. Its first half picks a key per record, so GCM's 96-bit
nonce limit (about 2^32 records under one key, NIST SP 800-38D) does not bound how many
records servers sharing a secret may write: two records meet under one key and GCM nonce
only when all 192 bits repeat. GCM's tag authenticates the body and the record's key as
the MAC does, so the same checks follow it. The host tier keeps chunks in process memory as
tensors: neither codec touches them.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import queue
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from radixserve.core.info import TierStats

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

CHUNK_TOKENS = 16
MAGIC = b"RSKVCHUNK2\n"
MAC_BYTES = 32
SEALED_MAGIC = b"RSKVSEALED1\n"
NONCE_BYTES = 24  # random per record: 12 B pick the record key, 12 B are GCM's nonce
TAG_BYTES = 16
SEAL_INFO = b"radixserve hicache record seal key"  # HKDF label: the seal key's domain
NEEDS_CRYPTOGRAPHY = "--hicache-encrypt needs the cryptography package (pip install cryptography)"
MAX_HEADER_BYTES = 256  # a real header is ~70 bytes
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ChunkLayout:
    """The shape every chunk of one model's KV pool has."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, CHUNK_TOKENS, self.kv_heads, self.head_dim)

    @property
    def chunk_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def chunk_keys(namespace: str, tokens: Sequence[int]) -> list[str]:
    """Keys (hex) of every whole chunk of `tokens`, in order (see the module docstring)."""
    h = hashlib.sha256(namespace.encode()).digest()
    keys = []
    for start in range(0, len(tokens) - CHUNK_TOKENS + 1, CHUNK_TOKENS):
        chunk = tokens[start : start + CHUNK_TOKENS]
        h = hashlib.sha256(h + struct.pack(f"<{CHUNK_TOKENS}i", *chunk)).digest()
        keys.append(h[:16].hex())
    return keys


class ChunkError(ValueError):
    """A stored record that cannot be trusted (damaged, truncated, planted, another
    prefix's)."""


@dataclass(frozen=True)
class ChunkCodec:
    """Writes and checks the records of one model's chunks (the module docstring gives the
    layout). Servers share K/V exactly when they share the namespace (chunk_keys) and the
    secret. `magic` opens a record; `frame_bytes` is what protects its body (`_protect`,
    `_open`): here the MAC."""

    layout: ChunkLayout
    secret: bytes = field(repr=False)
    magic: ClassVar[bytes] = MAGIC
    frame_bytes: ClassVar[int] = MAC_BYTES

    @property
    def max_record_bytes(self) -> int:
        """No valid record is longer (a reader may refuse a longer file unread)."""
        fixed = len(self.magic) + self.frame_bytes + 4 + MAX_HEADER_BYTES
        return fixed + 4 * CHUNK_TOKENS + self.layout.chunk_bytes

    def encode(self, key: str, tokens: Sequence[int], chunk: torch.Tensor) -> bytes:
        payload = struct.pack(f"<{len(tokens)}i", *tokens) + _tensor_bytes(chunk)
        dtype = str(chunk.dtype).removeprefix("torch.")
        head = json.dumps({"dtype": dtype, "shape": list(chunk.shape)}).encode()
        body = struct.pack("<I", len(head)) + head + payload
        return self.magic + self._protect(key, body)

    def decode(self, key: str, data: bytes, tokens: Sequence[int]) -> torch.Tensor:
        """The chunk stored under `key` in `data`, checked against the tokens and layout the
        reader expects. Raises ChunkError (only) saying what is wrong."""
        try:
            return self._decode(key, data, tokens)
        except ChunkError:
            raise
        except Exception as e:  # noqa: BLE001 - untrusted bytes: any failure is a refusal
            raise ChunkError(f"unreadable record ({type(e).__name__})") from None

    def _decode(self, key: str, data: bytes, tokens: Sequence[int]) -> torch.Tensor:
        if len(data) > self.max_record_bytes:
            raise ChunkError(f"record of {len(data)} bytes, at most {self.max_record_bytes}")
        if not data.startswith(self.magic) or len(data) < len(self.magic) + self.frame_bytes + 4:
            raise ChunkError("not a chunk record of this codec (bad magic)")
        body = self._open(key, data[len(self.magic) :])
        (head_len,) = struct.unpack("<I", body[:4])
        if head_len > MAX_HEADER_BYTES:
            raise ChunkError(f"header of {head_len} bytes, at most {MAX_HEADER_BYTES}")
        header = json.loads(body[4 : 4 + head_len])
        if not isinstance(header, dict) or not isinstance(header.get("dtype"), str):
            raise ChunkError("header is not {dtype: str, shape: list}")
        layout = self.layout
        if header.get("shape") != list(layout.shape) or _DTYPES.get(header["dtype"]) != (
            layout.dtype
        ):
            raise ChunkError(f"layout {header.get('shape')} {header['dtype']} is not this pool's")
        payload = body[4 + head_len :]
        token_bytes = 4 * CHUNK_TOKENS
        if len(payload) != token_bytes + layout.chunk_bytes:
            raise ChunkError(
                f"payload of {len(payload)} bytes, expected {token_bytes + layout.chunk_bytes}"
            )
        if list(struct.unpack(f"<{CHUNK_TOKENS}i", payload[:token_bytes])) != list(tokens):
            raise ChunkError("the record holds other tokens")
        raw = torch.frombuffer(bytearray(payload[token_bytes:]), dtype=torch.uint8)
        return raw.view(layout.dtype).reshape(layout.shape)

    def _protect(self, key: str, body: bytes) -> bytes:
        """What follows the magic: mac | body."""
        return self._mac(key, body) + body

    def _open(self, key: str, framed: bytes) -> bytes:
        """The body of `framed` (what follows the magic), once its MAC under `key` holds."""
        body = framed[MAC_BYTES:]
        if not hmac.compare_digest(framed[:MAC_BYTES], self._mac(key, body)):
            raise ChunkError("MAC mismatch (damaged, or written without this server's secret)")
        return body

    def _mac(self, key: str, body: bytes) -> bytes:
        mac = hmac.new(self.secret, key.encode(), hashlib.sha256)
        mac.update(body)
        return mac.digest()


@dataclass(frozen=True)
class SealedChunkCodec(ChunkCodec):
    """The records sealed with AES-256-GCM (module docstring): without the secret a record
    tells nothing of its tokens or rows, and any change to it, or its move to another key,
    fails to open. Built at start-up: ImportError (NEEDS_CRYPTOGRAPHY) there, not at the
    first record, when the cryptography package is missing."""

    magic: ClassVar[bytes] = SEALED_MAGIC
    frame_bytes: ClassVar[int] = NONCE_BYTES + TAG_BYTES
    seal_key: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "seal_key", derive_seal_key(self.secret))

    def _protect(self, key: str, body: bytes) -> bytes:
        """What follows the magic: nonce | ciphertext | tag."""
        nonce = os.urandom(NONCE_BYTES)
        aead, gcm_nonce = self._cipher(nonce)
        return nonce + aead.encrypt(gcm_nonce, body, self.magic + key.encode())

    def _open(self, key: str, framed: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        aead, gcm_nonce = self._cipher(framed[:NONCE_BYTES])
        try:
            return aead.decrypt(gcm_nonce, framed[NONCE_BYTES:], self.magic + key.encode())
        except InvalidTag:
            raise ChunkError(
                "seal does not open (damaged, moved from another key, or sealed without this "
                "server's secret)"
            ) from None

    def _cipher(self, nonce: bytes) -> tuple[AESGCM, bytes]:
        """The record's AES-GCM (its key from the nonce's first half) and GCM nonce."""
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        half = NONCE_BYTES // 2
        record_key = hmac.new(self.seal_key, nonce[:half], hashlib.sha256).digest()
        return AESGCM(record_key), nonce[half:]


def derive_seal_key(secret: bytes) -> bytes:
    """HKDF-SHA256(secret, no salt, info=SEAL_INFO), 32 bytes: the root of every record key.
    ImportError (NEEDS_CRYPTOGRAPHY) when the cryptography package is missing."""
    try:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: F401
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    except ImportError as e:
        raise ImportError(NEEDS_CRYPTOGRAPHY) from e
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=SEAL_INFO).derive(secret)


def drain(q: queue.Queue, timeout_s: float) -> None:
    """Wait until a writer thread has taken every item of `q` off (done or dropped), at most
    `timeout_s` (tests, shutdown)."""
    deadline = time.monotonic() + timeout_s
    while q.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.005)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class TierStore(Protocol):
    """One lower tier: chunks by key.

    Contract: `put` never blocks on I/O (a slow tier queues the write and may drop it);
    `get` returns the chunk or None (absent, or a record it refused: counted in
    `counters.faults` and logged, never raised); neither raises on an I/O failure. Called
    from the scheduler thread only; a tier's own writer thread touches only its own state.
    """

    name: str
    counters: TierStats  # hit_tokens / loads / load_seconds kept by the caller; faults here

    def get(self, key: str, tokens: Sequence[int]) -> torch.Tensor | None: ...

    def contains(self, key: str) -> bool: ...

    def put(self, key: str, tokens: Sequence[int], chunk: torch.Tensor) -> None: ...

    @property
    def stored_bytes(self) -> int: ...

    def drain(self) -> None:
        """Wait until queued writes are done or dropped (tests, flush, shutdown)."""
        ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


Spill = Callable[[str, list[int], torch.Tensor], None]


class HostStore:
    """L2: chunks in host memory within a byte budget, least recently used spilled first.

    A chunk pushed out by the budget goes to `spill` (the disk tier's `put`) or is dropped.
    With `ttl_s`, a chunk not used (put or read) for that long is gone (dropped, not
    spilled): a conversation's K/V expires that long after its last turn.
    """

    name = "host"

    def __init__(
        self,
        budget_bytes: int,
        layout: ChunkLayout,
        spill: Spill | None,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.capacity = budget_bytes // layout.chunk_bytes
        assert self.capacity >= 1, f"--hicache-size holds no {layout.chunk_bytes}-byte chunk"
        self.layout = layout
        self.spill = spill
        self.ttl_s = ttl_s
        self.clock = clock
        self.counters = TierStats()
        # least recently used first: (tokens, chunk, when last used)
        self._chunks: OrderedDict[str, tuple[list[int], torch.Tensor, float]] = OrderedDict()

    def get(self, key: str, tokens: Sequence[int]) -> torch.Tensor | None:
        self._expire()
        entry = self._chunks.get(key)
        if entry is None:
            return None
        assert entry[0] == list(tokens), f"host chunk {key} holds other tokens"
        self._chunks[key] = (entry[0], entry[1], self.clock())
        self._chunks.move_to_end(key)
        return entry[1]

    def contains(self, key: str) -> bool:
        self._expire()
        return key in self._chunks

    def put(self, key: str, tokens: Sequence[int], chunk: torch.Tensor) -> None:
        assert tuple(chunk.shape) == self.layout.shape, f"chunk {tuple(chunk.shape)}"
        self._expire()
        self._chunks[key] = (list(tokens), chunk, self.clock())
        self._chunks.move_to_end(key)
        while len(self._chunks) > self.capacity:
            old, (old_tokens, old_chunk, _) = self._chunks.popitem(last=False)
            if self.spill is not None:
                self.spill(old, old_tokens, old_chunk)

    def _expire(self) -> None:
        """Drop chunks unused for ttl_s: they are the least recently used, at the front."""
        if self.ttl_s is None:
            return
        cutoff = self.clock() - self.ttl_s
        while self._chunks and next(iter(self._chunks.values()))[2] <= cutoff:
            self._chunks.popitem(last=False)

    @property
    def stored_bytes(self) -> int:
        return len(self._chunks) * self.layout.chunk_bytes

    def drain(self) -> None:
        """Nothing is queued: puts are done when they return."""

    def clear(self) -> None:
        self._chunks.clear()

    def close(self) -> None:
        self.clear()
