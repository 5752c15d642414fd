"""Registered prompt-module schemas: each module's K/V, encoded once and pinned in the pool.

Encoding is incremental: `begin` takes a schema with its slots allocated, and each
scheduler step computes `next_chunks` of it (every module prefilled as its own sequence at
its schema positions: module-local attention, a module's tokens attend only to its own
earlier tokens) beside the step's other work, like one more request prefilling a chunk: at
most `chunked_prefill_size` tokens a step, within the step's `max_prefill_tokens`, the rest
of which still admits new requests; `encoded` records them. Running
requests keep decoding meanwhile. Once every module is computed the schema is usable and
its `SchemaDone` callback hears None; one removed before that hears why it never will be.
Schemas are encoded one at a time, oldest first; a request may not import one still being
encoded (`check` says so).

Ownership: a schema's slots belong to this store from `begin` until it is removed; no
request owns them and the prefix cache never sees them, so they are neither evicted nor
freed by a request (KVManager counts `num_slots` as in use elsewhere). A request importing
modules lists their slots first in its kv_indices (see core/modules.py).

Registration (`register`, `unregister`, `describe`): the checks a new schema must pass
(name free, fits the context, MAX_SCHEMAS, at most MAX_SCHEMA_SHARE of the pool pinned,
slots obtainable now), its slots taken from the pool (evicting unlocked cache entries for
room) and handed to `begin`; removal refused while a queued or running request imports it.

Tree attention: each registered module is a path node with an id of its own (negative:
radix node ids are >= 0), listed by every request importing it wherever it sits in that
request's imports; the tree backend attends a module shared by several requests of a step
once for all of them (attention/tree_plan.py, plan step 1).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from radixserve.core.limits import MAX_SCHEMA_SHARE, MAX_SCHEMAS
from radixserve.core.modules import CompiledSchema, ModuleTokens, ModuleUse
from radixserve.core.request import TokenizedRequest
from radixserve.kvcache.pool import KVPool

logger = logging.getLogger("radixserve.scheduler")

# Called once per registration: None when the schema is encoded and usable, else the reason
# it never will be (it was removed while being encoded).
SchemaDone = Callable[[str | None], None]


class SlotSource(Protocol):
    """What registering a schema needs of the KV side (scheduler/kv.py's KVManager)."""

    pool: KVPool

    @property
    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        ...

    def reserve(self, n: int) -> bool:
        """Make `n` slots free, evicting unlocked cache entries; False if impossible."""
        ...


@dataclass
class _Schema:
    compiled: CompiledSchema
    slots: dict[str, torch.Tensor]  # module name -> (its tokens,) int64 slots
    # While being encoded: tokens computed per module, and who waits for the end.
    encoded: dict[str, int] = field(default_factory=dict)
    on_done: SchemaDone | None = None


@dataclass(frozen=True)
class EncodeChunk:
    """Tokens [start, start + n) of one module of a schema being encoded."""

    schema: str
    module: ModuleTokens
    start: int
    n: int


class ModuleStore:
    def __init__(self) -> None:
        self.schemas: dict[str, _Schema] = {}  # encoded: requests may import them
        self.encoding: dict[str, _Schema] = {}  # being encoded, oldest first
        self._node_ids: dict[tuple[str, str], int] = {}  # (schema, module) -> path node id
        self._next_id = itertools.count(-1, -1)

    @property
    def num_slots(self) -> int:
        entries = itertools.chain(self.schemas.values(), self.encoding.values())
        return sum(s.numel() for e in entries for s in e.slots.values())

    # -- registration ----------------------------------------------------------------------

    def register(
        self, schema: CompiledSchema, on_done: SchemaDone, context_len: int, kv: SlotSource
    ) -> None:
        """Pin slots from `kv` for every module of `schema` and `begin` encoding it. ValueError,
        at once and with nothing taken: the name is taken, the schema does not fit the
        context, MAX_SCHEMAS are registered, or the pool cannot hold it."""
        self._check_new(schema, context_len)
        need = sum(len(m.token_ids) for m in schema.modules)
        room = min(kv.pool.capacity, kv.pool.swa_capacity)  # modules keep their sliding rows
        pinned, cap = self.num_slots + need, int(room * MAX_SCHEMA_SHARE)
        if pinned > cap:
            raise ValueError(
                f"schema {schema.name!r}: schemas would pin {pinned} KV slots, at most "
                f"{cap} ({MAX_SCHEMA_SHARE:.0%} of the pool) may be pinned; delete a schema "
                "or raise --max-total-tokens"
            )
        if not kv.reserve(need):
            raise ValueError(
                f"schema {schema.name!r}: {need} tokens of K/V, {kv.available} KV slots "
                "free or evictable; raise --max-total-tokens or delete a schema"
            )
        slots = {}
        for m in schema.modules:
            if m.token_ids:
                got = kv.pool.alloc(len(m.token_ids))
                assert got is not None, f"module {m.name!r}: no slots though reserved"
                slots[m.name] = got
        logger.info("schema %s: %d modules, %d tokens to encode", schema.name, len(slots), need)
        self.begin(schema, slots, on_done)

    def _check_new(self, schema: CompiledSchema, context_len: int) -> None:
        if schema.name in self.schemas or schema.name in self.encoding:
            raise ValueError(f"schema {schema.name!r} is already registered; delete it first")
        if schema.num_positions >= context_len:
            raise ValueError(
                f"schema {schema.name!r}: {schema.num_positions} positions, the context holds "
                f"{context_len} (and a prompt needs one more)"
            )
        if len(self.schemas) + len(self.encoding) >= MAX_SCHEMAS:
            raise ValueError(
                f"schema {schema.name!r}: {MAX_SCHEMAS} schemas are registered already; "
                "delete one first"
            )

    def unregister(self, name: str, requests: list[TokenizedRequest]) -> torch.Tensor:
        """`remove` schema `name` unless one of `requests` (the queued and running ones)
        imports it; returns its slots for the caller to free. ValueError: unknown, or in use."""
        if name not in self.schemas and name not in self.encoding:
            raise ValueError(f"schema: no schema {name!r} is registered")
        users = self.in_use(name, requests)
        if users:
            raise ValueError(f"schema {name!r} is used by {users} queued or running samples")
        return self.remove(name, f"schema {name!r} was deleted while it was being encoded")

    def describe(self) -> list[dict[str, object]]:
        """Every registered schema: name, each module's tokens, positions it spans, and
        whether it is "ready" or still "encoding"."""
        return [
            {
                "name": e.compiled.name,
                "modules": {m.name: len(m.token_ids) for m in e.compiled.modules},
                "positions": e.compiled.num_positions,
                "status": status,
            }
            for entries, status in ((self.schemas, "ready"), (self.encoding, "encoding"))
            for e in entries.values()
        ]

    # -- encoding ----------------------------------------------------------------------------

    def begin(
        self, compiled: CompiledSchema, slots: dict[str, torch.Tensor], on_done: SchemaDone
    ) -> None:
        """Start encoding `compiled` into `slots` (name -> one slot per module token)."""
        name = compiled.name
        assert name not in self.schemas and name not in self.encoding, f"{name!r} is taken"
        entry = _Schema(compiled, slots, dict.fromkeys(slots, 0), on_done)
        self.encoding[name] = entry
        self._finish_if_done(entry)

    def next_chunks(self, budget: int) -> list[EncodeChunk]:
        """The next step's share of the oldest schema being encoded: its modules' next
        tokens, `budget` in all (none when budget <= 0)."""
        if not self.encoding or budget <= 0:
            return []
        entry = next(iter(self.encoding.values()))
        out, left = [], budget
        for m in entry.compiled.modules:
            start = entry.encoded.get(m.name, 0)
            n = min(len(m.token_ids) - start, left)
            if n > 0:
                out.append(EncodeChunk(entry.compiled.name, m, start, n))
                left -= n
        return out

    def chunk_inputs(self, c: EncodeChunk) -> tuple[list[int], list[int], torch.Tensor]:
        """(token ids, positions) of chunk c's new tokens, and the slots of its module's
        tokens 0 .. c.start + c.n - 1 (the last c.n are the new ones)."""
        end = c.start + c.n
        slots = self.encoding[c.schema].slots[c.module.name][:end]
        return c.module.token_ids[c.start : end], c.module.positions[c.start : end], slots

    def encoded(self, chunks: list[EncodeChunk]) -> None:
        """Record that `chunks` were computed; a schema now complete becomes usable and its
        registration hears None."""
        for c in chunks:
            entry = self.encoding[c.schema]
            assert entry.encoded[c.module.name] == c.start, f"{c} out of order"
            entry.encoded[c.module.name] = c.start + c.n
        for name in dict.fromkeys(c.schema for c in chunks):
            self._finish_if_done(self.encoding[name])

    def _finish_if_done(self, entry: _Schema) -> None:
        if any(n < entry.slots[m].numel() for m, n in entry.encoded.items()):
            return
        name, on_done = entry.compiled.name, entry.on_done
        assert on_done is not None
        del self.encoding[name]
        entry.encoded, entry.on_done = {}, None
        self.schemas[name] = entry
        on_done(None)

    def remove(self, name: str, why: str) -> torch.Tensor:
        """Forget schema `name` (encoded or not: its registration then hears `why`); returns
        its slots for the caller to free."""
        entry = self.schemas.pop(name, None)
        if entry is None:
            entry = self.encoding.pop(name)
            assert entry.on_done is not None
            entry.on_done(why)
        self._node_ids = {k: v for k, v in self._node_ids.items() if k[0] != name}
        return torch.cat([torch.empty(0, dtype=torch.int64), *entry.slots.values()])

    def check(self, request: TokenizedRequest) -> None:
        """ValueError unless `request.modules` names registered modules whose tokens open its
        input_ids, with one ascending position per own token."""
        use = request.modules
        assert use is not None
        if use.schema in self.encoding:
            raise ValueError(
                f"schema: {use.schema!r} is still being encoded; import it once its "
                "registration has returned"
            )
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
