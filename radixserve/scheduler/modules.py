"""Registered prompt-module schemas: each module's K/V, encoded once and pinned in the pool.

Encoding (`encode`): every module is prefilled as its own sequence at its schema positions
(module-local attention: a module's tokens attend only to its own earlier tokens), in
batches of at most `max_prefill_tokens` new tokens, chunks of `chunked_prefill_size`.

Ownership: a registered module's slots belong to this store until the schema is removed; no
request owns them and the prefix cache never sees them, so they are neither evicted nor
freed by a request (KVManager counts `num_slots` as in use elsewhere). A request importing
modules lists their slots first in its kv_indices (see core/modules.py).

Tree attention: each registered module is a path node with an id of its own (negative:
radix node ids are >= 0), listed by every request importing it wherever it sits in that
request's imports; the tree backend attends a module shared by several requests of a step
once for all of them (attention/tree.py, plan step 1).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from radixserve.core.batch import ForwardBatch
from radixserve.core.modules import CompiledSchema, ModuleTokens, ModuleUse
from radixserve.core.request import TokenizedRequest
from radixserve.kvcache.pool import KVPool
from radixserve.scheduler.parts import StepWorker


@dataclass
class _Schema:
    compiled: CompiledSchema
    slots: dict[str, torch.Tensor]  # module name -> (its tokens,) int64 slots


class ModuleStore:
    def __init__(self) -> None:
        self.schemas: dict[str, _Schema] = {}
        self._node_ids: dict[tuple[str, str], int] = {}  # (schema, module) -> path node id
        self._next_id = itertools.count(-1, -1)

    @property
    def num_slots(self) -> int:
        return sum(s.numel() for e in self.schemas.values() for s in e.slots.values())

    def add(self, compiled: CompiledSchema, slots: dict[str, torch.Tensor]) -> None:
        assert compiled.name not in self.schemas, f"schema {compiled.name!r} is registered"
        self.schemas[compiled.name] = _Schema(compiled, slots)

    def remove(self, name: str) -> torch.Tensor:
        """Forget schema `name`; returns its slots for the caller to free."""
        entry = self.schemas.pop(name)
        self._node_ids = {k: v for k, v in self._node_ids.items() if k[0] != name}
        return torch.cat([torch.empty(0, dtype=torch.int64), *entry.slots.values()])

    def check(self, request: TokenizedRequest) -> None:
        """ValueError unless `request.modules` names registered modules whose tokens open its
        input_ids, with one ascending position per own token."""
        use = request.modules
        assert use is not None
        entry = self.schemas.get(use.schema)
        if entry is None:
            raise ValueError(f"schema: no schema {use.schema!r} is registered")
        known = {m.name: m for m in entry.compiled.modules if m.token_ids}
        missing = [m for m in use.modules if m not in known]
        if missing:
            raise ValueError(f"schema {use.schema!r} has no module {missing[0]!r}")
        head = [t for m in use.modules for t in known[m].token_ids]
        own = len(request.input_ids) - len(head)
        if request.input_ids[: len(head)] != head or own != len(use.positions) or own < 1:
            raise ValueError(
                f"input_ids: not the tokens of schema {use.schema!r}'s modules followed by "
                "one token per position"
            )
        pos = use.positions
        if pos[0] < 0 or any(b <= a for a, b in zip(pos, pos[1:])):
            raise ValueError("positions: must be >= 0 and ascending")

    def in_use(self, name: str, requests: list[TokenizedRequest]) -> int:
        return sum(r.modules is not None and r.modules.schema == name for r in requests)

    def slots(self, use: ModuleUse) -> torch.Tensor:
        """The imported modules' slots, in `use.modules` order (the store keeps them)."""
        entry = self.schemas[use.schema]
        return torch.cat(
            [torch.empty(0, dtype=torch.int64)] + [entry.slots[m] for m in use.modules]
        )

    def path(self, use: ModuleUse) -> list[tuple[int, int]]:
        """(node id, tokens) per imported module: one id per module of a registered schema."""
        entry = self.schemas[use.schema]
        return [
            (
                self._node_ids.setdefault((use.schema, m), next(self._next_id)),
                entry.slots[m].numel(),
            )
            for m in use.modules
        ]


def encode(
    worker: StepWorker,
    pool: KVPool,
    modules: list[ModuleTokens],
    chunk: int,
    budget: int,
) -> dict[str, torch.Tensor]:
    """Allocate slots for each module's tokens (the caller reserved them) and compute their
    K/V at the modules' positions, each module on its own. Returns name -> slots."""
    todo = [m for m in modules if m.token_ids]
    slots = {}
    for m in todo:
        got = pool.alloc(len(m.token_ids))
        assert got is not None, f"module {m.name!r}: no slots reserved"
        slots[m.name] = got
    done = dict.fromkeys(slots, 0)
    while any(done[m.name] < len(m.token_ids) for m in todo):
        step, left = [], budget
        for m in todo:
            n = min(len(m.token_ids) - done[m.name], chunk, left)
            if n > 0:
                step.append((m, done[m.name], n))
                left -= n
        worker.forward(*_batch(step, slots, pool))
        for m, start, n in step:
            done[m.name] = start + n
    return slots


def _batch(
    step: list[tuple[ModuleTokens, int, int]], slots: dict[str, torch.Tensor], pool: KVPool
) -> tuple[ForwardBatch, torch.Tensor]:
    """One extend of tokens [start, start + n) of each module, and the rows of its last
    tokens (the logits are not used, but the worker computes some)."""
    ids, pos, kv = [], [], []
    for m, start, n in step:
        ids += m.token_ids[start : start + n]
        pos += m.positions[start : start + n]
        kv.append(slots[m.name][: start + n])
    batch = ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.tensor(pos, dtype=torch.int64),
        out_cache_loc=torch.cat([s[start : start + n] for s, (_, start, n) in zip(kv, step)]),
        seq_lens=[start + n for _, start, n in step],
        extend_lens=[n for _, _, n in step],
        kv_indices=kv,
        paths=[[] for _ in step],
        kv_pool=pool,
    )
    return batch, batch.last_token_rows()
