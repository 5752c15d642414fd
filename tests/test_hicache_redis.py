"""The shared Redis tier (L4) on a real redis-server started here on a loopback port: two
caches ("servers") reuse each other's K/V bit for bit; a damaged record is a miss; sealed
records show Redis neither the prompt nor the rows; Redis killed mid-run degrades to
recompute without a crash; two real servers share a conversation (its second turn on the
other server prefills only the new message)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conftest import free_port, launch_server, poll_until
from test_hicache import (
    POISONS,
    SEALED,
    SECRET,
    TOKENS,
    codec,
    computed,
    make_pool,
    poisoned_records,
    rows_at,
    shown,
)

from radixserve.config import HICACHE_REMOTE_ENV, HICACHE_SECRET_ENV, EngineConfig
from radixserve.core.request import SHARED
from radixserve.kvcache import remote_store
from radixserve.kvcache.hicache import HiCache, pool_layout
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.remote_store import PREFIX, RemoteStore
from radixserve.kvcache.tier_store import (
    CHUNK_TOKENS,
    MAGIC,
    SEALED_MAGIC,
    HostStore,
    chunk_keys,
)
from radixserve.models.synthetic import build_tiny_model

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not installed (apt-get install -y redis-server; .ci/run does)",
)


class RedisServer:
    """A password-protected redis-server on a loopback port (as a shared tier should be)."""

    password = "redis-password-never-shown"

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://:{self.password}@127.0.0.1:{port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--requirepass", self.password],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        import redis

        client = self.client()

        def answers() -> bool:
            try:
                return client.ping()
            except redis.ConnectionError:
                return False

        poll_until(answers, 10, f"redis-server answering on port {port}")

    def client(self) -> Any:
        import redis

        return redis.Redis(port=self.port, password=self.password)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port())
    yield server
    server.stop()


def remote_cache(url: str, secret: bytes = SECRET, sealed: bool = False) -> tuple[HiCache, KVPool]:
    pool = make_pool()
    return HiCache(pool, [], RemoteStore(url, codec(pool, secret, sealed)), "test"), pool


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


def test_a_failed_write_is_tried_again_and_known_keys_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key counts as in Redis only once its write succeeded (one written while Redis was
    down is written on a later insert), and the set of such keys stays within MAX_KNOWN.
    With no retry period, each write tries Redis again."""
    monkeypatch.setattr(remote_store, "RETRY_S", 0.0)
    monkeypatch.setattr(remote_store, "MAX_KNOWN", 3)
    port = free_port()
    down = RedisServer(port)
    down.stop()  # nothing listens: every write fails
    a, pool = remote_cache(down.url)
    slots, _ = computed(pool, TOKENS)
    a.insert(TOKENS, slots)
    a.drain()
    keys = chunk_keys(a.namespace, TOKENS)
    assert not any(a.remote.known(k) for k in keys)
    up = RedisServer(port)
    try:
        a.insert(TOKENS, slots)
        a.drain()
        assert up.client().exists(*(PREFIX + k for k in keys)) == 4
        assert [a.remote.known(k) for k in keys] == [False, True, True, True]  # 3 remembered
        a.close()
    finally:
        up.stop()


def test_prefetch_pulls_a_waiting_prefix_up_from_redis(redis_server: RedisServer) -> None:
    a, pool_a = remote_cache(redis_server.url)
    slots, ref = computed(pool_a, TOKENS)
    a.insert(TOKENS, slots)
    a.drain()
    pool = make_pool()
    layout = pool_layout(pool)
    host = HostStore(64 * layout.chunk_bytes, layout, None)
    b = HiCache(pool, [host], RemoteStore(redis_server.url, codec(pool)), "test")
    b.prefetch([(TOKENS[:40] + [1], SHARED)])  # waiting: chunks 0, 1 (2 ends past the prompt)
    b.drain()
    assert b.prefetched == 2 and pool.num_free == pool.capacity  # the pool is untouched
    assert b.tier_stats()["remote"].loads == 0  # read ahead by the reader, not by a match
    m = b.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"host": 32, "remote": 32}  # the rest: one MGET at admission
    assert torch.equal(rows_at(pool, m.indices), ref)
    b.check_integrity()
    a.close()
    b.close()


