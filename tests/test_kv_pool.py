"""KVPool and ReqToTokenPool: allocation contract, double-free detection, storage layout."""

from __future__ import annotations

import pytest
import torch

from radixserve.kvcache.pool import SORTED_ALLOC, KVPool, ReqToTokenPool


def make_pool(num_slots: int = 9) -> KVPool:
    return KVPool(num_slots, num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32)


def test_capacity_excludes_scratch_slot() -> None:
    pool = make_pool(9)
    assert pool.capacity == 8
    assert pool.num_free == 8
    assert pool.k[0].shape == (9, 2, 4) and pool.v[1].shape == (9, 2, 4)
    # 2 (k and v) * 2 layers * 2 heads * 4 dims * 4 bytes
    assert pool.bytes_per_token() == 128


def test_alloc_all_then_free_all() -> None:
    pool = make_pool(9)
    slots = pool.alloc(8)
    assert slots is not None
    assert slots.dtype == torch.int64
    # A fresh pool hands out 1..capacity in order; slot 0 never.
    assert slots.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert pool.num_free == 0 and not pool.can_alloc(1)
    assert pool.alloc(1) is None
    none = pool.alloc(0)
    assert none is not None and none.numel() == 0
    pool.free(slots)
    assert pool.num_free == 8
    again = pool.alloc(8)
    assert again is not None and sorted(again.tolist()) == list(range(1, 9))


def test_alloc_beyond_capacity_returns_none_and_takes_nothing() -> None:
    pool = make_pool(9)
    first = pool.alloc(5)
    assert first is not None
    assert pool.alloc(4) is None  # only 3 left: no partial result
    assert pool.num_free == 3
    rest = pool.alloc(3)
    assert rest is not None
    assert set(first.tolist()).isdisjoint(rest.tolist())
    assert sorted(first.tolist() + rest.tolist()) == list(range(1, 9))


def test_freed_slots_are_reused_and_distinct() -> None:
    pool = make_pool(9)
    a = pool.alloc(4)
    b = pool.alloc(4)
    assert a is not None and b is not None
    pool.free(a[1:3])  # slots 2 and 3
    c = pool.alloc(2)
    assert c is not None and sorted(c.tolist()) == [2, 3]
    assert pool.num_free == 0


def test_double_free_asserts() -> None:
    pool = make_pool(9)
    slots = pool.alloc(3)
    assert slots is not None
    pool.free(slots[:1])
    with pytest.raises(AssertionError, match="double free"):
        pool.free(slots[:1])
    with pytest.raises(AssertionError, match="double free"):
        pool.free(torch.tensor([7], dtype=torch.int64))  # never allocated
    assert pool.num_free == 6


def test_free_of_scratch_slot_asserts() -> None:
    pool = make_pool(9)
    with pytest.raises(AssertionError):
        pool.free(torch.tensor([0], dtype=torch.int64))


def test_write_stores_rows_at_slots() -> None:
    pool = make_pool(9)
    slots = pool.alloc(3)
    assert slots is not None
    k = torch.arange(24, dtype=torch.float32).view(3, 2, 4)  # (T, kv_heads, head_dim)
    v = -k
    pool.write(1, slots, k, v)
    assert torch.equal(pool.k[1][slots], k) and torch.equal(pool.v[1][slots], v)
    assert torch.count_nonzero(pool.k[0]) == 0  # other layers untouched


def test_req_to_token_alloc_all_free_all() -> None:
    rtp = ReqToTokenPool(max_requests=3, max_context_len=16)
    assert rtp.table.shape == (4, 16) and rtp.table.dtype == torch.int64  # and the pad row
    rows = [rtp.alloc() for _ in range(3)]
    assert rows == [0, 1, 2]
    assert rtp.alloc() is None and rtp.num_free == 0  # the pad row is never handed out
    for r in rows:
        assert r is not None
        rtp.free(r)
    assert rtp.num_free == 3
    assert sorted(r for r in (rtp.alloc() for _ in range(3)) if r is not None) == [0, 1, 2]


def test_req_to_token_double_free_asserts() -> None:
    rtp = ReqToTokenPool(max_requests=2, max_context_len=4)
    row = rtp.alloc()
    assert row == 0
    rtp.free(row)
    with pytest.raises(AssertionError, match="double free"):
        rtp.free(row)
    with pytest.raises(AssertionError, match="double free"):
        rtp.free(1)  # never allocated


def test_large_allocation_gets_ascending_runs_after_interleaved_frees() -> None:
    """Decode slots of a batch interleave (one per sample per step); freed, they must not
    scatter a long prompt allocated afterwards over the pool."""
    pool = KVPool(num_slots=2049, num_layers=1, kv_heads=1, head_dim=8, dtype=torch.float32)
    samples: list[list[torch.Tensor]] = [[] for _ in range(4)]
    for _ in range(512):  # 4 samples decoding 512 steps: slots 1, 2, 3, 4, 5, ... interleave
        for s in samples:
            s.append(pool.alloc(1))
    for s in samples:
        pool.free(torch.cat(s))
    small = pool.alloc(3)  # below SORTED_ALLOC: the stack as it is (sample 3's slots)
    assert small is not None and small.tolist() == [4, 8, 12]
    big = pool.alloc(SORTED_ALLOC)  # in address order again
    rest = [i for i in range(1, 2049) if i not in (4, 8, 12)]
    assert big is not None and big.tolist() == rest[:SORTED_ALLOC]
    pool.free(torch.cat([small, big]))
    assert sorted(pool.alloc(pool.capacity).tolist()) == list(range(1, 2049))  # none lost


def test_an_unordered_allocation_takes_what_single_allocations_would() -> None:
    """alloc(n, in_order=False) (a decode step's slots, one per sample) hands out the slots
    n alloc(1) calls would, in their order, also past SORTED_ALLOC after interleaved frees."""
    pools = [
        KVPool(num_slots=1025, num_layers=1, kv_heads=1, head_dim=8, dtype=torch.float32)
        for _ in range(2)
    ]
    for pool in pools:
        taken = pool.alloc(1024)
        assert taken is not None
        pool.free(taken[1::2])  # every other slot back: the stack is out of address order
        pool.free(taken[::2][:200])
    one_by_one = [pools[0].alloc(1) for _ in range(SORTED_ALLOC + 44)]
    together = pools[1].alloc(SORTED_ALLOC + 44, in_order=False)
    assert together is not None and together.tolist() == torch.cat(one_by_one).tolist()
