"""What the scheduler reports about itself: the model it serves and its counters.

Both cross the IPC boundary as they are (msgspec encodes these dataclasses).
"""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def kv_usage(self) -> float:
        return self.kv_used_tokens / max(self.kv_capacity_tokens, 1)

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens_total / max(self.prompt_tokens_total, 1)