@SEALED
def test_only_sealed_redis_records_hide_the_prompt_and_rows(
    redis_server: RedisServer, sealed: bool
) -> None:
    """Whoever can read Redis: MAC'd records show every 4-token run of each chunk's tokens
    and every row; sealed ones, none. Either way another cache reads them back bit for bit."""
    a, pool_a = remote_cache(redis_server.url, sealed=sealed)
    slots, ref = computed(pool_a, TOKENS)
    a.insert(TOKENS, slots)
    a.drain()
    b, pool_b = remote_cache(redis_server.url, sealed=sealed)
    m = b.match_prefix(TOKENS + [1])
    assert m.tier_tokens == {"remote": 64}
    assert torch.equal(rows_at(pool_b, m.indices), ref)
    client = redis_server.client()
    records = [client.get(PREFIX + k) for k in chunk_keys("test", TOKENS)]
    assert all(r.startswith(SEALED_MAGIC if sealed else MAGIC) for r in records)
    runs, rows = shown(records, TOKENS, ref)
    every = (4 * (CHUNK_TOKENS - 3), ref.numel() // (ref.shape[-2] * ref.shape[-1]))
    assert (runs, rows) == ((0, 0) if sealed else every)
    a.close()
    b.close()


@SEALED
def test_poisoned_remote_records_are_misses(redis_server: RedisServer, sealed: bool) -> None:
    """Whoever can write to Redis overwrites chunk 2 with each kind of poison in turn: each
    is a counted miss (chunks 0 and 1 still load), never an exception nor its rows."""
    a, pool_a = remote_cache(redis_server.url, sealed=sealed)
    slots, ref = computed(pool_a, TOKENS)
    a.insert(TOKENS, slots)
    a.drain()

    key = chunk_keys("test", TOKENS)[2]
    client = redis_server.client()
    data = client.get(PREFIX + key)
    assert data is not None
    for poison in POISONS:
        client.set(PREFIX + key, poisoned_records(data, key, SECRET, sealed)[poison])
        b, pool_b = remote_cache(redis_server.url, sealed=sealed)
        m = b.match_prefix(TOKENS + [1])
        assert m.tier_tokens == {"remote": 32}, poison
        assert torch.equal(rows_at(pool_b, m.indices), ref[:, :, :32]), poison
        assert b.tier_stats()["remote"].faults == 1, poison
        b.close()
    other, _ = remote_cache(redis_server.url, b"not the servers' shared secret", sealed)
    assert other.match_prefix(TOKENS + [1]).tier_tokens == {}  # reads no record of theirs
    assert other.tier_stats()["remote"].faults == 1  # (the leading one refused)
    other.close()
    a.close()


def test_redis_killed_mid_run_degrades_to_recompute(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, pool_a = remote_cache(redis_server.url)
    slots, _ = computed(pool_a, TOKENS)
    a.insert(TOKENS, slots)
    a.drain()
    redis_server.stop()
    monkeypatch.setattr(remote_store, "RETRY_S", 3600.0)  # no retry period ends in this test
    b, pool_b = remote_cache(redis_server.url)
    with caplog.at_level(logging.WARNING, logger="radixserve.kvcache"):
        for _ in range(20):
            m = b.match_prefix(TOKENS + [1])
            assert m.tier_tokens == {} and len(m.indices) == 0
        more, _ = computed(pool_b, list(range(3000, 3032)), seed=3)
        b.insert(list(range(3000, 3032)), more)  # its write-through is dropped, not raised
        b.drain()
    down = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(down) == 1 and "redis://:***@127.0.0.1" in down[0], down
    assert redis_server.password not in caplog.text
    # down: one attempt (one short timeout) per retry period, then reads miss and writes drop
    assert b.tier_stats()["remote"].faults == 1
    b.flush()
    assert pool_b.num_free == pool_b.capacity
    b.check_integrity()
    a.close()
    b.close()


# ---------------------------------------------------------------- which servers share


def engine_on(model: Path, url: str, secret: str) -> Any:
    from radixserve import Engine

    return Engine(
        str(model), dtype="float32", max_total_tokens=256, hicache_remote=url, hicache_secret=secret
    )


def remote_cached(engine: Any, prompt: list[int]) -> int:
    out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0, "max_new_tokens": 4})
    return int(out["meta_info"]["cached_tokens_details"].get("remote", 0))


