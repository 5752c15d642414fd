"""What the scheduler reports about itself: the model it serves and its counters.

Both cross the IPC boundary as they are (msgspec encodes these dataclasses).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelInfo:
    model_path: str
    tokenizer_path: str
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
    tiers: dict[str, TierStats] = field(default_factory=dict)  # empty without --hicache-*

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / max(self.kv_capacity_tokens, 1)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / max(self.prompt_tokens_total, 1)
