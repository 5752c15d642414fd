"""The tensors one model step needs, built by the scheduler and read by the model worker.

Region table for request r of a batch (lengths in tokens, positions 0-based):

    |<------------------------- seq_lens[r] ------------------------->|
    |<------------- prefix_lens[r] ------------->|<- extend_lens[r] ->|
    |<-- path: sum of path[r] lengths --->|      |   new tokens: their K/V are written
    |   (radix nodes, or prompt modules)  |      |   this step at out_cache_loc, and they
    |                                     |      |   are the queries of this step
    kv_indices[r] holds the KV slot of every position 0 .. seq_lens[r]-1, and with a pool
    whose sliding-window layers keep rows of their own, swa_kv_indices[r] their rows (0 for
    positions no query of the step can see: kvcache/pool.py).

Decode is the case extend_lens[r] == 1 for every r. A decode step of the same requests as
the step before, each one token further and on the same paths, names that batch in
`follows`: a backend may then update the earlier step's plan instead of building one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, overload

import torch


class KVStore(Protocol):
    """The per-layer K/V storage a step reads and writes (radixserve.kvcache.pool.KVPool).

    k[layer], v[layer]: (num_slots, kv_heads, head_dim); `write` stores one layer's new K/V
    (each (T, kv_heads, head_dim)) at `slots` (T,) int64, after waiting for rows still
    being loaded into that layer: a backend reads a layer's rows only after its `write`.
    `swa_of`: the sliding layers' row of each slot, or None when they use the slots.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    swa_of: torch.Tensor | None

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (T,) int64, new tokens of all requests, request-major
    positions: torch.Tensor  # (T,) int64, absolute position of each new token
    out_cache_loc: torch.Tensor  # (T,) int64, KV slot each new token's K/V goes to
    seq_lens: list[int]  # per request: cached + new tokens
    extend_lens: list[int]  # per request: new tokens (queries) this step, >= 1
    kv_indices: Sequence[torch.Tensor]  # per request: (seq_lens[r],) int64 KV slots
    # Per request: the path nodes covering the start of its sequence, as (node_id,
    # num_tokens): its radix nodes, root first, or its prompt modules (negative ids). A
    # node_id names one run of KV slots: requests listing it share them (at any offset).
    paths: list[list[tuple[int, int]]]
    kv_pool: KVStore
    # Backend-specific per-step plan, set by AttentionBackend.plan() and read by every layer.
    attn_plan: object = field(default=None, repr=False)
    # Sliding-window layers' plans by window, made by their first layer in the step
    # (attention/window.py) and read by the others.
    window_plans: dict[int, object] = field(default_factory=dict, repr=False)
    # Per request: the sliding layers' rows (kv_pool.swa_of of kv_indices), or None when
    # those layers use the slots; and the new tokens' rows, request-major.
    swa_kv_indices: list[torch.Tensor] | None = None
    swa_out_cache_loc: torch.Tensor | None = field(init=False, default=None)
    # The step before, when this one is its decode continued (module docstring).
    follows: ForwardBatch | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        n = len(self.seq_lens)
        assert len(self.extend_lens) == n == len(self.kv_indices) == len(self.paths), (
            f"per-request lists disagree: {n=}, extend={len(self.extend_lens)}, "
            f"kv={len(self.kv_indices)}, paths={len(self.paths)}"
        )
        assert sum(self.extend_lens) == self.input_ids.numel() == self.out_cache_loc.numel()
        if self.swa_kv_indices is not None:
            assert len(self.swa_kv_indices) == n, f"{len(self.swa_kv_indices)} sliding rows"
            rows = new_slots(self.swa_kv_indices, self.extend_lens)
            self.swa_out_cache_loc = rows.to(self.out_cache_loc.device, non_blocking=True)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens)

    @property
    def prefix_lens(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens)]

    @property
    def sliding_out_loc(self) -> torch.Tensor:
        """Where a sliding layer writes the new tokens' K/V: their sliding rows, else slots."""
        return self.out_cache_loc if self.swa_out_cache_loc is None else self.swa_out_cache_loc

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens)


class BatchBuilder:
    """A ForwardBatch put together one request entry at a time."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.positions: list[int] = []
        self.seq_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.kv_indices: list[torch.Tensor] = []
        self.paths: list[list[tuple[int, int]]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def add(
        self,
        ids: list[int],
        positions: list[int],
        slots: torch.Tensor,
        path: list[tuple[int, int]],
    ) -> None:
        """An entry whose new tokens `ids` sit at `positions`; `slots`: the KV slot of each
        position of its sequence, the new tokens' last."""
        self.ids += ids
        self.positions += positions
        self.seq_lens.append(len(slots))
        self.extend_lens.append(len(ids))
        self.kv_indices.append(slots)
        self.paths.append(path)

    def build(self, pool: KVStore) -> ForwardBatch:
        swa_of = pool.swa_of
        return ForwardBatch(
            input_ids=torch.tensor(self.ids, dtype=torch.int64),
            positions=torch.tensor(self.positions, dtype=torch.int64),
            out_cache_loc=new_slots(self.kv_indices, self.extend_lens),
            seq_lens=self.seq_lens,
            extend_lens=self.extend_lens,
            kv_indices=self.kv_indices,
            paths=self.paths,
            kv_pool=pool,
            swa_kv_indices=None if swa_of is None else [swa_of[s] for s in self.kv_indices],
        )


class TableRows(Sequence[torch.Tensor]):
    """Request r's KV slots as the view table[rows[r], :lens[r]] of the request-to-token
    table, made when first read: a step that reads no request's slots makes none."""

    def __init__(
        self,
        table: torch.Tensor,
        rows: list[int],
        lens: list[int],
        rows_tensor: torch.Tensor | None = None,  # rows as (B,) int64, when at hand
    ) -> None:
        assert len(rows) == len(lens), f"{len(rows)} rows, {len(lens)} lengths"
        self.table, self.rows, self.lens = table, rows, lens
        self._rows_t = rows_tensor
        self._views: list[torch.Tensor] | None = None

    @property
    def rows_tensor(self) -> torch.Tensor:
        if self._rows_t is None:
            self._rows_t = torch.tensor(self.rows, dtype=torch.int64)
        return self._rows_t

    def _all(self) -> list[torch.Tensor]:
        if self._views is None:
            t = self.table
            self._views = [t[r, :n] for r, n in zip(self.rows, self.lens, strict=True)]
        return self._views

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...
    def __getitem__(self, i: int | slice) -> torch.Tensor | list[torch.Tensor]:
        return self._all()[i]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._all())


def new_slots(kv_indices: Sequence[torch.Tensor], extend_lens: list[int]) -> torch.Tensor:
    """The last extend_lens[r] entries of each kv_indices[r], concatenated: the new tokens'."""
    if not kv_indices:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([s[len(s) - n :] for s, n in zip(kv_indices, extend_lens, strict=True)])


def cat_slots(kv_indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """Every request's slots, concatenated in request order."""
    return torch.cat(list(kv_indices)) if kv_indices else torch.zeros(0, dtype=torch.int64)
