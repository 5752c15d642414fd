"""HiCache over a real KVPool, without a model: demotion on eviction, promotion on a match
(rows bit for bit), per-tier counts, KV accounting back to baseline; the disk tier's files,
restart, and its faults (corrupt, truncated, missing file, full disk) falling back to a
shorter match, never to wrong rows; records MAC'd and sealed (--hicache-encrypt), what each
shows of the prompt and the rows."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from radixserve.config import EngineConfig
from radixserve.core.request import SHARED
from radixserve.kvcache.disk_store import DiskStore
from radixserve.kvcache.hicache import HiCache, pool_layout
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.prefix_cache import make_prefix_cache
from radixserve.kvcache.tier_store import (
    CHUNK_TOKENS,
    MAC_BYTES,
    MAGIC,
    NONCE_BYTES,
    SEAL_INFO,
    SEALED_MAGIC,
    ChunkCodec,
    ChunkError,
    ChunkLayout,
    HostStore,
    SealedChunkCodec,
    chunk_keys,
)

C = CHUNK_TOKENS
TOKENS = list(range(1000, 1064))  # 4 whole chunks
SECRET = b"a secret shared by the test servers"


def make_pool(capacity: int = 128, layers: int = 2, heads: int = 1, dim: int = 4) -> KVPool:
    return KVPool(capacity + 1, layers, heads, dim, torch.float32)


def computed(pool: KVPool, tokens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots holding `tokens`' "K/V" (seeded random rows, a function of the tokens), and
    those rows (layers, 2, T, H, D) as the reference a promotion must reproduce."""
    slots = pool.alloc(len(tokens))
    assert slots is not None
    g = torch.Generator().manual_seed(seed)
    shape = (len(tokens), *pool.k[0].shape[1:])
    rows = []
    for layer in range(len(pool.k)):
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        pool.write(layer, slots, k, v)
        rows.append(torch.stack([k, v]))
    return slots, torch.stack(rows)


def rows_at(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    pool.wait_loads()  # promoted rows are written layer by layer by the loader thread
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in zip(pool.k, pool.v)])


def codec(pool: KVPool, secret: bytes = SECRET, sealed: bool = False) -> ChunkCodec:
    return (SealedChunkCodec if sealed else ChunkCodec)(pool_layout(pool), secret)


def host_cache(pool: KVPool, chunks: int = 64, disk: DiskStore | None = None) -> HiCache:
    layout = pool_layout(pool)
    host = HostStore(chunks * layout.chunk_bytes, layout, None if disk is None else disk.put)
    return HiCache(pool, [host] if disk is None else [host, disk], None, "test")


def test_evicted_prefix_comes_back_from_host_bit_for_bit() -> None:
    pool = make_pool()
    cache = host_cache(pool)
    slots, ref = computed(pool, TOKENS[:40])
    cache.insert(TOKENS[:40], slots)
    assert cache.evict(40) == 40
    assert pool.num_free == pool.capacity  # the pool is empty again; the host kept 2 chunks
    assert cache.local[0].stored_bytes == 2 * pool_layout(pool).chunk_bytes
    m = cache.match_prefix(TOKENS[:40] + [7])
    assert m.tier_tokens == {"host": 32}  # the 8-token tail of the leaf was not a whole chunk
    assert torch.equal(rows_at(pool, m.indices), ref[:, :, :32])
    cache.check_integrity()
    again = cache.match_prefix(TOKENS[:40])
    assert again.tier_tokens == {"device": 32} and torch.equal(again.indices, m.indices)
    cache.flush()
    assert pool.num_free == pool.capacity and cache.local[0].stored_bytes == 0
    cache.check_integrity()


def test_layerwise_load_has_written_a_layer_once_its_write_returns() -> None:
    """What an attention backend relies on: `pool.write(layer, ...)` (its first touch of a
    layer in a step) returns only once the promoted rows of that layer are there."""
    pool = make_pool(capacity=256, layers=6, heads=2, dim=8)
    cache = host_cache(pool)
    tokens = list(range(30000, 30000 + 8 * C))
    slots, ref = computed(pool, tokens)
    cache.insert(tokens, slots)
    cache.evict(len(tokens))
    spare = pool.alloc(1)
    assert spare is not None
    new = torch.zeros(1, 2, 8)
    with pool._loaded:  # the loader stops after its first layer, at its notify
        m = cache.match_prefix(tokens + [1])
        assert m.tier_tokens == {"host": len(tokens)}
        step = threading.Thread(target=pool.write, args=(4, spare, new, new))
        step.start()
        step.join(timeout=0.3)
        assert step.is_alive()  # layer 4 is not loaded yet: the step waits
    step.join(timeout=10)
    assert not step.is_alive()
    assert torch.equal(pool.k[4][m.indices], ref[4, 0])
    assert torch.equal(pool.v[4][m.indices], ref[4, 1])
    pool.free(spare)
    cache.check_integrity()


