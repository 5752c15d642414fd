"""Positional decoupling (--hicache-reposition, kvcache/reposition.py): the run index, the
key rotation against the model's own keys at the new position, a HiCache moving a run out
of the pool and out of the host tier, and a truncated conversation end to end (tiny model):
its kept turns reused, not recomputed, KV accounting back to baseline; off by default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve.config import EngineConfig
from radixserve.core.batch import ForwardBatch
from radixserve.kvcache.hicache import HiCache, pool_layout
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.prefix_cache import make_prefix_cache
from radixserve.kvcache.radix import RadixCache
from radixserve.kvcache.reposition import WINDOW, Mover, Run, RunIndex, rotate_keys
from radixserve.kvcache.tier_store import HostStore

W = WINDOW
SYSTEM = list(range(5000, 5020))  # 20 tokens every prompt starts with
TURNS = [list(range(6000 + 100 * t, 6000 + 100 * t + 30)) for t in range(4)]  # 30 tokens each
OLD = SYSTEM + TURNS[0] + TURNS[1] + TURNS[2] + TURNS[3]
NEW_MSG = list(range(9000, 9012))
NEW = SYSTEM + TURNS[2] + TURNS[3] + NEW_MSG  # turns 0 and 1 dropped
A0 = len(SYSTEM) + 60  # where turn 2 starts in OLD


# ---------------------------------------------------------------- the run index


def test_index_finds_a_run_at_another_position() -> None:
    index = RunIndex(1000)
    index.add(OLD)
    run = index.find(NEW, len(SYSTEM))
    assert run == Run(OLD, A0, 60)
    # a match that already went a few tokens into the run: found from there
    assert index.find(NEW, len(SYSTEM) + 5) == Run(OLD, A0 + 5, 55)


def test_index_stops_at_an_edit_and_refuses_short_or_unknown_runs() -> None:
    index = RunIndex(1000)
    index.add(OLD)
    edited = SYSTEM + TURNS[2][:20] + [1] + TURNS[2][21:] + TURNS[3] + NEW_MSG
    assert index.find(edited, len(SYSTEM)) == Run(OLD, A0, 20)
    assert index.find(SYSTEM + TURNS[2][: W - 1] + NEW_MSG, len(SYSTEM)) is None  # < WINDOW
    assert index.find(SYSTEM + list(range(7, 70)), len(SYSTEM)) is None


def test_index_is_bounded_least_recent_first() -> None:
    index = RunIndex(4 * W)
    index.add(list(range(100, 100 + 4 * W)))
    index.add(list(range(900, 900 + 2 * W)))
    assert len(index) == 4
    assert index.find(list(range(100, 100 + 2 * W)), 0) is None  # its windows were dropped
    assert index.find(list(range(100 + 2 * W, 100 + 4 * W)), 0) is not None


# ---------------------------------------------------------------- rotation


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x (T, H, D) at `positions` (T,), in float64 (the reference)."""
    angles = positions.double()[:, None] * inv_freq.double()[None]  # (T, D/2)
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    x = x.double()
    d = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., d:], x[..., :d]), -1) * sin


