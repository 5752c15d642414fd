"""L3: chunks as checksummed files in a local directory, written by a background thread.

One file per chunk, `<dir>/<key>.kv`, in the codec of tier_store.py (magic, MAC, header,
token ids, tensor bytes; sealed under --hicache-encrypt): files are untrusted (another
local process may write them), a file the codec refuses is a miss and is deleted. Written
to a temporary name and renamed, so a reader never sees half a file from this writer. Files
already in the directory at start-up are indexed, so a restarted server finds its cache
again.

Threads: `put` (scheduler thread) queues the chunk and returns; the writer thread writes it.
Until written, a queued chunk is served from memory. The index and the queue are shared
under one lock; a write that fails (disk full, directory gone) drops that chunk, counts a
fault and logs once: the tier degrades, the server goes on. Over `budget_bytes` the least
recently used files are deleted; with `ttl_s`, so are files unused for that long (a file
found at start-up counts as used at its mtime).
"""

from __future__ import annotations

import logging
import os
import queue
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from radixserve.core.info import TierStats
from radixserve.kvcache.tier_store import (
    ChunkCodec,
    ChunkError,
    drain,
)

logger = logging.getLogger("radixserve.kvcache")

MAX_PENDING = 256  # chunks queued for the writer; beyond, new chunks are dropped


class DiskStore:
    name = "disk"

    def __init__(
        self,
        directory: str,
        budget_bytes: int,
        codec: ChunkCodec,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,  # wall time: file mtimes outlive the process
    ) -> None:
        self.dir = private_dir(Path(directory))
        self.budget = budget_bytes
        self.codec = codec
        self.ttl_s = ttl_s
        self.clock = clock
        self.counters = TierStats()
        self._lock = threading.Lock()
        # key -> (file size, when last used), least recently used first
        self._files: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._pending: dict[str, tuple[list[int], torch.Tensor]] = {}
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._warned: set[str] = set()
        for path in sorted(self.dir.glob("*.kv"), key=lambda p: p.stat().st_mtime):
            stat = path.stat()
            self._files[path.stem] = (stat.st_size, stat.st_mtime)
        self._writer = threading.Thread(target=self._write_loop, name="hicache-disk", daemon=True)
        self._writer.start()

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.kv"

    def contains(self, key: str) -> bool:
        self._expire()
        with self._lock:
            return key in self._pending or key in self._files

    def get(self, key: str, tokens: Sequence[int]) -> torch.Tensor | None:
        self._expire()
        with self._lock:
            pending = self._pending.get(key)
            on_disk = key in self._files
            if on_disk:
                self._files[key] = (self._files[key][0], self.clock())
                self._files.move_to_end(key)
        if pending is not None:
            return pending[1]
        if not on_disk:
            return None
        try:
            data = _read_at_most(self._path(key), self.codec.max_record_bytes)
            return self.codec.decode(key, data, tokens)
        except (OSError, ChunkError) as e:
            self._fault("read", f"{self._path(key)}: {e}")
            self._forget(key)
            return None

    def put(self, key: str, tokens: Sequence[int], chunk: torch.Tensor) -> None:
        with self._lock:
            if key in self._pending or key in self._files:
                return
            if len(self._pending) >= MAX_PENDING:
                self.counters.faults += 1
                return
            self._pending[key] = (list(tokens), chunk)
        self._queue.put(key)

    def _write_loop(self) -> None:
        while (key := self._queue.get()) is not None:
            with self._lock:
                entry = self._pending.get(key)
            if entry is not None:
                self._write(key, *entry)
            self._queue.task_done()
        self._queue.task_done()

    def _write(self, key: str, tokens: list[int], chunk: torch.Tensor) -> None:
        data = self.codec.encode(key, tokens, chunk)
        path, tmp = self._path(key), None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".", suffix=".tmp")  # mode 0600
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            self._fault("write", f"{path}: {e}")
            with self._lock:
                self._pending.pop(key, None)
            return
        with self._lock:
            self._pending.pop(key, None)
            self._files[key] = (len(data), self.clock())
            over = sum(size for size, _ in self._files.values()) - self.budget
            doomed = []
            while over > 0 and self._files:
                old, (size, _) = self._files.popitem(last=False)
                doomed.append(old)
                over -= size
        for old in doomed:
            self._path(old).unlink(missing_ok=True)

    def _expire(self) -> None:
        """Delete files unused for ttl_s: the least recently used, at the front."""
        if self.ttl_s is None:
            return
        cutoff = self.clock() - self.ttl_s
        doomed = []
        with self._lock:
            while self._files and next(iter(self._files.values()))[1] <= cutoff:
                doomed.append(self._files.popitem(last=False)[0])
        for key in doomed:
            self._path(key).unlink(missing_ok=True)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._files.pop(key, None)
        self._path(key).unlink(missing_ok=True)

    def _fault(self, kind: str, message: str) -> None:
        self.counters.faults += 1
        if kind not in self._warned:  # once per kind: a full disk must not flood the log
            self._warned.add(kind)
            logger.warning(
                "hicache disk %s failed (those chunks will be recomputed): %s", kind, message
            )

    @property
    def stored_bytes(self) -> int:
        with self._lock:
            return sum(size for size, _ in self._files.values())

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued chunk is written or dropped (tests, shutdown)."""
        drain(self._queue, timeout_s)

    def clear(self) -> None:
        self.drain()
        with self._lock:
            keys = list(self._files)
            self._files.clear()
        for key in keys:
            self._path(key).unlink(missing_ok=True)

    def close(self) -> None:
        self.drain()
        self._queue.put(None)
        self._writer.join(timeout=5)


def private_dir(path: Path) -> Path:
    """`path` as a folder only this user can enter (0700), made if missing. ValueError if
    another user owns it: whoever owns the folder can swap the files under us."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise ValueError(f"hicache_dir {path} belongs to uid {st.st_uid}, not this user")
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


def _read_at_most(path: Path, limit: int) -> bytes:
    """The file's bytes; ChunkError, unread, if it is longer than `limit`."""
    with path.open("rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ChunkError(f"file longer than a record's {limit} bytes")
    return data