def test_reference_path_loads_every_layer_before_match_returns() -> None:
    pool = make_pool()
    layout = pool_layout(pool)
    cache = HiCache(pool, [HostStore(64 * layout.chunk_bytes, layout, None)], None, "test", False)
    slots, ref = computed(pool, TOKENS)
    cache.insert(TOKENS, slots)
    cache.evict(64)
    m = cache.match_prefix(TOKENS + [1])
    assert pool._load_queue is None  # no loader thread: written here
    got = torch.stack([torch.stack([k[m.indices], v[m.indices]]) for k, v in zip(pool.k, pool.v)])
    assert torch.equal(got, ref)
    cache.check_integrity()


def test_match_mixes_device_and_host_mid_chunk() -> None:
    pool = make_pool()
    cache = host_cache(pool)
    slots, ref = computed(pool, TOKENS)
    cache.insert(TOKENS, slots)
    cache.evict(64)
    m = cache.match_prefix(TOKENS[:20])  # 16 tokens promoted (chunk 0), the rest recomputed
    cache.lock(m.last_node)
    assert m.tier_tokens == {"host": 16}
    extra = pool.alloc(4)
    assert extra is not None
    pool.write(0, extra, ref[0, 0, 16:20], ref[0, 1, 16:20])
    cache.insert(TOKENS[:20], torch.cat([m.indices, extra]))  # now 20 tokens in the pool
    cache.unlock(m.last_node)
    full = cache.match_prefix(TOKENS + [1])
    assert full.tier_tokens == {"device": 20, "host": 44}  # chunk 1 loaded from offset 4
    assert torch.equal(rows_at(pool, full.indices[20:]), ref[:, :, 20:])
    cache.check_integrity()


def test_promotion_evicts_other_leaves_but_never_the_matched_path() -> None:
    pool = make_pool(capacity=48)
    cache = host_cache(pool)
    slots, ref = computed(pool, TOKENS[:32])
    cache.insert(TOKENS[:32], slots)
    cache.evict(32)  # in the host now
    other, _ = computed(pool, list(range(5000, 5048)), seed=1)
    cache.insert(list(range(5000, 5048)), other)  # the pool is full of another prefix
    assert pool.num_free == 0
    m = cache.match_prefix(TOKENS[:33])
    assert m.tier_tokens == {"host": 32}
    assert torch.equal(rows_at(pool, m.indices), ref)
    cache.check_integrity()


def test_evict_spares_what_a_queued_request_needs() -> None:
    pool = make_pool()
    cache = host_cache(pool)
    a, b = TOKENS[:32], list(range(7000, 7032))
    cache.insert(a, computed(pool, a)[0])  # older: LRU would evict it first
    cache.insert(b, computed(pool, b, seed=1)[0])
    cache.prefetch([(a + [5], SHARED)])  # a request for `a` is waiting
    assert cache.evict(32) == 32
    assert cache.cached_length(a) == 32 and cache.cached_length(b) == 0
    assert cache.evict(32) == 32  # nothing else left: the queued one's path goes too
    assert cache.cached_length(a) == 0 and pool.num_free == pool.capacity
    cache.check_integrity()


def test_prefix_cache_factory_builds_the_tiers(tmp_path: Path) -> None:
    pool = make_pool()
    cfg = EngineConfig(hicache_size=0.001, hicache_dir=str(tmp_path))
    cache = make_prefix_cache(cfg, pool, "m")
    assert isinstance(cache, HiCache)
    assert [t.name for t in cache.local] == ["host", "disk"]
    cache.close()
    secret = SECRET.decode()
    names = {}
    for encrypt in (False, True):
        cfg = EngineConfig(
            hicache_size=0.001, hicache_dir=str(tmp_path), hicache_secret=secret,
            hicache_encrypt=encrypt,
        )  # fmt: skip
        cache = make_prefix_cache(cfg, pool, "m")
        assert isinstance(cache, HiCache)
        disk = cache.local[1]
        assert isinstance(disk, DiskStore)
        assert type(disk.codec) is (SealedChunkCodec if encrypt else ChunkCodec)
        names[encrypt] = cache.namespace
        cache.close()
    assert names[True] == names[False] + "|sealed"  # neither reads nor overwrites the other
    with pytest.raises(ValueError, match="hicache_dir needs hicache_size"):
        EngineConfig(hicache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="hicache_remote"):
        EngineConfig(hicache_remote="http://x")


