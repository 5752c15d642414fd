"""The router's approximate radix tree and its policies, without any server."""

from __future__ import annotations

import dataclasses
import random

import pytest

from radixserve.router.app import routing_key
from radixserve.router.backend import Backend
from radixserve.router.config import RouterConfig
from radixserve.router.policy import CacheAware, LeastLoad, RoundRobin, make_policy
from radixserve.router.tree import PrefixTree, ids_key


def test_tree_match_insert_split() -> None:
    t = PrefixTree()
    assert t.match("hello") == 0
    t.insert("hello world")
    t.check_integrity()
    assert t.size == 11
    assert t.match("hello there") == 6  # "hello "
    assert t.match("hello world, again") == 11
    assert t.match("help") == 3
    t.insert("hello there")  # splits the edge after "hello "
    t.check_integrity()
    assert t.size == 11 + 5
    assert t.match("hello there!") == 11
    assert sorted(c.label for c in t.root.children["h"].children.values()) == ["there", "world"]
    t.insert("hello")  # a prefix of what is there: adds nothing
    t.check_integrity()
    assert t.size == 16


def test_tree_prunes_least_recently_inserted_first() -> None:
    t = PrefixTree()
    t.insert("sys A q1")
    t.insert("sys B q2")
    t.insert("sys A q3")  # refreshes the shared "sys " and "A q" path
    t.check_integrity()
    size = t.size  # "sys " 4 + "A q" 3 + "1" + "3" + "B q2" 4 = 13
    assert size == 13
    freed = t.prune(size - 4)  # leaf "1" (tick 1) goes, then "B q2" (tick 2): 12 > 9 >= 8
    t.check_integrity()
    assert freed == 5
    assert t.match("sys B q2") == 4 and t.match("sys A q1") == 7 and t.match("sys A q3") == 8
    t.prune(4)  # leaf "3" goes, then "A q" is a leaf and goes
    t.check_integrity()
    assert t.size == 4 and t.match("sys A q3") == 4
    t.prune(0)
    t.check_integrity()
    assert t.size == 0 and t.match("sys") == 0


def test_tree_random_against_reference() -> None:
    """match() is the longest common prefix with any inserted (unpruned) string."""
    rng = random.Random(0)
    t, kept = PrefixTree(), []
    for _ in range(300):
        s = "".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))
        t.insert(s)
        kept.append(s)
        t.check_integrity()
        q = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        best = max(len(_common(q, k)) for k in kept)
        assert t.match(q) == best, (q, best)


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def test_ids_key_respects_id_boundaries() -> None:
    t = PrefixTree()
    t.insert(ids_key([1, 2, 3]))
    assert t.match(ids_key([1, 2, 3, 4])) == len(ids_key([1, 2, 3]))
    assert t.match(ids_key([1, 23])) == 1  # one character per id: no partial ids
    assert len(ids_key([0, 150_000, 2**40])) == 3


def _workers(*loads: int) -> list[Backend]:
    return [Backend(f"http://w{i}", healthy=True, in_flight=load) for i, load in enumerate(loads)]


def test_cache_aware_routes_by_prefix_when_balanced() -> None:
    p = CacheAware(RouterConfig(cache_threshold=0.5, balance_abs_threshold=4))
    ws = _workers(0, 0)
    first = p.choose(ws, "SYSTEM PROMPT ONE. question 1")
    assert first.reason == "room" and first.worker is ws[0]  # tie: the first, empty trees
    other = p.choose(ws, "another system prompt. question 1")
    assert other.reason == "room" and other.worker is ws[1]  # the smaller tree
    again = p.choose(ws, "SYSTEM PROMPT ONE. question 2")
    assert again.reason == "cache" and again.worker is ws[0]
    assert again.matched == len("SYSTEM PROMPT ONE. question ")
    ws[0].in_flight = 3  # still balanced (3 - 0 <= 4): the cache wins
    assert p.choose(ws, "SYSTEM PROMPT ONE. question 3").worker is ws[0]
    ws[0].in_flight = 9  # 9 - 0 > 4 and 9 > 1.5 * 0: the least loaded
    d = p.choose(ws, "SYSTEM PROMPT ONE. question 4")
    assert d.reason == "balance" and d.worker is ws[1]
    for tree in p.trees.values():
        tree.check_integrity()


