"""Sliding-window layers keep K/V only where a query can see it: the pool's sliding rows
(kvcache/pool.py), freed out of the running samples' windows and beyond the cache's share
(KVManager.trim_swa), and radix matches that stop where the window before their end lacks
them (kvcache/radix.py). Exactness against HF transformers' greedy tokens in float32, on the
tiny Gemma 3 of models/synthetic.py (window 16; layer 1 global, the other three sliding)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from helpers import assert_all_free

from radixserve import Engine
from radixserve.config import EngineConfig
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.radix import SWA_TAIL_SLACK, RadixCache
from radixserve.models.synthetic import build_tiny_model

WINDOW = 16
CHUNK = 16  # prompt chunks: each becomes a radix node as it is cached
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_total_tokens": 2048,
    "chunked_prefill_size": CHUNK,
    "max_prefill_tokens": 64,
}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gemma3") / "m", seed=3, family="gemma3")


@pytest.fixture(scope="module")
def hf(gemma3: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}


def sliding_pool(capacity: int) -> KVPool:
    return KVPool(capacity + 1, 2, 1, 2, torch.float32, windows=[4, 0])


def test_pool_gives_each_slot_a_sliding_row_and_takes_it_back() -> None:
    pool = sliding_pool(8)
    s = pool.alloc(3)
    assert s is not None and pool.swa_used == 3
    assert pool.has_swa(s).tolist() == [True, True, True]
    assert torch.equal(pool.layer_slots(1, s), s)  # the global layer: the slots
    rows = pool.layer_slots(0, s)
    assert int(rows.unique().numel()) == 3 and bool((rows > 0).all())
    assert pool.free_swa(s[:1]) == 1 and pool.free_swa(s[:1]) == 0
    assert pool.has_swa(s).tolist() == [False, True, True] and pool.swa_used == 2
    t = pool.alloc(2)
    assert t is not None
    assert pool.adopt_swa(s[:2], t).tolist() == [True, False]  # s[1] has its own
    assert pool.has_swa(s).tolist() == [True, True, True]
    assert pool.has_swa(t).tolist() == [False, True]
    pool.check_swa()
    pool.free(t)
    pool.free(s)
    assert pool.num_free == pool.capacity and pool.swa_used == 0
    pool.check_swa()


def cached_path(capacity: int) -> tuple[KVPool, RadixCache, list[int], torch.Tensor]:
    """Tokens 0..199 cached as two nodes, [0, 100) and [100, 200) (window 4: the first
    ends farther than SWA_TAIL_SLACK + 4 before the leaf's end), and the tree's slots."""
    pool = sliding_pool(capacity)
    cache = RadixCache(pool)
    ids = list(range(100, 300))
    slots = pool.alloc(200)
    assert slots is not None
    cache.insert(ids[:100], slots[:100].clone())
    cache.insert(ids, slots.clone())
    return pool, cache, ids, slots


def test_match_stops_where_the_window_before_its_end_lacks_sliding_rows() -> None:
    pool, cache, ids, slots = cached_path(256)
    assert cache.swa_tokens == 200
    assert cache.trim_swa(spared=set()) == 100  # the leaf's are kept: matches stop there
    assert pool.has_swa(slots).tolist() == [False] * 100 + [True] * 100
    assert cache.swa_tokens == 100
    assert len(cache.match_prefix(ids).indices) == 200
    assert len(cache.match_prefix(ids[:150]).indices) == 150  # [146, 150) has them
    assert len(cache.match_prefix(ids[:103]).indices) == 0  # [99, 103) lacks token 99's
    assert len(cache.match_prefix(ids[:104]).indices) == 104
    cache.check_integrity()
    pool.check_swa()


def test_trim_keeps_the_window_before_an_anchor_and_spared_nodes() -> None:
    """A spared node and one ending at an anchor keep their rows; short of rows, only the
    spared ones do."""
    pool, cache, ids, slots = cached_path(256)
    upper = cache.match_prefix(ids[:100]).last_node
    assert cache.trim_swa(spared={upper.id}) == 0
    upper.anchor = True  # a prompt ends there
    assert cache.trim_swa(spared=set()) == 0
    upper.anchor = False
    lower = cache.match_prefix(ids).last_node
    assert cache.trim_swa(spared={lower.id}, keep_ends=False) == 100  # rows are short
    assert cache.trim_swa(spared=set(), keep_ends=False) == 100
    assert pool.swa_used == 0
    cache.check_integrity()


def test_recomputed_tokens_give_their_rows_to_the_tree() -> None:
    pool, cache, ids, slots = cached_path(512)
    cache.trim_swa(spared=set())
    assert len(cache.match_prefix(ids[:100]).indices) == 0
    again = pool.alloc(100)  # a request computed them again
    assert again is not None
    m = cache.insert(ids[:100], again)
    assert torch.equal(m.indices, slots[:100])  # the tree keeps its slots, takes the rows
    assert cache.swa_tokens == 200 and pool.swa_used == 200
    assert len(cache.match_prefix(ids[:103]).indices) == 103
    cache.check_integrity()  # the duplicates' slots went back to the pool
    pool.check_swa()


def test_long_generation_keeps_only_the_windows_and_matches_hf(gemma3: Path, hf: Any) -> None:
    """A 400-token prompt and 40 new tokens: at every step the pool holds the sliding rows
    of a few chunks and windows, not of the whole sequence (up to 440), and the tokens are
    HF's. The same prompt again reuses all but its last token."""
    engine = Engine(str(gemma3), **ENGINE)
    kv, pool = engine.scheduler.kv, engine.scheduler.kv.pool
    held: list[int] = []
    trim = kv.trim_swa

    def trim_and_count(pressed: bool = False) -> None:
        trim(pressed)
        held.append(pool.swa_used)

    kv.trim_swa = trim_and_count  # type: ignore[method-assign]
    prompt = tokens(400, seed=1)
    out = engine.generate(input_ids=prompt, sampling_params=greedy(40))
    assert out["output_ids"] == hf_greedy(hf, prompt, 40)
    bound = 2 * WINDOW + SWA_TAIL_SLACK + 2 * CHUNK  # running window, tail, mark, nodes
    assert len(held) >= 25 and 0 < max(held) <= bound, held
    engine.check_integrity()
    again = engine.generate(input_ids=prompt, sampling_params=greedy(8))
    assert again["meta_info"]["cached_tokens"] == 399
    assert again["output_ids"] == out["output_ids"][:8]
    assert_all_free(engine)


def test_conversation_longer_than_the_window_is_reused_and_matches_hf(
    gemma3: Path, hf: Any
) -> None:
    """A second turn reuses the whole first turn (143 tokens: only the windows before its
    prompt's and its output's ends keep sliding K/V) and gives HF's tokens; so do tree and
    flat attention, with and without drafts."""
    first = tokens(120, seed=2)
    for extra in ({}, {"attention_backend": "flat", "speculative_algorithm": "none"}):
        engine = Engine(str(gemma3), **ENGINE, **extra)
        pool = engine.scheduler.kv.pool
        out = engine.generate(input_ids=first, sampling_params=greedy(24))
        assert out["output_ids"] == hf_greedy(hf, first, 24)
        second = first + out["output_ids"] + tokens(10, seed=3)
        want = hf_greedy(hf, second, 24)
        reply = engine.generate(input_ids=second, sampling_params=greedy(24))
        assert reply["meta_info"]["cached_tokens"] == 143  # all but the last new token
        assert reply["output_ids"] == want
        assert pool.swa_used <= 2 * (WINDOW + SWA_TAIL_SLACK) + 2 * CHUNK, pool.swa_used
        engine.check_integrity()
        assert_all_free(engine)


def test_host_tier_keeps_chunks_without_sliding_rows_apart_and_matches_hf(
    gemma3: Path, hf: Any
) -> None:
    """With a host tier and a pool of 512 tokens: a 300-token prompt and 15 new tokens are
    cached, the sliding rows of all but the tails before the prompt's and the output's ends
    freed, and pushed out of the pool by other prompts. Back from the host tier, the prompt
    reuses 288 tokens (whole chunks of 16 before its last token, the last window with its
    sliding rows); a prompt sharing only its first 150 tokens first reuses none (they come
    back without sliding rows); all give HF's tokens."""
    engine = Engine(str(gemma3), hicache_size=0.05, **{**ENGINE, "max_total_tokens": 512})
    prompt = tokens(300, seed=4)
    out = engine.generate(input_ids=prompt, sampling_params=greedy(16))
    assert out["output_ids"] == hf_greedy(hf, prompt, 16)
    for seed in range(5, 8):  # push it out of the pool, into the host tier
        engine.generate(input_ids=tokens(400, seed=seed), sampling_params=greedy(4))
    assert engine.scheduler.cache.tier_stats()["host"].stored_bytes > 0
    shared = prompt[:150] + tokens(20, seed=9)
    other = engine.generate(input_ids=shared, sampling_params=greedy(16))
    assert other["meta_info"]["cached_tokens"] == 0
    assert other["output_ids"] == hf_greedy(hf, shared, 16)
    again = engine.generate(input_ids=prompt, sampling_params=greedy(16))
    assert again["meta_info"]["cached_tokens"] == 288
    # its first 150 tokens are in the pool again (the other prompt computed them)
    assert again["meta_info"]["cached_tokens_details"] == {"device": 150, "host": 138}
    assert again["output_ids"] == out["output_ids"]
    engine.check_integrity()
    assert_all_free(engine)


def test_few_sliding_rows_queue_samples_and_match_hf(gemma3: Path, hf: Any) -> None:
    """Sliding-window K/V for only the tokens one running sample may need (88): three
    samples of 120-token prompts take turns (the cache's rows are freed, samples are
    retracted and come back) and give HF's tokens. Fewer rows are refused, naming the
    setting."""
    need = EngineConfig(**ENGINE).swa_rows_needed(WINDOW)
    assert need == 88
    with pytest.raises(ValueError, match="max_swa_tokens: 87 tokens"):
        Engine(str(gemma3), max_swa_tokens=need - 1, **ENGINE)
    engine = Engine(str(gemma3), max_swa_tokens=need, **ENGINE)
    pool = engine.scheduler.kv.pool
    assert (pool.capacity, pool.swa_capacity) == (2048, 88)
    assert pool.k[0].shape[0] == 89 and pool.k[1].shape[0] == 2049  # sliding, global
    prompts = [tokens(120, seed=10 + i) for i in range(3)]
    outs = engine.generate(input_ids=prompts, sampling_params=greedy(24))
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]
    engine.check_integrity()
    assert_all_free(engine)
