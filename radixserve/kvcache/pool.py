"""Token-granular KV pool and the request-to-token table.

Layout (page size 1):
    k[layer], v[layer] : (num_slots, kv_heads, head_dim)   one row per cached token
    req_to_token       : (max_requests, max_context_len) int64, req_to_token[r, pos] = kv slot

Sliding-window layers (a model's `windows`) keep their K/V apart, in `swa_rows` rows:
`swa_of[slot]` is the sliding layers' row of a token's slot, 0 when the token has none
(never given one, or freed once no query can see it: `free_swa`). A row is handed out with
its token's slot and reused as soon as freed, so these layers need rows for the windows of
the running requests (and what the prefix cache keeps near its ends), not the context:
`swa_rows` may be far below the slots.

Slot 0 is never handed out: it is a scratch row that padded writes may target safely.
The pools only hand out and take back indices; which indices are in use by whom is the
business of the radix cache and the scheduler (`check_integrity` there counts them).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Sequence

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


class FreeSlots:
    """A free list of slots 1 .. num_slots - 1 (slot 0 is scratch).

    Contract: `take(n)` returns `n` distinct free slots or None (never a partial result);
    `give(slots)` returns slots and asserts none was already free.
    """

    def __init__(self, num_slots: int) -> None:
        self.is_free = torch.ones(num_slots, dtype=torch.bool)
        self.is_free[0] = False
        self._flags = self.is_free.numpy()  # is_free itself: numpy indexes a few slots faster
        # A stack of free slots, descending when sorted: pops hand out ascending runs.
        self._stack: list[int] = list(range(num_slots - 1, 0, -1))
        self._sorted = True  # no give() since the stack was last sorted

    def __len__(self) -> int:
        return len(self._stack)

    def take(self, n: int, in_order: bool = True) -> torch.Tensor | None:
        if n > len(self._stack):
            return None
        if in_order and n >= SORTED_ALLOC and not self._sorted:
            self._sort()
        taken = self._stack[len(self._stack) - n :]
        del self._stack[len(self._stack) - n :]
        taken.reverse()  # as n pops
        slots = torch.tensor(taken, dtype=torch.int64)
        self._flags[slots.numpy()] = False
        return slots

    def give(self, slots: torch.Tensor) -> None:
        if slots.numel() == 0:
            return
        given = slots.tolist()
        assert min(given) > 0, "slot 0 is scratch and never allocated"
        index = slots.numpy()
        assert not self._flags[index].any(), "double free of KV slots"
        self._flags[index] = True
        given.reverse()
        self._stack.extend(given)
        self._sorted = False

    def _sort(self) -> None:
        """Free slots in address order again. Freed decode slots of a batch interleave (one
        per sample per step), so without this a long prompt allocated later is scattered
        over the pool, and every decode step then reads its K/V rows at random: at 4096
        tokens the batch-1 attention read 5.9 GB/s scattered against 13.6 contiguous (AVX2
        EPYC). A few ms for 300k slots, paid only by allocations of SORTED_ALLOC+ slots."""
        self._stack = self.is_free.nonzero().flatten().flip(0).tolist()
        self._sorted = True


_Load = tuple[int, torch.Tensor, torch.Tensor, list[torch.Tensor]]  # job, slots, rows, parts


class KVPool:
    """Per-layer K/V storage and a free list of token slots.

    Contract: `alloc(n)` returns `n` distinct free slots or None (never a partial result);
    `free(slots)` returns slots to the free list and asserts none was already free. With
    sliding layers (`windows`, one per layer, 0 for a full layer) each allocated slot gets a
    sliding row too (`swa_of`), and `free` returns both; `free_swa` returns only the sliding
    rows of tokens no query will see again. `k[layer]`/`v[layer]` of a sliding layer are
    indexed by sliding rows: `write` takes the rows of the layer it writes
    (`ForwardBatch.swa_out_cache_loc` for a sliding layer).

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
        windows: Sequence[int] = (),
        swa_rows: int | None = None,
    ) -> None:
        """`windows`: each layer's (0: a full layer); `swa_rows`: how many sliding rows
        (None: one per slot)."""
        assert num_slots >= 2, f"KV pool needs at least 2 slots, got {num_slots}"
        assert not windows or len(windows) == num_layers, f"{len(windows)} windows"
        self.num_slots = num_slots
        self.capacity = num_slots - 1  # slot 0 is scratch
        self.window = max(windows, default=0)  # the widest sliding layer's; 0: none
        self.sliding = [w > 0 for w in windows] or [False] * num_layers
        rows = num_slots if swa_rows is None or not self.window else swa_rows + 1
        assert rows >= 2, f"KV pool needs at least 1 sliding row, got {swa_rows}"
        self.swa_capacity = rows - 1  # row 0 is scratch
        on_cpu = torch.device(device).type == "cpu"
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for sliding in self.sliding:
            shape = (rows if sliding else num_slots, kv_heads, head_dim)
            self.k.append(_zeros(shape, dtype, device, on_cpu))
            self.v.append(_zeros(shape, dtype, device, on_cpu))
        self._slots = FreeSlots(num_slots)
        # the sliding row of each slot (0: none); None without sliding layers
        self.swa_of = torch.zeros(num_slots, dtype=torch.int64) if self.window else None
        self._swa = FreeSlots(rows)
        self._loads_started = 0  # background loads handed to the loader (scheduler thread)
        self._layer_loaded = [0] * num_layers  # per layer: loads that have written it
        self._loaded = threading.Condition()
        self._load_queue: queue.Queue[_Load] | None = None
        self._load_error: BaseException | None = None

    @property
    def num_free(self) -> int:
        return len(self._slots)

    def is_free(self, slots: torch.Tensor) -> torch.Tensor:
        """(n,) bool: which of `slots` are free."""
        return self._slots.is_free[slots]

    def can_alloc(self, n: int) -> bool:
        return n <= min(len(self._slots), self.swa_free)

    def alloc(self, n: int, in_order: bool = True) -> torch.Tensor | None:
        """Take `n` free slots (each with a sliding row), or return None when fewer than `n`
        are free (slots or rows). `in_order=False` skips the sort that an allocation of
        SORTED_ALLOC+ slots starts with: for slots that many samples take one each (a decode
        step's), exactly those n alloc(1) calls take."""
        if not self.can_alloc(n):
            return None
        slots = self._slots.take(n, in_order)
        assert slots is not None
        if self.swa_of is not None:
            rows = self._swa.take(n, in_order)
            assert rows is not None
            self.swa_of[slots] = rows
        return slots

    def free(self, slots: torch.Tensor) -> None:
        self.free_swa(slots)
        self._slots.give(slots)

    # -- sliding rows --------------------------------------------------------------------

    @property
    def swa_free(self) -> int:
        """Sliding rows free (as many as free slots without sliding layers)."""
        return len(self._swa) if self.swa_of is not None else len(self._slots)

    @property
    def swa_used(self) -> int:
        """Sliding rows held (0 without sliding layers)."""
        return 0 if self.swa_of is None else self.swa_capacity - len(self._swa)

    def has_swa(self, slots: torch.Tensor) -> torch.Tensor:
        """(n,) bool: which of `slots` hold their sliding layers' K/V (all, without such
        layers)."""
        if self.swa_of is None:
            return torch.ones(slots.shape, dtype=torch.bool)
        return self.swa_of[slots] > 0

    def free_swa(self, slots: torch.Tensor) -> int:
        """Give back the sliding rows of `slots` (those that have one); returns how many."""
        if self.swa_of is None or slots.numel() == 0:
            return 0
        rows = self.swa_of[slots]
        held = rows[rows > 0]
        self._swa.give(held)
        self.swa_of[slots] = 0
        return held.numel()

    def adopt_swa(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """Where slot dst[i] has no sliding row and src[i] has one, move it over (the same
        token's K/V computed twice: src is about to be freed). Returns the moved mask."""
        if self.swa_of is None:
            return torch.zeros(dst.shape, dtype=torch.bool)
        move = (self.swa_of[dst] == 0) & (self.swa_of[src] > 0)
        self.swa_of[dst[move]] = self.swa_of[src[move]]
        self.swa_of[src[move]] = 0
        return move

    def check_swa(self) -> None:
        """Every sliding row held belongs to exactly one allocated slot."""
        if self.swa_of is None:
            return
        holders = (self.swa_of > 0).nonzero().flatten()
        rows = self.swa_of[holders]
        assert rows.numel() == self.swa_used, f"{rows.numel()} rows held, {self.swa_used} taken"
        assert int(rows.unique().numel()) == rows.numel(), "a sliding row held twice"
        assert not bool(self._swa.is_free[rows].any()), "a held sliding row is free"
        assert not bool(self._slots.is_free[holders].any()), "a free slot holds a sliding row"

    def layer_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """The rows of `layer` that hold the tokens at `slots`."""
        if self.swa_of is not None and self.sliding[layer]:
            return self.swa_of[slots]
        return slots

    # -- writing -------------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows (T, kv_heads, head_dim) of `layer` at its rows `slots` (T,), rounded
        to the pool's dtype when it is narrower (see EngineConfig.kv_cache_dtype); first
        waits until the background loads have written `layer`."""
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
        rows = slots if self.swa_of is None else self.swa_of[slots]  # read now, not later
        if not background:
            self.wait_loads()
            self._load_layers(slots, rows, parts)
            return
        if self._load_queue is None:
            self._load_queue = queue.Queue()
            threading.Thread(target=self._load_loop, name="kv-loader", daemon=True).start()
        self._loads_started += 1
        self._load_queue.put((self._loads_started, slots, rows, parts))

    def _load_layers(
        self, slots: torch.Tensor, rows: torch.Tensor, parts: list[torch.Tensor], job: int = 0
    ) -> None:
        """Write every layer's part (layer 0 first); with a `job`, mark each layer loaded."""
        for layer in range(len(self.k)):
            try:
                at = rows if self.sliding[layer] else slots
                k = torch.cat([p[layer, 0] for p in parts])  # (T, kv_heads, head_dim)
                v = torch.cat([p[layer, 1] for p in parts])
                self._write(layer, at, k, v)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting step
                if not job:
                    raise
                self._load_error = e
            if job:
                with self._loaded:
                    self._layer_loaded[layer] = job
                    self._loaded.notify_all()

    def _load_loop(self) -> None:
        assert self._load_queue is not None
        while True:
            job, slots, rows, parts = self._load_queue.get()
            self._load_layers(slots, rows, parts, job)

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
    """Rows of KV slot indices, one row per running request, and one more: the table's last
    row is never handed out and stays all slot 0, the pool's scratch slot (the padding rows
    of a decode step read it: worker/buckets.py).

    Contract: `alloc()` returns a free row index or None; rows are reused after `free(row)`.
    """

    def __init__(self, max_requests: int, max_context_len: int) -> None:
        self.table = torch.zeros((max_requests + 1, max_context_len), dtype=torch.int64)
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
