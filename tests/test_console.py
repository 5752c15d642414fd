"""The web console's data: the bounded radix-tree snapshot (kvcache/tree_view.py), the
serving history (server/history.py), and the live routes `/`, `/cache_tree` and
`/metrics_history` on a real server (tiny random model). The page itself, in a real browser,
is tests/test_console_browser.py."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import torch
from conftest import API_KEY, launch_server

from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.radix import RadixCache
from radixserve.kvcache.tree_view import running_counts, view_tree
from radixserve.server.history import BUCKET_S, WINDOW_S, History


def cache_with(prompts: list[list[int]]) -> RadixCache:
    pool = KVPool(
        sum(map(len, prompts)) + 1, num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32
    )
    cache = RadixCache(pool)
    for p in prompts:
        slots = pool.alloc(len(p))
        assert slots is not None
        cache.insert(p, slots)
    return cache


def test_view_is_breadth_first_and_counts_running_paths() -> None:
    # root -> [1 2 3] -> {[4 5], [6] -> {[7], [8]}}
    cache = cache_with([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 6, 8]])
    shared = cache.match_prefix([1, 2, 3, 6]).last_node
    leaf = cache.match_prefix([1, 2, 3, 6, 8]).last_node
    running = running_counts([leaf, leaf, shared])
    views, truncated = view_tree(cache.root, 100, 10, 2, running, {shared.id})
    assert (len(views), truncated, cache.num_nodes) == (6, False, 6)
    assert [v.depth for v in views] == [0, 1, 2, 2, 3, 3]
    by_id = {v.id: v for v in views}
    top = views[1]
    assert (top.num_tokens, top.preview_ids, top.num_children, top.parent) == (3, [1, 2], 2, 0)
    assert by_id[shared.id].running == 3 and by_id[shared.id].batched
    assert by_id[leaf.id].running == 2 and not by_id[leaf.id].batched
    assert top.running == 3 and views[0].running == 0  # the root is not on anyone's path
    assert sum(v.batched for v in views) == 1


def test_view_limits_nodes_and_depth() -> None:
    cache = cache_with([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 6, 8]])
    views, truncated = view_tree(cache.root, 3, 10, 4, Counter(), set())
    assert (len(views), truncated) == (3, True)
    assert view_tree(cache.root, 6, 10, 4, Counter(), set())[1] is False  # exactly all
    views, truncated = view_tree(cache.root, 100, 1, 4, Counter(), set())
    assert [v.depth for v in views] == [0, 1] and truncated
    shown = {v.id for v in views}
    assert all(v.parent in shown for v in views[1:])


def test_view_of_a_ten_thousand_node_tree_stays_bounded() -> None:
    # 5000 distinct two-token tails under one shared head: 1 + 1 + 5000 + splits nodes.
    prompts = [[0, 0, i // 100 + 1, i % 100 + 1] for i in range(5000)]
    cache = cache_with(prompts)
    views, truncated = view_tree(cache.root, 300, 16, 8, Counter(), set())
    assert cache.num_nodes > 5000 and truncated and len(views) == 300
    cache.check_integrity()  # num_nodes agrees with a walk of the tree


def test_history_buckets_rates_and_percentiles() -> None:
    now = [1000.0]
    h = History(clock=lambda: now[0])
    h.tokens(50)
    h.ttft(0.2)
    h.ttft(0.4)
    h.itl(0.01)
    h.finished(prompt_tokens=100, cached_tokens=75)
    now[0] += BUCKET_S
    h.tokens(10)
    points = h.series()["points"]
    assert len(points) == WINDOW_S / BUCKET_S
    prev, last = points[-2], points[-1]
    assert prev["tokens_per_s"] == 50 / BUCKET_S and last["tokens_per_s"] == 10 / BUCKET_S
    assert prev["ttft_p50"] == 0.4 and prev["ttft_p99"] == 0.4 and prev["itl_p50"] == 0.01
    assert prev["cache_hit_rate"] == 0.75 and last["cache_hit_rate"] is None
    assert points[0]["tokens_per_s"] == 0 and points[0]["ttft_p50"] is None


# ---------------------------------------------------------------- live server


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def test_page_needs_the_key_as_a_query_parameter(server) -> None:
    assert httpx.get(server.url + "/").status_code == 401
    assert httpx.get(server.url + "/?key=wrong").status_code == 401
    r = httpx.get(server.url + f"/?key={API_KEY}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<title>radixserve console</title>" in r.text
    assert "http://" not in r.text.replace('"http://www.w3.org/2000/svg"', "")  # no outside assets
    # the key in the query opens only the page, not the API
    assert httpx.get(server.url + f"/cache_tree?key={API_KEY}").status_code == 401


def test_cache_tree_shows_a_fork_of_four_as_one_node_with_four_children(client) -> None:
    assert client.post("/flush_cache").status_code == 200
    prompt = " ".join(f"w{i}" for i in range(200))  # 690 tokens shared by 4 samples
    r = client.post(
        "/v1/completions",
        json={
            "model": "m",
            "prompt": prompt,
            "n": 4,
            "max_tokens": 3,
            "temperature": 2.0,
            "seed": 1,
        },
    )
    assert r.status_code == 200, r.text
    view = client.get("/cache_tree").json()
    nodes = view["nodes"]
    kids = Counter(n["parent"] for n in nodes)
    forks = [n for n in nodes if kids[n["id"]] == 4 and n["num_children"] == 4]
    assert len(forks) == 1, nodes
    fork = forks[0]
    assert fork["num_tokens"] >= 512 and fork["text"] and fork["tier"] == "device"
    # Not batched: TreeBackend's defaults fold a segment this short (they keep L >= 1024 and
    # k * L >= 8192; the 1024-token context of this test's model has no room for one), so each
    # sample read it with its own keys. test_view_is_breadth_first_and_counts_running_paths
    # covers the flag.
    assert not fork["batched"]
    assert fork["running"] == 0 and fork["lock_ref"] == 0  # all finished: evictable
    assert view["total_nodes"] == len(nodes) and not view["truncated"]
    assert view["cached_tokens"] == sum(n["num_tokens"] for n in nodes)
    assert view["stats"]["num_running"] == 0 and view["attention_backend"] == "tree"


def test_cache_tree_limits_and_bad_parameters(client) -> None:
    small = client.get("/cache_tree", params={"max_nodes": 2}).json()
    assert len(small["nodes"]) == 2 and small["truncated"]
    for params, field in [
        ({"max_nodes": 0}, "max_nodes"),
        ({"max_nodes": 100000}, "max_nodes"),
        ({"max_depth": "deep"}, "max_depth"),
    ]:
        r = client.get("/cache_tree", params=params)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_metrics_history_records_what_was_served(client) -> None:
    r = client.post("/generate", json={"text": "a b c", "sampling_params": {"max_new_tokens": 5}})
    assert r.status_code == 200
    points = client.get("/metrics_history").json()["points"]
    recent = points[-3:]  # this request and the previous tests' fall in the last buckets
    assert sum(p["tokens_per_s"] for p in recent) * BUCKET_S >= 5
    assert any(p["ttft_p50"] is not None and p["ttft_p50"] > 0 for p in recent)
    assert any(p["cache_hit_rate"] is not None for p in recent)


@pytest.mark.slow  # a server start of its own: ~7 s
def test_no_web_ui_leaves_the_page_unrouted(tiny_model_dir, tmp_path) -> None:
    h = launch_server(tiny_model_dir, tmp_path, "--no-web-ui", "--max-total-tokens", "256")
    try:
        assert httpx.get(h.url + "/").status_code == 404
        assert httpx.get(h.url + "/cache_tree").status_code == 200  # the API stays
    finally:
        assert h.stop() == 0
