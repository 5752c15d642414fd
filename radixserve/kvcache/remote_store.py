"""L4: chunks in a shared Redis / Valkey server, so several radixserve servers (and a
restarted one) reuse each other's K/V.

Values are the MAC'd (or sealed) records of tier_store.py under `radixserve:kv:<key>`; the
key already names the model exactly (the namespace) and the whole prefix, so servers of the
same model and secret share chunks and servers of different models never collide. Whoever
can write to Redis is untrusted: records are data, never code, and a damaged, planted or
foreign record is refused by the codec and counts as a miss.

Threads: `put` queues and returns; a writer thread SETs. Reads are synchronous with a short
socket timeout. Any Redis error (refused, reset, timeout) marks the tier down for
`RETRY_S` seconds: reads miss and writes are dropped meanwhile, one warning when it goes
down and one line when it is back. The server never waits on a dead Redis for longer than
one timeout per `RETRY_S`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from radixserve.core.info import TierStats
from radixserve.kvcache.tier_store import (
    ChunkCodec,
    ChunkError,
    drain,
)
from radixserve.redact import redact

logger = logging.getLogger("radixserve.kvcache")

PREFIX = "radixserve:kv:"
TIMEOUT_S = 0.5
RETRY_S = 2.0
MAX_PENDING = 256
MAX_KNOWN = 1 << 18  # keys remembered as already in Redis (least recently seen forgotten)


class RemoteStore:
    name = "remote"

    def __init__(self, url: str, codec: ChunkCodec, ttl_s: int | None = None) -> None:
        import redis  # optional dependency: only a server with --hicache-remote needs it

        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self.url = redact(url)  # for logs: never the password
        self.codec = codec
        self.ttl_s = ttl_s
        self.counters = TierStats()
        self._written_bytes = 0
        self._known: OrderedDict[str, None] = OrderedDict()  # written or read here: in Redis
        self._down_until = 0.0  # monotonic time before which the tier counts as down
        self._down = False
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[str, list[int], torch.Tensor] | None] = queue.Queue(
            MAX_PENDING
        )
        self._writer = threading.Thread(target=self._write_loop, name="hicache-redis", daemon=True)
        self._writer.start()

    # -- health ------------------------------------------------------------------------

    def _up(self) -> bool:
        with self._lock:
            return time.monotonic() >= self._down_until

    def _failed(self, e: BaseException) -> None:
        with self._lock:
            self.counters.faults += 1
            self._down_until = time.monotonic() + RETRY_S
            first = not self._down
            self._down = True
        if first:
            logger.warning(
                "hicache remote tier %s unreachable, using the other tiers: %s", self.url, e
            )

    def _ok(self) -> None:
        with self._lock:
            was_down, self._down = self._down, False
        if was_down:
            logger.info("hicache remote tier %s is back", self.url)

    # -- reads -------------------------------------------------------------------------

    def get_many(self, keys: Sequence[str], tokens: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The leading run of `keys` that Redis holds, decoded (a refused record ends it)."""
        if not keys or not self._up():
            return []
        try:
            values = self._client.mget([PREFIX + k for k in keys])
        except self._errors as e:
            self._failed(e)
            return []
        self._ok()
        chunks = []
        for key, toks, data in zip(keys, tokens, values):
            if data is None:
                break
            try:
                chunks.append(self.codec.decode(key, data, toks))
            except ChunkError as e:
                with self._lock:
                    self.counters.faults += 1
                logger.warning("hicache remote chunk %s refused: %s", key, e)
                break
            self._remember(key)
        return chunks

    def known(self, key: str) -> bool:
        """Whether this server wrote `key` or read it back intact (then a write is moot)."""
        with self._lock:
            return key in self._known

    def _remember(self, key: str) -> None:
        with self._lock:
            self._known[key] = None
            self._known.move_to_end(key)
            while len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)

    def get(self, key: str, tokens: Sequence[int]) -> torch.Tensor | None:
        found = self.get_many([key], [tokens])
        return found[0] if found else None

    def contains(self, key: str) -> bool:
        if not self._up():
            return False
        try:
            return bool(self._client.exists(PREFIX + key))
        except self._errors as e:
            self._failed(e)
            return False

    # -- writes ------------------------------------------------------------------------

    def put(self, key: str, tokens: Sequence[int], chunk: torch.Tensor) -> None:
        if not self._up() or self.known(key):
            return
        try:
            self._queue.put_nowait((key, list(tokens), chunk))
        except queue.Full:
            with self._lock:
                self.counters.faults += 1

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            key, tokens, chunk = item
            if self._up():
                data = self.codec.encode(key, tokens, chunk)
                try:
                    self._client.set(PREFIX + key, data, ex=self.ttl_s)
                    with self._lock:
                        self._written_bytes += len(data)
                    self._remember(key)  # only now: a failed write is tried again later
                    self._ok()
                except self._errors as e:
                    self._failed(e)
            self._queue.task_done()
        self._queue.task_done()

    @property
    def stored_bytes(self) -> int:
        """Bytes this server wrote (the shared server's total is other servers' too)."""
        with self._lock:
            return self._written_bytes

    def drain(self, timeout_s: float = 30.0) -> None:
        drain(self._queue, timeout_s)

    def clear(self) -> None:
        """The shared tier is not this server's to clear: other servers read it."""
        self.drain()

    def close(self) -> None:
        self.drain()
        self._queue.put(None)
        self._writer.join(timeout=5)
        self._client.close()