# ---------------------------------------------------------------- the codec


def record_key(secret: bytes, nonce: bytes) -> bytes:
    """A sealed record's AES key, derived as tier_store.py's docstring states, here apart
    from the codec: HMAC-SHA256(HKDF-SHA256(secret, info=SEAL_INFO), nonce[:12])."""
    seal_key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=SEAL_INFO).derive(secret)
    return hmac.new(seal_key, nonce[:12], hashlib.sha256).digest()


def body_of(data: bytes, key: str, secret: bytes, sealed: bool) -> bytes:
    """The body (header length, header, payload) of the good record `data` of `key`."""
    if not sealed:
        return data[len(MAGIC) + MAC_BYTES :]
    at = len(SEALED_MAGIC) + NONCE_BYTES
    nonce = data[len(SEALED_MAGIC) : at]
    aead = AESGCM(record_key(secret, nonce))
    return aead.decrypt(nonce[12:], data[at:], SEALED_MAGIC + key.encode())


def framed(body: bytes, key: str, secret: bytes, sealed: bool) -> bytes:
    """`body` as a record of `key` MAC'd or sealed with `secret`: what a writer holding that
    secret could plant."""
    if not sealed:
        return MAGIC + hmac.new(secret, key.encode() + body, hashlib.sha256).digest() + body
    nonce = os.urandom(NONCE_BYTES)
    aead = AESGCM(record_key(secret, nonce))
    return SEALED_MAGIC + nonce + aead.encrypt(nonce[12:], body, SEALED_MAGIC + key.encode())


def forge(
    body: bytes,
    key: str,
    secret: bytes,
    sealed: bool,
    head: bytes | None = None,
    payload: bytes | None = None,
) -> bytes:
    """A record built around `body`'s parts, with a new header and/or payload."""
    head_len = int.from_bytes(body[:4], "little")
    old_head, old_payload = body[4 : 4 + head_len], body[4 + head_len :]
    head = old_head if head is None else head
    new = len(head).to_bytes(4, "little") + head + (old_payload if payload is None else payload)
    return framed(new, key, secret, sealed)


POISONS = [
    "bit flipped", "truncated", "empty", "magic", "oversize", "another secret",
    "moved from another key", "deep header", "deep header, in the cap", "dtype a list",
    "header a list", "header not UTF-8", "shape of another pool", "short payload",
]  # fmt: skip


def poisoned_records(
    data: bytes, key: str, secret: bytes, sealed: bool = False
) -> dict[str, bytes]:
    """Every kind of record a tier must refuse, built from the good record `data` of `key`
    (MAC'd, or sealed)."""
    body = body_of(data, key, secret, sealed)

    def forged(head: bytes | None = None, payload: bytes | None = None) -> bytes:
        return forge(body, key, secret, sealed, head, payload)

    flipped = bytearray(data)
    flipped[-5] ^= 0x40
    return {
        "bit flipped": bytes(flipped),
        "truncated": data[:-3],
        "empty": b"",
        "magic": b"X" + data[1:],
        "oversize": data + bytes(1 << 20),
        "another secret": forge(body, key, b"another server's secret", sealed),
        "moved from another key": forge(body, "another key", secret, sealed),
        "deep header": forged(head=b"[" * 100_000),
        "deep header, in the cap": forged(head=b"[" * 200),
        "dtype a list": forged(head=b'{"dtype": ["float32"], "shape": 1}'),
        "header a list": forged(head=b'["float32"]'),
        "header not UTF-8": forged(head=b'{"dtype": "\xff\xfe"}'),
        "shape of another pool": forged(head=b'{"dtype": "float32", "shape": [1, 2, 3]}'),
        "short payload": forged(payload=b"\0" * 64),
    }


