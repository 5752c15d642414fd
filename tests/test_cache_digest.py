"""Block hashes (core/digest.py) and the prefix cache's digest (kvcache/digest.py): equal ids
hash equally, a prefix's hashes are a prefix of the hashes, a partial last block is not
named; the digest names exactly the whole blocks the shared part holds after inserts and
evictions, shallow blocks first, at most `max_blocks`. No server, no Ray."""

from __future__ import annotations

import random

import pytest
import torch

from radixserve.core.digest import HASH_BYTES, block_hashes, chain, join, split
from radixserve.core.request import CacheSalt
from radixserve.kvcache.digest import DigestMemo, cache_digest
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.radix import RadixCache

B = 16  # ids a block


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def cache_of(capacity: int) -> RadixCache:
    return RadixCache(KVPool(capacity + 1, 1, 1, 2, torch.float32))


def insert(cache: RadixCache, seq: list[int], salt: CacheSalt | None = None) -> None:
    slots = cache.pool.alloc(len(seq))
    assert slots is not None, f"test pool too small for {len(seq)}"
    if salt is None:
        cache.insert(seq, slots)
    else:
        cache.insert(seq, slots, salt=salt)
    cache.check_integrity()


def blocks_of(*paths: list[int]) -> set[bytes]:
    """The hashes of every whole block on the given root-to-leaf paths."""
    return {h for p in paths for h in block_hashes(p, B)}


# ---------------------------------------------------------------- block hashes


def test_equal_ids_hash_equally_and_each_block_hashes_all_before_it() -> None:
    seq = ids(64, 0)
    hashes = block_hashes(seq, B)
    assert len(hashes) == 4 and all(len(h) == HASH_BYTES for h in hashes)
    assert block_hashes(list(seq), B) == hashes
    assert len(set(hashes)) == 4
    changed = [seq[0] + 1, *seq[1:]]
    assert set(block_hashes(changed, B)).isdisjoint(hashes)  # block 0 reaches every block
    assert block_hashes(seq[B:], B, prev=hashes[0]) == hashes[1:]
    assert hashes[1] == chain(hashes[0], seq[B : 2 * B])
    assert block_hashes(seq, 8) != hashes[:2]


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 31, 32, 40, 63, 64])
def test_the_hashes_of_a_prefix_are_a_prefix_of_the_hashes(n: int) -> None:
    seq = ids(64, 1)
    assert block_hashes(seq[:n], B) == block_hashes(seq, B)[: n // B]


def test_a_partial_last_block_is_not_named() -> None:
    seq = ids(40, 2)
    hashes = block_hashes(seq, B)
    assert len(hashes) == 2  # ids 32..39 make no block
    other_tail = seq[:32] + ids(8, 3)
    assert block_hashes(other_tail, B) == hashes
    assert block_hashes(seq[:15], B) == []


def test_join_and_split_round_trip() -> None:
    hashes = block_hashes(ids(48, 4), B)
    packed = join(hashes)
    assert len(packed) == 3 * HASH_BYTES
    assert split(packed) == set(hashes)
    assert split(packed + b"\x01\x02") == set(hashes)  # a trailing partial hash is ignored
    assert split(b"") == set()


# ---------------------------------------------------------------- the cache's digest


def test_digest_names_exactly_the_whole_blocks_left_after_eviction() -> None:
    # root -> S (40 ids: blocks 0, 1 and 8 ids of block 2) -> {b1, b2, b3} (30 ids each)
    shared = ids(40, 10)
    branches = [ids(30, 11 + i) for i in range(3)]
    cache = cache_of(200)
    for b in branches:
        insert(cache, shared + b)
    paths = [shared + b for b in branches]
    digest = cache_digest(cache, B, 1000)
    assert len(digest) == len(set(digest)) == 2 + 3 * 2  # blocks 0, 1; 2, 3 per branch
    assert set(digest) == blocks_of(*paths)

    assert cache.evict(30) == 30  # b1's leaf, the least recently used
    cache.check_integrity()
    digest = cache_digest(cache, B, 1000)
    assert set(digest) == blocks_of(paths[1], paths[2]) and len(digest) == 6
    assert set(block_hashes(paths[0], B)[2:]).isdisjoint(digest)

    assert cache.evict(60) == 60  # both branches: the shared part alone remains
    assert cache_digest(cache, B, 1000) == block_hashes(shared, B)
    assert cache.evict(40) == 40
    assert cache_digest(cache, B, 1000) == []


def test_digest_is_shallow_first_and_capped() -> None:
    # root -> A (32 ids) -> {X (32 ids), Y (32 ids)}
    a, x, y = ids(32, 20), ids(32, 21), ids(32, 22)
    cache = cache_of(128)  # the second insert holds 64 slots until it frees A's duplicates
    insert(cache, a + x)
    insert(cache, a + y)
    full = cache_digest(cache, B, 1000)
    assert full[:2] == block_hashes(a, B)
    assert set(full[2:]) == set(block_hashes(a + x, B)[2:] + block_hashes(a + y, B)[2:])
    for cap in (1, 2, 3, 5):
        assert cache_digest(cache, B, cap) == full[:cap]
    third = cache_digest(cache, B, 3)[2]
    assert third in (block_hashes(a + x, B)[2], block_hashes(a + y, B)[2])


def test_digest_leaves_salted_parts_out() -> None:
    shared, private = ids(32, 30), ids(48, 31)
    cache = cache_of(100)
    insert(cache, shared)
    insert(cache, private, CacheSalt("alice"))
    assert cache_digest(cache, B, 1000) == block_hashes(shared, B)


def test_a_request_matches_the_digest_as_far_as_its_cached_blocks() -> None:
    """What a router does with a digest: count a prompt's leading hashes it names."""
    shared = ids(50, 40)
    cache = cache_of(100)
    insert(cache, shared)
    named = set(cache_digest(cache, B, 1000))
    prompt = shared[:45] + ids(20, 41)
    leading = 0
    for h in block_hashes(prompt, B):
        if h not in named:
            break
        leading += 1
    assert leading * B == 32  # blocks 0 and 1; block 2 leaves the cached path at id 45


def test_a_memo_gives_the_same_digest_and_hashes_only_what_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Across inserts, splits and evictions, a digest with a memo equals one without; an
    unchanged cache is hashed not at all, and one new leaf alone is hashed again."""
    import radixserve.kvcache.digest as digest_module

    hashed: list[int] = []

    def counting(ids: list[int], block: int, prev: bytes = b"") -> list[bytes]:
        hashed.append(len(ids))
        return block_hashes(ids, block, prev)

    monkeypatch.setattr(digest_module, "block_hashes", counting)
    rng = random.Random(7)
    cache, memo = cache_of(4096), DigestMemo()
    system = ids(70, 30)
    for step in range(40):
        if step % 7 == 6:
            cache.evict(rng.randrange(1, 200))
        else:  # a new branch off a random point of an earlier path: splits a node
            insert(cache, system[: rng.randrange(1, 71)] + ids(rng.randrange(1, 60), 100 + step))
        for block, cap in ((B, 4096), (B, 5), (7, 4096)):
            assert cache_digest(cache, block, cap, memo) == cache_digest(cache, block, cap)
    cache_digest(cache, B, 4096, memo)
    hashed.clear()
    unchanged = cache_digest(cache, B, 4096, memo)
    assert hashed == [] and unchanged == cache_digest(cache, B, 4096)
    insert(cache, ids(40, 999))  # a new leaf under the root: the one node hashed
    hashed.clear()
    grown = cache_digest(cache, B, 4096, memo)
    assert hashed == [40] and grown == cache_digest(cache, B, 4096)
