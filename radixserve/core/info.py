"""What the scheduler reports about itself: the model it serves and its counters.

Both cross the IPC boundary as they are (msgspec encodes these dataclasses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.core.request import CacheSalt


@dataclass(frozen=True)
class ModelInfo:
    model_path: str  # as the user passed it (hub id, folder, .gguf); else the embedded folder
    tokenizer_path: str  # the local folder holding the tokenizer, config and weights
    served_model_name: str  # what /v1/models and OpenAI responses call the model
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    kv_capacity_tokens: int
    attention_backend: str


@dataclass
class TierStats:
    """One KV tier's counters since start ("device" = the KV pool, "host", "disk",
    "remote"); `stored_bytes` is what the tier holds now."""

    hit_tokens: int = 0  # prompt tokens served from this tier
    loads: int = 0  # chunks loaded from it
    load_seconds: float = 0.0  # time spent loading them
    faults: int = 0  # records refused (checksum, truncation) or reads/writes that failed
    stored_bytes: int = 0


@dataclass
class SchedulerStats:
    num_running: int
    num_queued: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    kv_held_tokens: int  # slots that requests hold (locked cache nodes + their own): 0 when idle
    prompt_tokens_total: int  # counters since start
    cached_tokens_total: int
    generation_tokens_total: int
    computed_tokens_total: int  # tokens run through the model (prefill + decode)
    kv_module_tokens: int = 0  # slots pinned by registered prompt-module schemas
    draft_tokens_total: int = 0  # speculative decoding: draft tokens verified
    accepted_draft_tokens_total: int = 0  # of those, tokens kept
    tiers: dict[str, TierStats] = field(default_factory=dict)  # empty without --hicache-*

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / max(self.kv_capacity_tokens, 1)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / max(self.prompt_tokens_total, 1)


@dataclass
class CacheNodeView:
    """One radix node as the web console draws it (`/cache_tree`)."""

    id: int
    parent: int  # -1 for the root
    depth: int  # 0 for the root
    num_tokens: int
    preview_ids: list[int]  # its first tokens
    lock_ref: int  # > 0: a running sample's path holds it (not evictable)
    num_children: int  # all of them, shown or not
    running: int  # running samples whose cached path passes through it
    batched: bool  # part of a shared segment tree attention read once in the last step
    tier: str  # where its K/V lives: "device" (the KV pool attention reads)
    text: str = ""  # preview_ids decoded (the tokenizer process fills it in)
    salt: CacheSalt | None = None  # set on the root of a salted part (no tokens of its own)


@dataclass
class CacheTreeView:
    """A bounded snapshot of the radix tree: the nodes nearest the root, breadth first.

    Scoped to one tenant (`tenant` set): only its salts' parts, and the counts are those of
    the nodes shown; `stats` is blank but for the pool's capacity."""

    nodes: list[CacheNodeView]
    total_nodes: int  # in the whole tree, root included
    truncated: bool  # nodes were left out by the node or depth limit
    cached_tokens: int
    evictable_tokens: int
    locked_tokens: int
    stats: SchedulerStats
    attention_backend: str
    tenant: str | None = None
