"""Token-granular KV pool and the request-to-token table.

Layout (page size 1):
    k[layer], v[layer] : (num_slots, kv_heads, head_dim)   one row per cached token
    req_to_token       : (max_requests, max_context_len) int64, req_to_token[r, pos] = kv slot

Slot 0 is never handed out: it is a scratch row that padded writes may target safely.
The pools only hand out and take back indices; which indices are in use by whom is the
business of the radix cache and the scheduler (`check_integrity` there counts them).
"""

from __future__ import annotations

import math
import queue
import threading

import numpy as np
import torch

SORTED_ALLOC = 256  # allocations this large (prompt chunks) first put free slots in order


def _zeros(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, on_cpu: bool
) -> torch.Tensor:
    """Zeros. On a CPU from calloc (numpy's zeros): a large pool's pages come from the OS
    zeroed as slots are first written, not all at start, so an idle server holds only what it
    used; torch.zeros would write every byte up front."""
    if not on_cpu:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVPool:
    """Per-layer K/V storage and a free list of token slots.

    Contract: `alloc(n)` returns `n` distinct free slots or None (never a partial result);
    `free(slots)` returns slots to the free list and asserts none was already free.

    Layer-wise loading (`load(..., background=True)`): rows from a lower KV tier are written
    by a loader thread, layer 0 first, while the step computes; `write(layer, ...)` (each
    attention backend's first touch of a layer in a step) waits only until every load so
    far has written that layer, and `wait_loads()` until they are all done (before reading
    rows anywhere else). Loads run in order, so "layer l written by load j" means written
    by every load before j too.
    """

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        assert num_slots >= 2, f"KV pool needs at least 2 slots, got {num_slots}"
        self.num_slots = num_slots
        self.capacity = num_slots - 1  # slot 0 is scratch
        shape = (num_slots, kv_heads, head_dim)
        on_cpu = torch.device(device).type == "cpu"
        self.k = [_zeros(shape, dtype, device, on_cpu) for _ in range(num_layers)]
        self.v = [_zeros(shape, dtype, device, on_cpu) for _ in range(num_layers)]
        self._is_free = torch.ones(num_slots, dtype=torch.bool)
        self._is_free[0] = False
        # A stack of free slots, descending when sorted: pops hand out ascending runs.
        self._free: list[int] = list(range(num_slots - 1, 0, -1))
        self._sorted = True  # no free() since the stack was last sorted
        self._loads_started = 0  # background loads handed to the loader (scheduler thread)
        self._layer_loaded = [0] * num_layers  # per layer: loads that have written it
        self._loaded = threading.Condition()
        self._load_queue: queue.Queue[tuple[int, torch.Tensor, list[torch.Tensor]]] | None = None
        self._load_error: BaseException | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int, in_order: bool = True) -> torch.Tensor | None:
        """Take `n` free slots, or return None when fewer than `n` are free. `in_order=False`
        skips the sort that an allocation of SORTED_ALLOC+ slots starts with: for slots that
        many samples take one each (a decode step's), exactly those n alloc(1) calls take."""
        if n > len(self._free):
            return None
        if in_order and n >= SORTED_ALLOC and not self._sorted:
            self._sort_free()
        taken = [self._free.pop() for _ in range(n)]
        slots = torch.tensor(taken, dtype=torch.int64)
        self._is_free[slots] = False
        return slots

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        assert not bool(self._is_free[slots].any()), "double free of KV slots"
        assert int(slots.min()) > 0, "slot 0 is scratch and never allocated"
        self._is_free[slots] = True
        self._free.extend(slots.flip(0).tolist())
        self._sorted = False

    def _sort_free(self) -> None:
        """Free slots in address order again. Freed decode slots of a batch interleave (one
        per sample per step), so without this a long prompt allocated later is scattered
        over the pool, and every decode step then reads its K/V rows at random: at 4096
        tokens the batch-1 attention read 5.9 GB/s scattered against 13.6 contiguous (AVX2
        EPYC). A few ms for 300k slots, paid only by allocations of SORTED_ALLOC+ slots."""
        self._free = self._is_free.nonzero().flatten().flip(0).tolist()
        self._sorted = True

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows (T, kv_heads, head_dim) of `layer` at `slots` (T,), rounded to the
        pool's dtype when it is narrower (see EngineConfig.kv_cache_dtype); first waits
        until the background loads have written `layer`."""
        self._wait_layer(layer)
        self._write(layer, slots, k, v)

    def _write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(0, slots, k.to(kc.dtype))  # ~2x faster than kc[slots] = k
        vc.index_copy_(0, slots, v.to(vc.dtype))

    # -- loading rows from a lower tier ----------------------------------------------------

    def load(self, slots: torch.Tensor, parts: list[torch.Tensor], background: bool) -> None:
        """Store rows of every layer at `slots` (T,): `parts` are (layers, 2, n_i, kv_heads,
        head_dim) tensors whose concatenation along dim 2 has T rows. In the background:
        returns at once and the loader thread writes them layer by layer (see the class
        docstring); else written here, all layers, before returning."""
        if not background:
            self.wait_loads()
            for layer in range(len(self.k)):
                self._write(layer, slots, *self._rows(parts, layer))
            return
        if self._load_queue is None:
            self._load_queue = queue.Queue()
            threading.Thread(target=self._load_loop, name="kv-loader", daemon=True).start()
        self._loads_started += 1
        self._load_queue.put((self._loads_started, slots, parts))

    @staticmethod
    def _rows(parts: list[torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([p[layer, 0] for p in parts])  # (T, kv_heads, head_dim)
        v = torch.cat([p[layer, 1] for p in parts])
        return k, v

    def _load_loop(self) -> None:
        assert self._load_queue is not None
        while True:
            job, slots, parts = self._load_queue.get()
            for layer in range(len(self.k)):
                try:
                    self._write(layer, slots, *self._rows(parts, layer))
                except BaseException as e:  # noqa: BLE001 - handed to the waiting step
                    self._load_error = e
                with self._loaded:
                    self._layer_loaded[layer] = job
                    self._loaded.notify_all()

    def _wait_layer(self, layer: int) -> None:
        if self._layer_loaded[layer] < self._loads_started:  # int reads: no lock needed
            with self._loaded:
                started = self._loads_started
                self._loaded.wait_for(lambda: self._layer_loaded[layer] >= started)
        if self._load_error is not None:
            raise RuntimeError("loading K/V rows from a lower tier failed") from self._load_error

    def wait_loads(self) -> None:
        """Wait until every background load has written every layer."""
        self._wait_layer(len(self.k) - 1)  # loads write layers in order: the last is last

    def bytes_per_token(self) -> int:
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[2] * k.element_size()


class ReqToTokenPool:
    """Rows of KV slot indices, one row per running request.

    Contract: `alloc()` returns a free row index or None; rows are reused after `free(row)`.
    """

    def __init__(self, max_requests: int, max_context_len: int) -> None:
        self.table = torch.zeros((max_requests, max_context_len), dtype=torch.int64)
        self._free = list(range(max_requests - 1, -1, -1))
        self.max_requests = max_requests

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        assert row not in self._free, f"double free of req_to_token row {row}"
        self._free.append(row)