def test_records_expire_and_the_url_can_come_from_the_environment(
    tiny_model_dir: Path, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$RADIXSERVE_HICACHE_REMOTE names the tier (the URL with its password stays off any
    command line), and every record written there expires, by default a day later."""
    from radixserve import Engine

    monkeypatch.setenv(HICACHE_REMOTE_ENV, redis_server.url)
    engine = Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=256)
    engine.generate(input_ids=list(range(100, 180)), sampling_params={"max_new_tokens": 2})
    client = redis_server.client()
    keys = poll_until(lambda: client.keys(PREFIX + "*"), 60, "a record written through")
    ttls = [client.ttl(k) for k in keys]
    assert all(0 < t <= EngineConfig.hicache_remote_ttl == 86400 for t in ttls), ttls


@pytest.mark.slow  # engines of two models on one Redis: ~8 s
def test_only_servers_of_the_same_model_and_secret_share_kv(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Models in folders of one name (a/model, b/model), one Redis: the other model's server
    reads none of the first one's K/V; a copy of the same model at a third path reads it;
    so does a server of the same model with another secret not."""
    a = build_tiny_model(tmp_path / "a" / "model", seed=0)
    b = build_tiny_model(tmp_path / "b" / "model", seed=1)
    copy = shutil.copytree(a, tmp_path / "c" / "model")
    secret = "the servers' shared tier secret"
    prompt = list(range(500, 600))  # 6 whole chunks
    first = engine_on(a, redis_server.url, secret)
    assert remote_cached(first, prompt) == 0
    first.scheduler.cache.drain()  # the write-through is asynchronous
    first.shutdown()
    for model, key, expected in [(b, secret, 0), (copy, "another secret, sixteen+", 0)]:
        other = engine_on(model, redis_server.url, key)
        assert remote_cached(other, prompt) == expected, (model, key)
        other.shutdown()
    same = engine_on(copy, redis_server.url, secret)
    assert remote_cached(same, prompt) == 96
    same.shutdown()


# ---------------------------------------------------------------- two real servers


def chat(client: httpx.Client, messages: list[dict[str, str]]) -> dict:
    params = {"temperature": 0, "max_new_tokens": 8}
    r = client.post("/generate", json={"text": messages_text(messages), "sampling_params": params})
    assert r.status_code == 200, r.text
    return r.json()


def wait_records(client: Any, count: int, timeout: float = 60) -> None:
    """At least `count` K/V records in Redis: a server's write-through is asynchronous."""
    poll_until(
        lambda: len(client.keys(PREFIX + "*")) >= count,
        timeout,
        lambda: f"{count} records; {len(client.keys(PREFIX + '*'))} in Redis",
    )


def messages_text(messages: list[dict[str, str]]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


@pytest.mark.slow  # two server start-ups: ~30 s
def test_two_servers_share_a_conversation(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    flags = ["--max-total-tokens", "1024", "--hicache-remote", redis_server.url]
    env = {HICACHE_SECRET_ENV: "the servers' shared tier secret"}
    servers = [launch_server(tiny_model_dir, tmp_path, *flags, env=env) for _ in range(2)]
    try:
        history = [{"role": "user", "content": "Tell me about the rivers of Europe. " * 12}]
        with servers[0].client() as c0, servers[1].client() as c1:
            first = chat(c0, history)
            history += [
                {"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "And the longest one?"},
            ]
            # The first prompt's whole chunks, written through by server 0.
            chunks = first["meta_info"]["prompt_tokens"] // CHUNK_TOKENS
            wait_records(redis_server.client(), chunks)
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


def hicache_faults(url: str) -> float:
    metrics = httpx.get(url + "/metrics").text
    line = 'radixserve_hicache_faults_total{tier="remote"}'
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line))


@pytest.mark.slow  # a server start: ~8 s
def test_a_poisoned_shared_record_never_stops_the_server(
    tiny_model_dir: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    """A live server whose Redis records are overwritten with each kind of poison in turn
    (a writer that knows the secret, or not): every request that meets them gets 200 and
    the same greedy output, recomputed; the server stays up; the fault counter moves."""

    secret = "the servers' shared tier secret"
    flags = ["--max-total-tokens", "1024", "--hicache-remote", redis_server.url]
    server = launch_server(tiny_model_dir, tmp_path, *flags, env={HICACHE_SECRET_ENV: secret})
    client = redis_server.client()
    body = {
        "input_ids": list(range(700, 800)),
        "sampling_params": {"temperature": 0, "max_new_tokens": 8},
    }
    try:
        with server.client() as c:
            expected = c.post("/generate", json=body).json()["output_ids"]
            wait_records(client, 6)
            good = {k: client.get(k) for k in client.keys(PREFIX + "*")}
            assert len(good) == 6  # 100 prompt tokens: 6 whole chunks
            for poison in POISONS:
                for k, data in good.items():
                    key = k.decode().removeprefix(PREFIX)
                    client.set(k, poisoned_records(data, key, secret.encode())[poison])
                faults = hicache_faults(server.url)
                assert c.post("/flush_cache").status_code == 200
                r = c.post("/generate", json=body)
                assert r.status_code == 200, (poison, r.text)
                assert r.json()["output_ids"] == expected, poison
                assert r.json()["meta_info"]["cached_tokens"] == 0, poison
                assert hicache_faults(server.url) > faults, poison
            assert c.get("/health").status_code == 200
            info = c.get("/get_server_info").json()
            assert info["hicache_remote"] == f"redis://:***@127.0.0.1:{redis_server.port}/0"
            assert redis_server.password not in json.dumps(info)
    finally:
        assert server.stop() == 0, server.log_text()[-3000:]
    assert redis_server.password not in server.log_text()
