"""Token-granular KV pool and the request-to-token table.

Layout (page size 1):
    k[layer], v[layer] : (num_slots, kv_heads, head_dim)   one row per cached token
    req_to_token       : (max_requests, max_context_len) int64, req_to_token[r, pos] = kv slot

Slot 0 is never handed out: it is a scratch row that padded writes may target safely.
The pools only hand out and take back indices; which indices are in use by whom is the
business of the radix cache and the scheduler (`check_integrity` there counts them).
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K/V storage and a free list of token slots.

    Contract: `alloc(n)` returns `n` distinct free slots or None (never a partial result);
    `free(slots)` returns slots to the free list and asserts none was already free.
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
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._is_free = torch.ones(num_slots, dtype=torch.bool)
        self._is_free[0] = False
        # Free slots kept sorted-ish: a fresh pool hands out contiguous ranges.
        self._free: list[int] = list(range(num_slots - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` free slots, or return None when fewer than `n` are free."""
        if n > len(self._free):
            return None
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

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V rows (T, kv_heads, head_dim) of `layer` at `slots` (T,), rounded to the
        pool's dtype when it is narrower (see EngineConfig.kv_cache_dtype)."""
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(0, slots, k.to(kc.dtype))  # ~2x faster than kc[slots] = k
        vc.index_copy_(0, slots, v.to(vc.dtype))

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