def test_cache_aware_low_match_goes_to_the_smallest_tree() -> None:
    """A new prefix goes where the least is held (its later requests follow it there), the
    least loaded of equal trees; far-apart loads go to the least loaded."""
    p = CacheAware(RouterConfig(cache_threshold=0.5, balance_abs_threshold=4))
    ws = _workers(2, 1)
    d = p.choose(ws, "abcdef")  # empty trees: the less loaded
    assert d.reason == "room" and d.worker is ws[1] and p.trees[ws[1].url].size == 6
    d = p.choose(ws, "abcXXXXXXXXXXXXXXX")  # 3 / 18 <= 0.5: the empty tree, though busier
    assert d.reason == "room" and d.worker is ws[0] and d.matched == 0
    ws[0].in_flight = 9  # 9 - 1 > 4 and 9 > 1.5 * 1
    d = p.choose(ws, "a new prefix, far longer than the others")
    assert d.reason == "balance" and d.worker is ws[1]


def test_cache_aware_prunes_to_budget_and_forgets() -> None:
    p = CacheAware(RouterConfig(tree_budget_chars=20))
    ws = _workers(0)
    for i in range(10):
        p.choose(ws, f"prompt number {i} ...")
        assert p.trees[ws[0].url].size <= 20
    assert p.trees[ws[0].url].match("prompt number 9 ...") == len("prompt number 9 ...")
    p.forget(ws[0].url)
    assert p.stats(ws[0].url) == {"tree_chars": 0}


def test_other_policies() -> None:
    ws = _workers(3, 1, 2)
    rr = RoundRobin()
    assert [rr.choose(ws, "x").worker.url for _ in range(4)] == [
        "http://w0", "http://w1", "http://w2", "http://w0",
    ]  # fmt: skip
    assert LeastLoad().choose(ws, "x").worker is ws[1]
    rand = make_policy(RouterConfig(policy="random"))
    assert {rand.choose(ws, "x").worker.url for _ in range(60)} == {w.url for w in ws}
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="nearest")
    with pytest.raises(ValueError, match="worker url"):
        RouterConfig(worker_urls=("localhost:3000",))


def test_routing_key() -> None:
    assert routing_key("/generate", {"text": "abc"}) == "abc"
    assert routing_key("/generate", {"text": ["first", "second"]}) == "first"
    assert routing_key("/generate", {"input_ids": [5, 6]}) == "\x05\x06"
    assert routing_key("/generate", {"input_ids": [[5, 6], [7]]}) == "\x05\x06"
    assert routing_key("/v1/completions", {"prompt": "p"}) == "p"
    chat = routing_key("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert chat.startswith('[{"role": "user", "content": "hi"')
    assert routing_key("/generate", ["not", "a", "dict"]) == ""
    assert routing_key("/generate", {"text": 5}) == ""


def test_dp_workers_get_the_serve_flags() -> None:
    from radixserve.cli import build_parser, config_from_args, worker_argv, worker_env

    parser = build_parser()
    argv = ["serve", "--dp-size", "2", "--port", "31000", "--max-total-tokens", "4096"]
    argv += ["--disable-radix-cache", "--api-key", "k", "--router-policy", "round_robin"]
    argv += ["--admin-api-key", "adm", "--allowed-hosts", "example.com"]
    args = parser.parse_args(argv)
    assert (args.dp_size, args.router_policy) == (2, "round_robin")
    config = config_from_args(args, parser)
    flags = worker_argv(config)  # secrets and where to listen stay off the command line
    assert flags == ["--max-total-tokens", "4096", "--disable-radix-cache"]
    assert worker_env(config) == {"RADIXSERVE_API_KEY": "k", "RADIXSERVE_ADMIN_API_KEY": "adm"}
    again = config_from_args(parser.parse_args(["serve", *flags, "--port", "31000"]), parser)
    assert again == dataclasses.replace(config, api_key=None, admin_api_key=None, allowed_hosts=())
    router = parser.parse_args(["router", "--worker-urls", "http://a:1", "http://b:2"])
    assert router.worker_urls == ["http://a:1", "http://b:2"]


def test_dp_workers_get_the_redis_url_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Redis tier's URL carries its password: never on a worker's command line."""
    from radixserve.cli import worker_argv, worker_env
    from radixserve.config import HICACHE_REMOTE_ENV, EngineConfig

    url = "redis://:the-redis-password@127.0.0.1:6379/0"
    config = EngineConfig(hicache_remote=url, hicache_remote_ttl=60)
    assert worker_argv(config) == ["--hicache-remote-ttl", "60"]
    assert worker_env(config) == {HICACHE_REMOTE_ENV: url}
    monkeypatch.setenv(HICACHE_REMOTE_ENV, url)  # as a worker reads it
    assert EngineConfig().remote_url() == url and EngineConfig().hicache_enabled
    monkeypatch.setenv(HICACHE_REMOTE_ENV, "http://:the-redis-password@host")
    with pytest.raises(ValueError, match="redis:// or rediss://") as refused:
        EngineConfig()
    assert "the-redis-password" not in str(refused.value)
