"""Engine / server configuration: one frozen dataclass, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
QUANTIZATIONS = ("auto", "none", "int8")
POLICIES = ("lpm", "fcfs")
ATTENTION_BACKENDS = ("tree", "flat", "none")  # "none": benchmark-only no-attention ceiling
CONTROL_CONNECTIONS = 64  # connections kept for /health, /get_server_info, aborts, ...


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # "auto": bf16 where the CPU/GPU computes it fast, else float32
    quantization: str = "auto"  # "auto": a GGUF's Q4_0/Q4_1/Q8_0 stay quantized; "none"; "int8"
    kv_cache_dtype: str = "auto"  # "auto": fp16 under quantized weights on CPU, else = dtype
    device: str = "cpu"
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction
    mem_fraction: float = 0.3  # of available host/GPU memory, when max_total_tokens is None
    chunked_prefill_size: int = 2048  # max prompt tokens of one request per prefill step
    max_prefill_tokens: int = 8192  # max new tokens of a whole extend batch
    max_running_requests: int = 256
    max_queued_requests: int = 4096  # samples waiting (a request with n samples counts n)
    max_queued_tokens: int | None = None  # prompt tokens waiting; None: 4x the KV pool
    max_connections: int | None = None  # HTTP connections; None: running + queued + control
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    attention_backend: str = "tree"
    tp_size: int = 1
    random_seed: int = 0
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        check(
            self.dtype in DTYPE_CHOICES,
            f"dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}",
        )
        check(
            self.kv_cache_dtype in DTYPE_CHOICES,
            f"kv_cache_dtype must be one of {list(DTYPE_CHOICES)}, got {self.kv_cache_dtype!r}",
        )
        check(
            self.quantization in QUANTIZATIONS,
            f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}",
        )
        check(self.schedule_policy in POLICIES, f"schedule_policy must be one of {POLICIES}")
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}",
        )
        check(
            self.max_total_tokens is None or self.max_total_tokens >= 16,
            f"max_total_tokens must be >= 16, got {self.max_total_tokens}",
        )
        check(0 < self.mem_fraction <= 0.95, "mem_fraction must be in (0, 0.95]")
        check(self.chunked_prefill_size >= 16, "chunked_prefill_size must be >= 16")
        check(
            self.max_prefill_tokens >= self.chunked_prefill_size,
            "max_prefill_tokens must be >= chunked_prefill_size",
        )
        check(self.max_running_requests >= 1, "max_running_requests must be >= 1")
        check(self.max_queued_requests >= 1, "max_queued_requests must be >= 1")
        check(self.tp_size >= 1, "tp_size must be >= 1")
        for name in ("max_queued_tokens", "max_connections"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"{name} must be >= 1, got {value}")

    @property
    def max_samples_in_flight(self) -> int:
        """Samples the server holds at once (running + waiting): the api server refuses
        more with 503 before they reach the pipeline."""
        return self.max_running_requests + self.max_queued_requests

    @property
    def connection_limit(self) -> int:
        """uvicorn's limit_concurrency: beyond it a connection gets uvicorn's own 503."""
        return self.max_connections or self.max_samples_in_flight + CONTROL_CONNECTIONS
