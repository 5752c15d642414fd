"""Cache salts (core/request.py `CacheSalt`) without a server: every path by which one
request reuses what another computed shares only within one salt. The radix tree's parts
(radix.py; the state machine of test_radix_cache.py checks them against a model), radix
drafts (the cache's continuations and its suffix index, through the Speculator), the host
and disk tiers' records (hicache.py), positional decoupling's run index (reposition.py),
the admission policy, and the Engine's `cache_salt`. The keys file of several tenants
(keys.py) and its errors are here too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve import Engine
from radixserve.cli import build_parser, config_from_args
from radixserve.config import EngineConfig
from radixserve.core.params import SamplingParams
from radixserve.core.request import SHARED, CacheSalt, TokenizedRequest
from radixserve.keys import ADMIN_TENANT, DEFAULT_TENANT, MIN_KEY_CHARS, read_keys_file
from radixserve.kvcache.disk_store import DiskStore
from radixserve.kvcache.hicache import HiCache, namespace_of, pool_layout
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.radix import RadixCache
from radixserve.kvcache.reposition import WINDOW, RunIndex
from radixserve.kvcache.tier_store import CHUNK_TOKENS, ChunkCodec, HostStore, chunk_keys
from radixserve.sampling.stop import StopChecker
from radixserve.scheduler.policy import shares_uncached_prefix
from radixserve.scheduler.sample import Sample
from radixserve.scheduler.speculative import Speculator

A = CacheSalt("alice")
B = CacheSalt("bob")
A_U1 = CacheSalt("alice", "u1")
C = CHUNK_TOKENS
PARAMS = SamplingParams(max_new_tokens=100)


def alloc(pool: KVPool, n: int) -> torch.Tensor:
    slots = pool.alloc(n)
    assert slots is not None, f"test pool too small for {n}"
    return slots


# ---------------------------------------------------------------- the radix tree's parts


def test_a_prefix_cached_under_one_salt_is_found_under_it_alone() -> None:
    pool = KVPool(129, 1, 1, 2, torch.float32)
    cache = RadixCache(pool)
    prompt = list(range(100, 140))
    kept = cache.insert(prompt, alloc(pool, len(prompt)), salt=A)
    cache.check_integrity()
    assert set(cache.roots()) == {SHARED, A}
    for other in (SHARED, B, A_U1):
        m = cache.match_prefix(prompt, salt=other)
        assert len(m.indices) == 0 and m.last_node is cache.root
        assert cache.cached_length(prompt, salt=other) == 0
        assert cache.continuations(prompt[:10], 8, salt=other) == []
    assert cache.match_prefix(prompt + [7], salt=A).indices.tolist() == kept.indices.tolist()
    assert cache.continuations(prompt[:10], 8, salt=A) == [prompt[10:18]]
    # the same tokens under B: B's own slots, a part of its own
    theirs = cache.insert(prompt, alloc(pool, len(prompt)), salt=B)
    assert set(theirs.indices.tolist()).isdisjoint(kept.indices.tolist())
    assert pool.num_free == pool.capacity - 2 * len(prompt)
    cache.check_integrity()
    # one LRU over the parts; a part's root goes with its last node
    assert cache.evict(len(prompt)) == len(prompt)  # A's, used first
    assert set(cache.roots()) == {SHARED, B} and cache.num_nodes == 3
    cache.check_integrity()


def test_the_suffix_index_finds_runs_in_the_callers_part_only() -> None:
    pool = KVPool(129, 1, 1, 2, torch.float32)
    cache = RadixCache(pool, index_suffixes=True)
    answer = list(range(500, 540))
    cache.insert([1, 2, 3, *answer], alloc(pool, 43), salt=A)
    tail = [9, 9, *answer[:5]]  # another prefix, then the start of A's answer
    assert cache.suffix_continuations(tail, 8, salt=A) == (5, [answer[5:13]])
    for other in (SHARED, B, A_U1):
        assert cache.suffix_continuations(tail, 8, salt=other) == (0, [])
    cache.insert([4, *answer], alloc(pool, 41), salt=B)  # B's own copy: found under B
    assert cache.suffix_continuations(tail, 8, salt=B) == (5, [answer[5:13]])
    cache.check_integrity()


def draft_of(cache: RadixCache, algorithm: str, prompt: list[int], salt: CacheSalt) -> list[int]:
    """The tokens the Speculator proposes for a sample of `salt` whose sequence is `prompt`."""
    speculator = Speculator(algorithm, 8, 4, cache)
    request = TokenizedRequest("r", prompt, PARAMS, salt=salt)
    req = Sample(request, 0, StopChecker(PARAMS, [], None))
    speculator.next_step(1)
    [draft] = speculator.propose([req], room=64)
    return draft.tokens


@pytest.mark.parametrize("algorithm", ["radix", "auto"])
def test_radix_drafts_never_propose_another_salts_tokens(algorithm: str) -> None:
    """Both radix drafters: the continuations of the sample's whole sequence, and the suffix
    index (what followed its last tokens anywhere in the cache)."""
    pool = KVPool(257, 1, 1, 2, torch.float32)
    cache = RadixCache(pool, index_suffixes=True)
    secret = list(range(700, 760))  # only A's requests hold these tokens
    cache.insert([1, 2, 3, *secret], alloc(pool, 63), salt=A)
    extends = [1, 2, 3, *secret[:6]]  # extended by A's cached sequence
    elsewhere = [8, 8, *secret[:6]]  # A's tokens under another prefix
    for prompt in (extends, elsewhere):
        assert draft_of(cache, algorithm, prompt, A) == secret[6:14]
        for other in (SHARED, B, A_U1):
            assert draft_of(cache, algorithm, prompt, other) == []


# ---------------------------------------------------------------- lower tiers


def tier_cache(pool: KVPool, disk: DiskStore) -> HiCache:
    """A host tier of one chunk over `disk`: what it cannot hold spills to disk."""
    layout = pool_layout(pool)
    return HiCache(pool, [HostStore(layout.chunk_bytes, layout, disk.put), disk], None, "test")


def test_tier_records_of_one_salt_never_match_another(tmp_path: Path) -> None:
    """A's prefix, evicted to the host tier (chunks 0..2 spill to disk), comes back under A
    only; after a restart the disk tier's records too. Keys differ by salt, whatever
    follows."""
    tokens = list(range(1000, 1000 + 4 * C))
    pool = KVPool(129, 2, 1, 4, torch.float32)
    codec = ChunkCodec(pool_layout(pool), b"a secret shared by the test servers")
    cache = tier_cache(pool, DiskStore(str(tmp_path), 1 << 30, codec))
    cache.insert(tokens, alloc(pool, len(tokens)), salt=A)
    assert cache.evict(len(tokens)) == len(tokens)
    cache.drain()
    for other in (SHARED, B, A_U1):
        m = cache.match_prefix(tokens + [1], salt=other)
        assert len(m.indices) == 0 and m.tier_tokens == {}
    back = cache.match_prefix(tokens + [1], salt=A).tier_tokens
    assert back == {"disk": 3 * C, "host": C}
    cache.check_integrity()
    cache.close()
    pool = KVPool(129, 2, 1, 4, torch.float32)  # a restart: the disk tier alone holds them
    cache = tier_cache(pool, DiskStore(str(tmp_path), 1 << 30, codec))
    assert cache.match_prefix(tokens + [1], salt=B).tier_tokens == {}
    assert cache.match_prefix(tokens + [1], salt=A).tier_tokens == {"disk": 3 * C}
    cache.close()
    keys = {s: chunk_keys(namespace_of("ns", s), tokens) for s in (SHARED, A, B, A_U1)}
    assert len({k for ks in keys.values() for k in ks}) == 4 * len(keys[A])
    # the sliding-window suffix after a salt's digest cannot spell another salt's namespace
    assert namespace_of("ns", CacheSalt("a|global")) != namespace_of("ns", A) + "|global"


def test_moved_runs_are_found_under_their_salt_only() -> None:
    index = RunIndex(1 << 16)
    old = list(range(3000, 3000 + 4 * WINDOW))
    index.add(old, A)
    new = [5, 6, *old[WINDOW:]]  # the old sequence's later turns behind a new prefix
    run = index.find(new, 2, A)
    assert run is not None and run.old == old and run.start == WINDOW
    for other in (SHARED, B, A_U1):
        assert index.find(new, 2, other) is None


def test_admission_defers_only_to_a_sample_of_its_own_salt() -> None:
    prompt = list(range(40, 120))

    def req(salt: CacheSalt) -> Sample:
        return Sample(
            TokenizedRequest("r", prompt, PARAMS, salt=salt), 0, StopChecker(PARAMS, [], None)
        )

    admitted = [req(A)]
    assert shares_uncached_prefix(req(A), admitted, 32)
    assert not shares_uncached_prefix(req(B), admitted, 32)


# ---------------------------------------------------------------- the Engine's cache_salt


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(
        str(tiny_model_dir), dtype="float32", max_total_tokens=4096, speculative_algorithm="radix"
    )


def test_engine_reports_cached_tokens_within_its_salt(engine: Engine) -> None:
    prompt = list(range(2000, 2100))
    once = {"max_new_tokens": 1}

    def cached(salt: str | None) -> int:
        out = engine.generate(input_ids=prompt, sampling_params=once, cache_salt=salt)
        assert isinstance(out, dict)
        return int(out["meta_info"]["cached_tokens"])

    assert cached("one") == 0
    assert cached("two") == 0 and cached(None) == 0
    assert cached("one") == len(prompt) - 1  # all but the last token, whose logits it needs
    with pytest.raises(ValueError, match="cache_salt"):
        engine.generate(input_ids=prompt, sampling_params=once, cache_salt="")
    with pytest.raises(ValueError, match="cache_salt"):
        engine.generate(input_ids=prompt, sampling_params=once, cache_salt="x" * 257)
    engine.scheduler.check_integrity()


def test_engine_drafts_only_from_its_salt(engine: Engine) -> None:
    """A repeated request is drafted from the radix cache (its first run's output): under
    the same salt, not under another."""
    prompt = list(range(3000, 3040))
    greedy = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    first = engine.generate(input_ids=prompt, sampling_params=greedy, cache_salt="one")
    stats = engine.scheduler.speculator.stats
    before = stats.proposed
    other = engine.generate(input_ids=prompt, sampling_params=greedy, cache_salt="two")
    assert stats.proposed == before  # nothing of "one" reached "two"'s drafts
    again = engine.generate(input_ids=prompt, sampling_params=greedy, cache_salt="one")
    assert stats.accepted > 0 and stats.proposed > before
    assert isinstance(first, dict) and isinstance(other, dict) and isinstance(again, dict)
    assert first["output_ids"] == other["output_ids"] == again["output_ids"]


# ---------------------------------------------------------------- the keys file


def keys_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "keys"
    path.write_text(text)
    return str(path)


ALICE_KEY = "alice-key-0123456789"
BOB_KEY = "bob-key-0123456789ab"


def test_keys_file_gives_each_key_its_tenant(tmp_path: Path) -> None:
    lines = ["# tenants", "", f"{ALICE_KEY} alice", f"  {BOB_KEY}\tbob  ", f"# {ALICE_KEY} x"]
    path = keys_file(tmp_path, "\n".join([*lines, "key-of-alice-two alice", ""]))
    assert read_keys_file(path) == {ALICE_KEY: "alice", BOB_KEY: "bob", "key-of-alice-two": "alice"}
    config = EngineConfig(api_keys_file=path, api_key="single-key", cache_isolation="tenant")
    assert config.tenant_keys()["single-key"] == DEFAULT_TENANT
    assert config.several_tenants
    assert not EngineConfig(api_key="single-key").several_tenants


@pytest.mark.parametrize(
    ("text", "line", "says"),
    [
        (f"{ALICE_KEY}\n", 1, "expected 'KEY TENANT', got 1 fields"),
        (f"# c\n{ALICE_KEY} alice extra\n", 2, "got 3 fields"),
        (f"{ALICE_KEY} alice\n\n{ALICE_KEY} bob\n", 3, "the key of line 1 again"),
        ("short-key alice\n", 1, f"at least {MIN_KEY_CHARS}"),
        (f"{ALICE_KEY} al/ice\n", 1, "tenant 'al/ice'"),
        (f"{ALICE_KEY} {ADMIN_TENANT}\n", 1, f"not {ADMIN_TENANT!r}"),
        (f"{ALICE_KEY}é alice\n", 1, "printable ASCII"),
    ],
)
def test_a_bad_keys_file_is_refused_at_start_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, says: str
) -> None:
    path = keys_file(tmp_path, text)
    parser = build_parser()
    args = parser.parse_args(["serve", "--api-keys-file", path, "--cache-isolation", "tenant"])
    with pytest.raises(SystemExit) as exit_:
        config_from_args(args, parser)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{path}, line {line}:" in err and says in err, err
    assert ALICE_KEY not in err and "short-key" not in err  # never the key


def test_keys_file_errors_name_the_file_and_never_a_key(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="cannot read it"):
        EngineConfig(api_keys_file=missing)
    path = keys_file(tmp_path, f"{ALICE_KEY} alice\n")
    for flag in ("api_key", "admin_api_key"):
        with pytest.raises(ValueError, match="line 1: the key is also") as e:
            EngineConfig(api_keys_file=path, **{flag: ALICE_KEY})
        assert ALICE_KEY not in str(e.value)
    with pytest.raises(ValueError, match="cache_isolation"):
        EngineConfig(cache_isolation="user")