SEALED = pytest.mark.parametrize("sealed", [False, True], ids=["mac", "sealed"])


@SEALED
def test_codec_refuses_what_it_cannot_trust(sealed: bool) -> None:
    pool = make_pool()
    c = codec(pool, sealed=sealed)
    chunk = torch.randn(c.layout.shape)
    toks, key = TOKENS[:C], "k0"
    data = c.encode(key, toks, chunk)
    assert torch.equal(c.decode(key, data, toks), chunk)
    poisons = poisoned_records(data, key, SECRET, sealed)
    assert list(poisons) == POISONS
    for bad in poisons.values():
        with pytest.raises(ChunkError):  # never RecursionError, TypeError, ...
            c.decode(key, bad, toks)
    with pytest.raises(ChunkError, match="other tokens"):
        c.decode(key, data, TOKENS[C : 2 * C])
    with pytest.raises(ChunkError, match="MAC|seal"):  # a server without the secret reads nothing
        codec(pool, b"another server's secret", sealed).decode(key, data, toks)
    with pytest.raises(ChunkError, match="bad magic"):  # the other codec's record
        codec(pool, sealed=not sealed).decode(key, data, toks)


def test_every_byte_of_a_sealed_record_is_checked() -> None:
    """Each byte of a sealed record flipped, and the record cut at every length: a
    ChunkError each time, never another exception, never rows."""
    pool = make_pool()
    c = codec(pool, sealed=True)
    toks, key = TOKENS[:C], "k0"
    data = c.encode(key, toks, torch.randn(c.layout.shape))
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        with pytest.raises(ChunkError):
            c.decode(key, bytes(flipped), toks)
    for end in range(len(data)):
        with pytest.raises(ChunkError):
            c.decode(key, data[:end], toks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sealed_record_opens_as_documented(dtype: torch.dtype) -> None:
    """A sealed record is SEALED_MAGIC | nonce | AES-256-GCM of the MAC'd record's body under
    the documented keys (opened here without the codec); a fresh nonce per record; it comes
    back bit for bit in every pool dtype."""
    layout = ChunkLayout(num_layers=2, kv_heads=2, head_dim=8, dtype=dtype)
    mac, sealed = ChunkCodec(layout, SECRET), SealedChunkCodec(layout, SECRET)
    chunk = torch.randn(layout.shape).to(dtype)
    toks, key = TOKENS[:C], "k0"
    data = sealed.encode(key, toks, chunk)
    assert data.startswith(SEALED_MAGIC) and len(data) <= sealed.max_record_bytes
    mac_body = body_of(mac.encode(key, toks, chunk), key, SECRET, False)
    assert body_of(data, key, SECRET, True) == mac_body
    again = sealed.encode(key, toks, chunk)
    assert again[: len(SEALED_MAGIC) + NONCE_BYTES] != data[: len(SEALED_MAGIC) + NONCE_BYTES]
    assert again[len(SEALED_MAGIC) + NONCE_BYTES :] != data[len(SEALED_MAGIC) + NONCE_BYTES :]
    for record in (data, again):
        out = sealed.decode(key, record, toks)
        assert out.dtype == dtype and torch.equal(out, chunk)
    assert repr(sealed) == f"SealedChunkCodec(layout={layout!r})"  # no secret, no key


def shown(records: list[bytes], tokens: list[int], rows: torch.Tensor) -> tuple[int, int]:
    """How many runs of 4 consecutive `tokens` (as the int32 bytes a record stores) and how
    many of `rows`' rows (one token's K or V at one layer, (layers, 2, T, H, D)) appear, as
    bytes, in any of `records`."""
    runs = [struct.pack("<4i", *tokens[i : i + 4]) for i in range(len(tokens) - 3)]
    per_row = rows.reshape(-1, rows.shape[-2] * rows.shape[-1])
    row_bytes = [r.contiguous().numpy().tobytes() for r in per_row]
    return (
        sum(any(run in r for r in records) for run in runs),
        sum(any(row in r for r in records) for row in row_bytes),
    )


@SEALED
def test_only_a_sealed_record_hides_the_prompt_and_rows(sealed: bool) -> None:
    pool = make_pool(heads=2, dim=8)
    c = codec(pool, sealed=sealed)
    chunk = torch.randn(c.layout.shape)
    toks = TOKENS[:C]
    data = c.encode("k0", toks, chunk)
    runs, rows = shown([data], toks, chunk)
    every = (C - 3, chunk.numel() // (2 * 8))  # every run, every row
    assert (runs, rows) == ((0, 0) if sealed else every)


def test_a_missing_cryptography_package_fails_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the package, --hicache-encrypt is refused when the config is built (before a
    model loads), and the codec refuses to be built: never a failure at the first record."""
    gone = [n for n in sys.modules if n == "cryptography" or n.startswith("cryptography.")]
    for name in {"cryptography", *gone}:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: imports fail
    with pytest.raises(ValueError, match="hicache_encrypt needs the cryptography package"):
        EngineConfig(hicache_size=0.001, hicache_encrypt=True)
    EngineConfig(hicache_size=0.001, hicache_encrypt=False)  # MAC'd records need nothing more
    with pytest.raises(ImportError, match="--hicache-encrypt needs the cryptography package"):
        codec(make_pool(), sealed=True)


def test_keys_name_the_whole_prefix() -> None:
    a = chunk_keys("ns", TOKENS)
    assert len(a) == 4 and len(set(a)) == 4
    b = chunk_keys("ns", [0] + TOKENS[1:])
    assert all(x != y for x, y in zip(a, b))  # one token differs early: every key differs
    assert chunk_keys("other", TOKENS)[0] != a[0]
    assert chunk_keys("ns", TOKENS[:40]) == a[:2]


# ---------------------------------------------------------------- disk tier


def spilled_to_disk(tmp_path: Path, sealed: bool = False) -> tuple[KVPool, HiCache, torch.Tensor]:
    """4 chunks evicted into a host tier of 1 chunk: chunks 0..2 spill to disk."""
    pool = make_pool()
    disk = DiskStore(str(tmp_path), 1 << 30, codec(pool, sealed=sealed))
    cache = host_cache(pool, chunks=1, disk=disk)
    slots, ref = computed(pool, TOKENS)
    cache.insert(TOKENS, slots)
    cache.evict(64)
    cache.drain()
    assert len(list(tmp_path.glob("*.kv"))) == 3
    return pool, cache, ref


def test_disk_tier_is_private_to_this_user(tmp_path: Path) -> None:
    """Folder 0700 (a looser one is tightened), records 0600, no temporary file left; a
    folder another user owns is refused (they could swap the files)."""
    loose = tmp_path / "tier"
    loose.mkdir(mode=0o777)
    loose.chmod(0o777)
    pool, cache, _ = spilled_to_disk(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    files = list(loose.iterdir())
    assert len(files) == 3 and all(f.suffix == ".kv" for f in files)
    assert {stat.S_IMODE(f.stat().st_mode) for f in files} == {0o600}
    cache.close()
    if os.getuid() != 0:
        pytest.skip("changing a folder's owner needs root")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ValueError, match="belongs to uid 65534"):
        DiskStore(str(theirs), 1 << 30, codec(pool))


def restarted(tmp_path: Path, sealed: bool = False) -> tuple[KVPool, HiCache]:
    pool = make_pool()
    disk = DiskStore(str(tmp_path), 1 << 30, codec(pool, sealed=sealed))
    return pool, host_cache(pool, disk=disk)


@SEALED
def test_disk_tier_survives_a_restart(tmp_path: Path, sealed: bool) -> None:
    _, old, ref = spilled_to_disk(tmp_path, sealed)
    old.close()
    pool, cache = restarted(tmp_path, sealed)
    m = cache.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"disk": 48}  # chunk 3 was in the old server's host memory
    assert torch.equal(rows_at(pool, m.indices), ref[:, :, :48])
    assert cache.tier_stats()["disk"].loads == 3
    cache.check_integrity()
    cache.close()


def chunk_file(tmp_path: Path, k: int) -> Path:
    return tmp_path / f"{chunk_keys('test', TOKENS)[k]}.kv"


@SEALED
@pytest.mark.parametrize("fault", ["corrupt", "truncated", "missing"])
def test_damaged_chunk_file_is_a_miss_never_wrong_kv(
    tmp_path: Path, fault: str, sealed: bool
) -> None:
    _, old, ref = spilled_to_disk(tmp_path, sealed)
    old.close()
    pool, cache = restarted(tmp_path, sealed)
    path = chunk_file(tmp_path, 1)
    data = path.read_bytes()
    if fault == "corrupt":
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    elif fault == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()
    m = cache.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"disk": 16}  # chunk 0 only: from chunk 1 on it is recomputed
    assert torch.equal(rows_at(pool, m.indices), ref[:, :, :16])
    assert cache.tier_stats()["disk"].faults == 1
    assert not path.exists()  # a refused file is removed, not read again
    cache.flush()
    assert pool.num_free == pool.capacity
    cache.close()


@SEALED
@pytest.mark.parametrize("poison", POISONS)
def test_poisoned_chunk_file_is_a_miss(tmp_path: Path, poison: str, sealed: bool) -> None:
    """A file another local process wrote over chunk 1 (each kind of poison): a counted miss,
    deleted; never an exception, never its rows."""
    _, old, ref = spilled_to_disk(tmp_path, sealed)
    old.close()
    path = chunk_file(tmp_path, 1)
    key = chunk_keys("test", TOKENS)[1]
    path.write_bytes(poisoned_records(path.read_bytes(), key, SECRET, sealed)[poison])
    pool, cache = restarted(tmp_path, sealed)
    m = cache.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"disk": 16}
    assert torch.equal(rows_at(pool, m.indices), ref[:, :, :16])
    assert cache.tier_stats()["disk"].faults == 1
    assert not path.exists()
    cache.flush()
    cache.close()


@SEALED
def test_only_sealed_disk_records_hide_the_prompt_and_rows(tmp_path: Path, sealed: bool) -> None:
    """The files of 3 chunks spilled to disk: MAC'd, they hold every 4-token run of those
    chunks' tokens and every row; sealed, none."""
    _, cache, ref = spilled_to_disk(tmp_path, sealed)
    cache.close()
    records = [f.read_bytes() for f in tmp_path.glob("*.kv")]
    assert len(records) == 3
    assert all(r.startswith(SEALED_MAGIC if sealed else MAGIC) for r in records)
    runs, rows = shown(records, TOKENS[: 3 * C], ref[:, :, : 3 * C])
    spilled = ref[:, :, : 3 * C]
    every = (3 * (C - 3), spilled.numel() // (ref.shape[-2] * ref.shape[-1]))  # runs in a chunk
    assert (runs, rows) == ((0, 0) if sealed else every)


def test_prefetch_pulls_a_waiting_prefix_up_from_disk(tmp_path: Path) -> None:
    _, old, ref = spilled_to_disk(tmp_path)
    old.close()
    pool, cache = restarted(tmp_path)
    cache.prefetch([(TOKENS + [1], SHARED)])  # the scheduler's look-ahead over its waiting queue
    cache.drain()
    assert cache.prefetched == 3 and pool.num_free == pool.capacity  # the pool is untouched
    m = cache.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"host": 48}  # from memory now, not from disk
    assert torch.equal(rows_at(pool, m.indices), ref[:, :, :48])
    cache.prefetch([(TOKENS + [1], SHARED)])  # in the pool now: nothing to fetch
    assert not cache._wanted
    cache.check_integrity()
    cache.close()


def test_admission_waits_for_the_prefetch_reader_instead_of_reading_twice(
    tmp_path: Path,
) -> None:
    _, old, ref = spilled_to_disk(tmp_path)
    old.close()
    pool, cache = restarted(tmp_path)
    cache.prefetch([(TOKENS + [1], SHARED)])
    m = cache.match_prefix(TOKENS + [1])  # at once: the reader may still be reading
    assert m.tier_tokens == {"host": 48}
    assert cache.tier_stats()["disk"].loads == 0  # read once, by the reader
    assert torch.equal(rows_at(pool, m.indices), ref[:, :, :48])
    cache.check_integrity()
    cache.close()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_host_chunks_expire_ttl_after_their_last_use() -> None:
    pool = make_pool()
    layout = pool_layout(pool)
    clock = Clock()
    host = HostStore(64 * layout.chunk_bytes, layout, None, ttl_s=10, clock=clock)
    cache = HiCache(pool, [host], None, "test")
    a, b = TOKENS[:32], list(range(7000, 7032))
    cache.insert(a, computed(pool, a)[0])
    cache.insert(b, computed(pool, b, seed=1)[0])
    cache.evict(64)  # both conversations in the host tier, at t = 1000
    clock.now = 1008
    assert cache.match_prefix(a + [1]).tier_tokens == {"host": 32}  # a's turn: used again
    cache.evict(32)  # a back in the host tier, used at 1008
    clock.now = 1012  # b unused for 12 s > ttl: gone; a for 4 s: kept
    assert cache.match_prefix(b + [1]).tier_tokens == {}
    assert host.stored_bytes == 2 * layout.chunk_bytes
    clock.now = 1018.5
    assert cache.match_prefix(a + [1]).tier_tokens == {}
    assert host.stored_bytes == 0
    cache.flush()
    assert pool.num_free == pool.capacity
    cache.check_integrity()


def test_disk_chunks_expire_ttl_after_their_last_use(tmp_path: Path) -> None:
    _, old, ref = spilled_to_disk(tmp_path)  # 3 chunk files
    old.close()
    clock = Clock()
    clock.now = max(p.stat().st_mtime for p in tmp_path.glob("*.kv"))
    pool = make_pool()
    disk = DiskStore(str(tmp_path), 1 << 30, codec(pool), ttl_s=60, clock=clock)
    cache = host_cache(pool, chunks=1, disk=disk)
    clock.now += 30
    assert disk.get(chunk_keys("test", TOKENS)[0], TOKENS[:C]) is not None  # chunk 0 used
    clock.now += 45  # chunks 1, 2: unused for 75 s > 60 s
    m = cache.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"disk": 16}
    assert torch.equal(rows_at(pool, m.indices), ref[:, :, :16])
    assert sorted(tmp_path.glob("*.kv")) == [chunk_file(tmp_path, 0)]  # the files are deleted
    cache.flush()
    cache.close()


def test_ttl_is_configured_for_host_and_disk(tmp_path: Path) -> None:
    cfg = EngineConfig(hicache_size=0.001, hicache_dir=str(tmp_path), hicache_ttl=600)
    cache = make_prefix_cache(cfg, make_pool(), "m")
    assert isinstance(cache, HiCache)
    assert [getattr(t, "ttl_s", None) for t in cache.local] == [600, 600]
    cache.close()
    with pytest.raises(ValueError, match="hicache_ttl must be > 0"):
        EngineConfig(hicache_size=1, hicache_ttl=0)
    with pytest.raises(ValueError, match="hicache_prefetch_window must be >= 0"):
        EngineConfig(hicache_prefetch_window=-1)


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a real full disk (ENOSPC) for the disk tier."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)])
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): no full disk to test on")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_degrades_to_the_host_tier(
    tiny_disk: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = make_pool(capacity=512, layers=4, heads=4, dim=64)  # 128 KiB chunks
    disk = DiskStore(str(tiny_disk), 1 << 30, codec(pool))
    cache = host_cache(pool, chunks=2, disk=disk)
    tokens = list(range(20000, 20000 + 8 * C))
    slots, ref = computed(pool, tokens)
    cache.insert(tokens, slots)
    with caplog.at_level(logging.WARNING, logger="radixserve.kvcache"):
        cache.evict(len(tokens))  # 6 chunks spill to a disk that holds at most one
        cache.drain()
    stats = cache.tier_stats()["disk"]
    assert stats.faults >= 4, stats
    assert sum("hicache disk write failed" in r.getMessage() for r in caplog.records) == 1
    m = cache.match_prefix(tokens + [1])  # whatever survived, it is exact
    assert torch.equal(rows_at(pool, m.indices), ref[:, :, : len(m.indices)])
    cache.flush()
    assert pool.num_free == pool.capacity
    cache.check_integrity()
    cache.close()