def test_rotating_a_rope_key_gives_the_key_at_the_new_position() -> None:
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    x = torch.randn(50, 3, 64, generator=g)
    pos = torch.arange(50) + 300
    for delta in (-300, -7, 0, 1000):
        moved = rotate_keys(rope(x, pos, inv_freq).float(), delta, inv_freq)
        want = rope(x, pos + delta, inv_freq)
        assert moved.dtype == torch.float32
        torch.testing.assert_close(moved.double(), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- HiCache without a model


def make_pool(capacity: int = 512) -> KVPool:
    return KVPool(capacity + 1, 2, 1, 4, torch.float32)


def computed(pool: KVPool, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots holding n rows of seeded random "K/V" and those rows (layers, 2, n, H, D)."""
    slots = pool.alloc(n)
    assert slots is not None
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn((len(pool.k), 2, n, *pool.k[0].shape[1:]), generator=g)
    for layer in range(len(pool.k)):
        pool.write(layer, slots, rows[layer, 0], rows[layer, 1])
    return slots, rows


def rows_at(pool: KVPool, slots: torch.Tensor) -> torch.Tensor:
    pool.wait_loads()
    return torch.stack([torch.stack([k[slots], v[slots]]) for k, v in zip(pool.k, pool.v)])


INV_FREQ = 1.0 / (10000 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4))


def moving_cache(pool: KVPool, host_chunks: int = 0) -> HiCache:
    layout = pool_layout(pool)
    local = [HostStore(host_chunks * layout.chunk_bytes, layout, None)] if host_chunks else []
    return HiCache(pool, local, None, "test", mover=Mover(RunIndex(4096), INV_FREQ))


def check_moved(pool: KVPool, cache: HiCache, ref: torch.Tensor) -> None:
    """NEW's match: SYSTEM in place, turns 2 and 3 moved from OLD's rows, keys rotated."""
    m = cache.match_prefix(NEW)
    q = len(SYSTEM)
    assert m.tier_tokens == {"device": q, "moved": 60}, m.tier_tokens
    got = rows_at(pool, m.indices)
    assert torch.equal(got[:, :, :q], ref[:, :, :q])
    old = ref[:, :, A0 : A0 + 60]
    assert torch.equal(got[:, 1, q:], old[:, 1])  # values: as they were
    want = rotate_keys(old[:, 0], q - A0, INV_FREQ)
    assert torch.equal(got[:, 0, q:], want)
    assert not torch.allclose(got[:, 0, q:], old[:, 0])  # keys: turned by -60 positions
    assert cache.tier_stats()["moved"].hit_tokens == 60
    cache.check_integrity()
    # the moved run is now NEW's own prefix: matched in place next time
    assert cache.match_prefix(NEW).tier_tokens == {"device": q + 60}
    cache.flush()
    assert pool.num_free == pool.capacity and len(cache.mover.index) == 0
    cache.check_integrity()


def test_a_run_in_the_pool_is_moved_with_its_keys_rotated() -> None:
    pool = make_pool()
    cache = moving_cache(pool)
    slots, ref = computed(pool, len(OLD))
    cache.insert(OLD, slots)
    check_moved(pool, cache, ref)


def test_a_run_in_the_host_tier_is_moved_with_its_keys_rotated() -> None:
    pool = make_pool()
    cache = moving_cache(pool, host_chunks=64)
    slots, ref = computed(pool, len(OLD))
    cache.insert(OLD, slots)
    system = cache.match_prefix(SYSTEM)  # another conversation keeps the system prompt
    cache.lock(system.last_node)
    cache.evict(len(OLD))
    cache.unlock(system.last_node)
    assert pool.num_free == pool.capacity - len(SYSTEM)  # the turns are in the host tier
    # OLD's whole chunks 1..7 went to the host: the run [80, 140) is there up to 128
    m = cache.match_prefix(NEW)
    assert m.tier_tokens == {"device": 20, "moved": 48}, m.tier_tokens
    got = rows_at(pool, m.indices)
    old = ref[:, :, A0 : A0 + 48]
    assert torch.equal(got[:, 0, 20:], rotate_keys(old[:, 0], 20 - A0, INV_FREQ))
    assert torch.equal(got[:, 1, 20:], old[:, 1])
    cache.check_integrity()
    cache.flush()
    assert pool.num_free == pool.capacity
    cache.check_integrity()


def test_no_run_or_rows_gone_means_recompute() -> None:
    pool = make_pool()
    cache = moving_cache(pool)  # no tier: an evicted run is gone
    slots, _ = computed(pool, len(OLD))
    cache.insert(OLD, slots)
    edited = SYSTEM + [1] + TURNS[2] + NEW_MSG  # turn 2 is in OLD, one token after q
    assert cache.match_prefix(edited).tier_tokens == {"device": 20}
    cache.evict(len(OLD))
    assert cache.match_prefix(NEW).indices.numel() == 0
    assert pool.num_free == pool.capacity
    cache.check_integrity()


def test_off_by_default() -> None:
    pool = make_pool()
    assert type(make_prefix_cache(EngineConfig(), pool)) is RadixCache
    assert not EngineConfig().hicache_reposition
    cache = make_prefix_cache(EngineConfig(hicache_reposition=True), pool, "m", INV_FREQ)
    assert isinstance(cache, HiCache) and cache.mover is not None
    assert cache.namespace.endswith("|moved")  # moved K/V never shared with exact servers
    with pytest.raises(ValueError, match="radix cache"):
        EngineConfig(hicache_reposition=True, disable_radix_cache=True)


# ---------------------------------------------------------------- the model (tiny Llama)


def kv_at(engine: Any, tokens: list[int], start: int) -> torch.Tensor:
    """K/V (layers, 2, T, H, D) of `tokens` computed alone at positions start.. (one
    sequence attending only itself, as a prompt module is encoded), slots freed after."""
    pool, worker = engine.scheduler.kv.pool, engine.scheduler.worker
    n = len(tokens)
    slots = pool.alloc(n)
    assert slots is not None
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.arange(start, start + n, dtype=torch.int64),
        out_cache_loc=slots,
        seq_lens=[n],
        extend_lens=[n],
        kv_indices=[slots],
        paths=[[]],
        kv_pool=pool,
    )
    worker.backend.plan(batch)
    worker.model.forward(batch, worker.backend)
    rows = rows_at(pool, slots)
    pool.free(slots)
    return rows


def check_moved_keys(engine: Any, tol: float) -> None:
    """No dropped context (the run attends only itself in both places): moving K/V from
    positions 0.. to 37.. gives what the model computes there, up to float rounding:
    layer 0 (keys from the embeddings alone) within 1e-6 of the scale, values exactly; the
    later layers within `tol` of the scale (rounding differences grow layer by layer)."""
    tokens = list(range(300, 340))
    at0, at37 = kv_at(engine, tokens, 0), kv_at(engine, tokens, 37)
    moved = Mover(RunIndex(64), rope_freqs(engine)).move(at0, 37)
    scale = at37.abs().max().item()
    err = (moved - at37).abs().amax(dim=(2, 3, 4))  # (layers, K/V)
    assert err[0, 0] <= 1e-6 * scale and err[0, 1] == 0, err[0]
    assert err.max() <= tol * scale, err
    assert (at0[:, 0] - at37[:, 0]).abs().max() > 0.1 * scale  # keys do depend on position
    engine.check_integrity()
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.pool.capacity
    assert isinstance(engine.scheduler.cache, RadixCache)  # the default: nothing is moved


def test_moved_model_keys_equal_the_keys_computed_at_the_new_position(
    tiny_model_dir: Path,
) -> None:
    from radixserve import Engine

    engine = Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=256)
    check_moved_keys(engine, tol=1e-5)
    engine.shutdown()


@pytest.mark.slow
def test_embedded_model_moved_keys_equal_the_keys_at_the_new_position() -> None:
    from radixserve import Engine

    # SmolLM2-135M, 30 layers; a float32 pool (its default is fp16 under the Q4_1 weights,
    # whose rounding alone is ~1e-3 of the scale). The quantized matmuls round activations
    # to int16 per block, so a rounding difference can move an input by a whole int16 step:
    # measured 1.1e-4 of the scale at worst (layer 0: 6e-7)
    engine = Engine(dtype="float32", kv_cache_dtype="float32", max_total_tokens=256)
    check_moved_keys(engine, tol=3e-4)
    engine.shutdown()


def rope_freqs(engine: Any) -> torch.Tensor:
    from radixserve.models.rope import inv_freq

    return inv_freq(engine.scheduler.worker.model_config.rope)


REPLY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def conversation(engine: Any, turns: list[list[int]]) -> list[int]:
    """SYSTEM then each user turn answered by the model: the whole token history."""
    history = list(SYSTEM)
    for user in turns:
        history += user
        history += engine.generate(input_ids=history, sampling_params=REPLY)["output_ids"]
    return history


def test_truncated_conversation_reuses_its_kept_turns(tiny_model_dir: Path) -> None:
    from radixserve import Engine

    runs = {}
    for on in (False, True):
        engine = Engine(
            str(tiny_model_dir), dtype="float32", max_total_tokens=512, hicache_reposition=on
        )
        history = conversation(engine, TURNS)
        # drop turns 0 and 1 (user + reply, 36 tokens each): the kept turns move 72 back
        kept = history[len(SYSTEM) + 72 :]
        prompt = SYSTEM + kept + NEW_MSG
        before = engine.scheduler.stats().computed_tokens_total
        out = engine.generate(input_ids=prompt, sampling_params=REPLY)
        prefilled = engine.scheduler.stats().computed_tokens_total - before - 5  # 5 decodes
        runs[on] = (out, prefilled, len(kept))
        engine.check_integrity()
        assert engine.flush_cache()
        pool = engine.scheduler.kv.pool
        assert pool.num_free == pool.capacity  # KV accounting back to baseline
        engine.shutdown()
    off, on_ = runs[False], runs[True]
    kept = off[2]
    assert off[0]["meta_info"]["cached_tokens_details"] == {"device": len(SYSTEM)}
    assert off[1] == kept + len(NEW_MSG)  # everything after the system prompt recomputed
    # the last reply token was sampled, never run: its K/V does not exist anywhere
    details = on_[0]["meta_info"]["cached_tokens_details"]
    assert details == {"device": len(SYSTEM), "moved": kept - 1}, details
    assert on_[0]["meta_info"]["cached_tokens"] == len(SYSTEM) + kept - 1
    assert on_[1] == 1 + len(NEW_MSG)  # only that token and the new message prefilled


def test_without_truncation_the_flag_changes_nothing(tiny_model_dir: Path) -> None:
    """Nothing is cut, so every prefix matches in place: the same outputs, nothing moved."""
    from radixserve import Engine

    histories = []
    for on in (False, True):
        engine = Engine(
            str(tiny_model_dir), dtype="float32", max_total_tokens=512, hicache_reposition=on
        )
        histories.append(conversation(engine, TURNS))
        stats = engine.scheduler.stats().tiers
        assert stats.get("moved") is None or stats["moved"].hit_tokens == 0
        engine.check_integrity()
        engine.shutdown()
    assert histories[0] == histories[1]


def test_a_cut_mid_turn_or_an_edited_turn_reuses_only_what_is_equal(
    tiny_model_dir: Path,
) -> None:
    """The index knows no turns: a cut inside a turn moves the rest of it too; a kept turn
    edited by the client moves only up to the edit and recomputes the rest; a run shorter
    than WINDOW is recomputed. Accounting stays exact throughout."""
    from radixserve import Engine

    engine = Engine(
        str(tiny_model_dir), dtype="float32", max_total_tokens=512, hicache_reposition=True
    )
    history = conversation(engine, TURNS)
    mid = history[len(SYSTEM) + 50 :]  # 14 tokens into turn 1's user message
    out = engine.generate(input_ids=SYSTEM + mid + NEW_MSG, sampling_params=REPLY)
    assert out["meta_info"]["cached_tokens_details"]["moved"] == len(mid) - 1  # last: no K/V
    engine.check_integrity()
    edited = history[len(SYSTEM) + 72 :]
    edited[30] = 1
    out = engine.generate(input_ids=SYSTEM + edited + NEW_MSG, sampling_params=REPLY)
    assert out["meta_info"]["cached_tokens_details"] == {"device": len(SYSTEM), "moved": 30}
    engine.check_integrity()
    short = history[len(SYSTEM) + 36 : len(SYSTEM) + 36 + W - 1]  # in no prefix cached
    out = engine.generate(input_ids=SYSTEM + short + NEW_MSG, sampling_params=REPLY)
    assert out["meta_info"]["cached_tokens_details"] == {"device": len(SYSTEM)}
    engine.check_integrity()
    assert engine.flush_cache()
    assert engine.scheduler.kv.pool.num_free == engine.scheduler.kv.pool.capacity
    engine.shutdown()
