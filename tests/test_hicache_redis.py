"""The shared Redis tier (L4) on a real redis-server started here on a loopback port: two
caches ("servers") reuse each other's K/V bit for bit; a damaged record is a miss; Redis
killed mid-run degrades to recompute without a crash; two real servers share a conversation
(its second turn on the other server prefills only the new message)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import free_port, launch_server
from test_hicache import TOKENS, computed, make_pool, rows_at

from radixserve.kvcache.hicache import HiCache, pool_layout
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.remote_store import PREFIX, RemoteStore
from radixserve.kvcache.tier_store import HostStore, chunk_keys

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (apt-get install -y redis-server; .ci/run does)",
)


class RedisServer:
    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        import redis

        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {port} did not answer")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port())
    yield server
    server.stop()


def remote_cache(url: str) -> tuple[HiCache, KVPool]:
    pool = make_pool()
    return HiCache(pool, [], RemoteStore(url, pool_layout(pool)), "test"), pool


def test_second_server_reuses_the_first_ones_kv(redis_server: RedisServer) -> None:
    a, pool_a = remote_cache(redis_server.url)
    slots, ref = computed(pool_a, TOKENS)
    a.insert(TOKENS, slots)  # written through to Redis
    a.drain()
    b, pool_b = remote_cache(redis_server.url)
    m = b.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"remote": 64}
    assert torch.equal(rows_at(pool_b, m.indices), ref)
    assert b.tier_stats()["remote"].loads == 4
    b.check_integrity()
    b.flush()
    assert pool_b.num_free == pool_b.capacity
    a.close()
    b.close()


def test_prefetch_pulls_a_waiting_prefix_up_from_redis(redis_server: RedisServer) -> None:
    a, pool_a = remote_cache(redis_server.url)
    slots, ref = computed(pool_a, TOKENS)
    a.insert(TOKENS, slots)
    a.drain()
    pool = make_pool()
    layout = pool_layout(pool)
    host = HostStore(64 * layout.chunk_bytes, layout, None)
    b = HiCache(pool, [host], RemoteStore(redis_server.url, layout), "test")
    b.prefetch([TOKENS[:40] + [1]])  # waiting: chunks 0 and 1 (chunk 2 ends past the prompt)
    b.drain()
    assert b.prefetched == 2 and pool.num_free == pool.capacity  # the pool is untouched
    assert b.tier_stats()["remote"].loads == 0  # read ahead by the reader, not by a match
    m = b.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"host": 32, "remote": 32}  # the rest: one MGET at admission
    assert torch.equal(rows_at(pool, m.indices), ref)
    b.check_integrity()
    a.close()
    b.close()


def test_damaged_remote_record_is_a_miss(redis_server: RedisServer) -> None:
    a, pool_a = remote_cache(redis_server.url)
    slots, ref = computed(pool_a, TOKENS)
    a.insert(TOKENS, slots)
    a.drain()
    import redis

    key = PREFIX + chunk_keys("test", TOKENS)[2]
    client = redis.Redis(port=redis_server.port)
    data = client.get(key)
    assert data is not None
    client.set(key, data[:-1] + bytes([data[-1] ^ 1]))
    b, pool_b = remote_cache(redis_server.url)
    m = b.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"remote": 32}  # chunks 0, 1; chunk 2 refused: recomputed
    assert torch.equal(rows_at(pool_b, m.indices), ref[:, :, :32])
    assert b.tier_stats()["remote"].faults == 1
    a.close()
    b.close()


def test_redis_killed_mid_run_degrades_to_recompute(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    a, pool_a = remote_cache(redis_server.url)
    slots, _ = computed(pool_a, TOKENS)
    a.insert(TOKENS, slots)
    a.drain()
    redis_server.stop()
    b, pool_b = remote_cache(redis_server.url)
    with caplog.at_level(logging.WARNING, logger="radixserve.kvcache"):
        start = time.monotonic()
        for _ in range(20):
            m = b.match_prefix(TOKENS + [1])
            assert m.tier_tokens == {} and len(m.indices) == 0
        more, _ = computed(pool_b, list(range(3000, 3032)), seed=3)
        b.insert(list(range(3000, 3032)), more)  # its write-through is dropped, not raised
        b.drain()
        assert time.monotonic() - start < 5  # down: one short timeout per retry period
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1
    assert b.tier_stats()["remote"].faults >= 1
    b.flush()
    assert pool_b.num_free == pool_b.capacity
    b.check_integrity()
    a.close()
    b.close()


# ---------------------------------------------------------------- two real servers


def chat(client: httpx.Client, messages: list[dict[str, str]]) -> dict:
    params = {"temperature": 0, "max_new_tokens": 8}
    r = client.post("/generate", json={"text": messages_text(messages), "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def messages_text(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


@pytest.mark.slow  # two server start-ups: ~30 s
def test_two_servers_share_a_conversation(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    flags = ["--max-total-tokens", "1024", "--hicache-remote", redis_server.url]
    servers = [launch_server(tiny_model_dir, tmp_path, *flags) for _ in range(2)]
    try:
        history = [{"role": "user", "content": "Tell me about the rivers of Europe. " * 12}]
        with servers[0].client() as c0, servers[1].client() as c1:
            first = chat(c0, history)
            history += [
                {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "And the longest one?"},
            ]
            time.sleep(0.5)  # the write-through is asynchronous
            second = chat(c1, history)
        meta = second["meta_info"]
        new_tokens = meta["prompt_tokens"] - first["meta_info"]["prompt_tokens"]
        assert meta["cached_tokens_details"].get("remote", 0) > 0, meta
        prefilled = meta["prompt_tokens"] - meta["cached_tokens"]
        # only the new message (its assistant turn re-tokenized) and the chunk tail
        assert prefilled <= new_tokens + 16, (prefilled, new_tokens, meta)
        metrics = httpx.get(servers[1].url + "/metrics").text
        assert 'radixserve_hicache_hit_tokens_total{tier="remote"}' in metrics
    finally:
        for s in servers:
            assert s.stop() == 0, s.log_text()[-3000:]