# ---------------------------------------------------------------- end to end (tiny model)

TURN = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def multiturn(engine: Any, convs: int = 6, turns: int = 4) -> tuple[list[list[int]], list[dict]]:
    """Interleaved conversations: each turn is the whole history plus a new message."""
    g = torch.Generator().manual_seed(7)
    history: list[list[int]] = [[] for _ in range(convs)]
    outputs, metas = [], []
    for _ in range(turns):
        for c in range(convs):
            history[c] += torch.randint(100, 20000, (24,), generator=g).tolist()
            out = engine.generate(input_ids=history[c], sampling_params=TURN)
            history[c] += out["output_ids"]
            outputs.append(out["output_ids"])
            metas.append(out["meta_info"])
            engine.check_integrity()
    return outputs, metas


def test_host_tier_gives_identical_outputs_and_prefills_less(tiny_model_dir: Path) -> None:
    from radixserve import Engine

    runs = {}
    for name, extra in {"radix": {}, "host": {"hicache_size": 0.01}}.items():
        engine = Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=192, **extra)
        outputs, metas = multiturn(engine)
        computed = engine.scheduler.stats().computed_tokens_total
        runs[name] = (outputs, metas, computed, engine.scheduler.stats().tiers)
        assert engine.flush_cache()
        pool = engine.scheduler.kv.pool
        assert pool.num_free == pool.capacity  # KV accounting back to baseline
        engine.check_integrity()
        engine.shutdown()
    radix, host = runs["radix"], runs["host"]
    assert host[0] == radix[0]  # greedy fp32: the same tokens with and without the tier
    from_host = sum(m["cached_tokens_details"].get("host", 0) for m in host[1])
    assert from_host > 0 and host[3]["host"].hit_tokens == from_host
    assert all(sum(m["cached_tokens_details"].values()) == m["cached_tokens"] for m in host[1])
    assert host[2] < radix[2] - from_host // 2, (host[2], radix[2], from_host)


def test_sealed_disk_tier_gives_the_same_tokens_after_a_restart(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """hicache_encrypt with --hicache-dir: prompts pushed through a host tier of 2 chunks to
    disk come back, after a restart (pool and host tier empty), from the sealed files alone
    with the greedy tokens of an engine without tiers; the files hold no run of the prompts'
    token ids; a damaged file is a counted miss, and the tokens stay the same."""
    from radixserve import Engine

    g = torch.Generator().manual_seed(11)
    asked = [torch.randint(100, 20000, (80,), generator=g).tolist() for _ in range(3)]
    fillers = [torch.randint(100, 20000, (80,), generator=g).tolist() for _ in range(2)]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}

    def run(engine: Any, prompts: list[list[int]]) -> list[dict]:
        return [engine.generate(input_ids=p, sampling_params=params) for p in prompts]

    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=128) as plain:
        expected = [out["output_ids"] for out in run(plain, asked)]
        chunk_bytes = pool_layout(plain.scheduler.kv.pool).chunk_bytes
    folder = tmp_path / "kv"
    tiers = {
        "hicache_size": 2 * chunk_bytes / (1 << 30), "hicache_dir": str(folder),
        "hicache_encrypt": True, "hicache_secret": SECRET.decode(),
        "hicache_prefetch_window": 0,  # hits read at admission, so counted as the disk's
    }  # fmt: skip
    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=128, **tiers) as first:
        assert [out["output_ids"] for out in run(first, asked + fillers)][:3] == expected
        first.scheduler.cache.drain()
        first.scheduler.cache.close()
    records = [f.read_bytes() for f in folder.glob("*.kv")]
    assert len(records) >= 3 * 5 and all(r.startswith(SEALED_MAGIC) for r in records)
    runs = [struct.pack("<4i", *p[i : i + 4]) for p in asked for i in range(len(p) - 3)]
    assert not any(run in r for run in runs for r in records)
    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=128, **tiers) as second:
        cache = second.scheduler.cache
        outs = run(second, asked[:2])
        assert [out["output_ids"] for out in outs] == expected[:2]
        # 80-token prompts: 4 whole chunks before the last token, which is computed
        assert [out["meta_info"]["cached_tokens_details"] for out in outs] == [{"disk": 64}] * 2
        assert cache.tier_stats()["disk"].faults == 0
        damaged = folder / f"{chunk_keys(cache.namespace, asked[2])[2]}.kv"
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0x01
        damaged.write_bytes(bytes(data))
        out = run(second, asked[2:])[0]
        assert out["output_ids"] == expected[2]
        assert out["meta_info"]["cached_tokens_details"] == {"disk": 32}  # chunks 0, 1
        assert cache.tier_stats()["disk"].faults == 1
        second.check_integrity()
        cache.close()


@pytest.mark.slow
def test_embedded_model_gives_identical_outputs_with_the_host_tier() -> None:
    from radixserve import Engine

    runs = []
    for extra in ({}, {"hicache_size": 0.05}):
        engine = Engine(dtype="float32", max_total_tokens=160, **extra)
        outputs, metas = multiturn(engine, convs=4, turns=3)
        runs.append((outputs, metas))
        engine.shutdown()
    assert runs[1][0] == runs[0][0]
    assert sum(m["cached_tokens_details"].get("host", 0) for m in runs[1][1]) > 0
