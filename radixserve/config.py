"""Engine / server configuration: one frozen dataclass, validated once at construction.

Fast paths are chosen here and nowhere else (`native_ops`, `packed_linear`,
`attention_kernels`). Environment variables only give defaults, read once when this module
is imported: RADIXSERVE_NATIVE_OPS=0|1 -> native_ops, RADIXSERVE_PACKED_LINEAR=0|1 ->
packed_linear "off" | "on", RADIXSERVE_HICACHE_ENCRYPT=0|1 -> hicache_encrypt (unset: True,
"auto" and False). An explicit field, flag or Engine argument wins over them.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TypeVar

import torch

from radixserve.keys import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    API_KEYS_FILE_ENV,
    CACHE_ISOLATION,
    check_exposure,
    env_key,
    tenant_keys,
)
from radixserve.redact import redact

_T = TypeVar("_T")

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
QUANTIZATIONS = ("auto", "none", "int8")
QUANT_ACTIVATIONS = ("int8", "int16")
QUANT_ACTIVATIONS_DEFAULT = "int8"
POLICIES = ("lpm", "fcfs")
ATTENTION_BACKENDS = ("tree", "flat", "none")  # "none": benchmark-only no-attention ceiling
GRAMMAR_BACKENDS = ("llguidance", "outlines", "xgrammar")  # radixserve.constrained.BACKENDS
# scheduler/speculative.py
SPECULATIVE_ALGORITHMS = ("auto", "none", "ngram", "radix", "draft-model")
CONTROL_CONNECTIONS = 64  # connections kept for /health, /get_server_info, aborts, ...
# Fields never shown (/get_server_info, logs) nor put on a command line the server builds.
SECRET_FIELDS = ("api_key", "admin_api_key", "hicache_secret")
HICACHE_SECRET_ENV = "RADIXSERVE_HICACHE_SECRET"
HICACHE_REMOTE_ENV = "RADIXSERVE_HICACHE_REMOTE"  # its URL may carry the Redis password
PACKED_LINEAR = ("auto", "on", "off")
# Attention op implementations (radixserve.kernels, which documents each): "auto" picks
# triton on CUDA, the native C++ kernels on an AVX2 CPU where they build, else "cpu".
ATTENTION_KERNELS = ("auto", "native", "cpu", "reference", "triton")


def env_default(name: str, values: dict[str, _T], unset: _T) -> _T:
    """A field's default from environment variable `name`: `unset` when it is not set, else
    values[its value]. ValueError naming the variable for any other value."""
    raw = os.environ.get(name)
    if raw is None:
        return unset
    if raw not in values:
        raise ValueError(f"{name} must be one of {sorted(values)} or unset, got {raw!r}")
    return values[raw]


NATIVE_OPS_DEFAULT = env_default("RADIXSERVE_NATIVE_OPS", {"0": False, "1": True}, True)
HICACHE_ENCRYPT_ENV = "RADIXSERVE_HICACHE_ENCRYPT"
HICACHE_ENCRYPT_DEFAULT = env_default(HICACHE_ENCRYPT_ENV, {"0": False, "1": True}, False)
PACKED_LINEAR_DEFAULT = env_default("RADIXSERVE_PACKED_LINEAR", {"0": "off", "1": "on"}, "auto")


DECODE_RESERVE = 16  # KV slots per admitted sample kept free for its first decode steps


@dataclass(frozen=True)
class EngineConfig:
    # As the user passes it: an HF folder, a .gguf file or a hub id (radixserve.models.resolve);
    # None: the embedded SmolLM2-135M-Instruct
    model: str | None = None
    revision: str | None = None  # a hub id's branch, tag or commit (default: main)
    served_model_name: str | None = None  # the name /v1/models reports (default: `model`)
    dtype: str = "auto"  # "auto": bf16 where the CPU/GPU computes it fast, else float32
    quantization: str = "auto"  # "auto": a GGUF's Q4_0/Q4_1/Q8_0 stay quantized; "none"; "int8"
    kv_cache_dtype: str = "auto"  # "auto": fp16 under quantized weights on CPU, else = dtype
    # x of Q4_K and Q6_K weights' matmuls rounded to "int8" (as llama.cpp rounds it; faster) or
    # "int16" (the other formats' x is always int16); radixserve.models.quant.X8_CODES
    quant_activations: str = QUANT_ACTIVATIONS_DEFAULT
    device: str = "cpu"
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from mem_fraction
    # tokens whose sliding-window layers' K/V the pool holds at once (models with such
    # layers, kvcache/pool.py); None: as many as max_total_tokens when that is set, else
    # from mem_fraction (worker/model_worker.py kv_capacity)
    max_swa_tokens: int | None = None
    mem_fraction: float = 0.3  # of available host/GPU memory, when max_total_tokens is None
    chunked_prefill_size: int = 2048  # max prompt tokens of one request per prefill step
    max_prefill_tokens: int = 8192  # max new tokens of a whole extend batch
    max_running_requests: int = 256
    max_queued_requests: int = 4096  # samples waiting (a request with n samples counts n)
    max_queued_tokens: int | None = None  # prompt tokens waiting; None: 4x the KV pool
    max_connections: int | None = None  # HTTP connections; None: running + queued + control
    schedule_policy: str = "lpm"
    disable_radix_cache: bool = False
    # Hierarchical KV cache (radixserve/kvcache/hicache.py): prefixes evicted from the pool
    # go to host memory (GB; 0: off), from there to disk (a directory), and are written
    # through to a shared Redis / Valkey (redis://host:port/db), and come back on a match.
    hicache_size: float = 0.0
    hicache_dir: str | None = None
    hicache_disk_size: float = 16.0  # GB of chunk files kept in hicache_dir
    hicache_remote: str | None = None  # None: $RADIXSERVE_HICACHE_REMOTE (see remote_url)
    hicache_remote_ttl: int | None = 86400  # seconds a chunk stays in Redis (None: forever)
    hicache_ttl: float | None = None  # seconds a chunk stays in the host/disk tiers (None: forever)
    hicache_prefetch_window: int = 8  # waiting samples whose KV is pulled up early (0: off)
    hicache_layerwise: bool = True  # load a hit layer by layer during the step (False: before)
    # positional decoupling (kvcache/reposition.py), an approximation: a run of 16+ prompt
    # tokens cached at another position (a truncated conversation's kept turns) is reused
    # there with its keys turned to the new position, instead of recomputed
    hicache_reposition: bool = False
    # Key of the MAC on every K/V record in the disk and Redis tiers: servers share K/V only
    # when they share it. None: $RADIXSERVE_HICACHE_SECRET, else a random key per process
    # (nothing shared across servers or restarts). Never shown (SECRET_FIELDS).
    hicache_secret: str | None = None
    # Seal every disk and Redis record with AES-256-GCM under keys derived from that secret
    # (kvcache/tier_store.py SealedChunkCodec): their tokens and rows are unreadable without
    # it. Without a secret set, the random per-process one seals too. The host tier stays in
    # memory as it is. Needs the cryptography package (checked here, at start). Default:
    # $RADIXSERVE_HICACHE_ENCRYPT (0/1), else off.
    hicache_encrypt: bool = HICACHE_ENCRYPT_DEFAULT
    attention_backend: str = "tree"
    attention_kernels: str = "auto"  # the ops under the backend; process-wide (see worker)
    # Decode steps run from fixed buffers, padded to the next bucket size (1, 2, 4, 8, 16,
    # 24, ... 256, with max_running_requests the largest): what CUDA-graph capture needs
    # (worker/buckets.py). On a CPU the padding rows are only extra work, hence off.
    decode_buckets: bool = False
    grammar_backend: str = "llguidance"  # constrained decoding (radixserve.constrained)
    # Speculative decoding (scheduler/speculative.py): "auto" (radix, else ngram), "ngram",
    # "radix", "draft-model" (radix, else the model at speculative_draft_model_path, which
    # it needs) or "none"; at most this many draft tokens per sample and step, in a token
    # tree with at most speculative_topk branches under one node (1: chains)
    speculative_algorithm: str = "auto"
    speculative_num_draft_tokens: int = 8
    speculative_topk: int = 4
    speculative_draft_model_path: str | None = None
    # Our C++ CPU kernels (RMSNorm/RoPE, quantized matmuls, sampling, attention), built on
    # first use; False: the same math as torch ops. Process-wide (see worker).
    native_ops: bool = NATIVE_OPS_DEFAULT
    # oneDNN pre-packed bf16 weights: "auto" where supported, "on" (refused where not), "off"
    packed_linear: str = PACKED_LINEAR_DEFAULT
    tp_size: int = 1
    # OpenMP threads of each model process (CPU); None: $OMP_NUM_THREADS, else the physical
    # cores of its share of this process's CPUs (radixserve/cpus.py)
    threads: int | None = None
    random_seed: int = 0  # seeds the draws of requests without a seed (per scheduler)
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None  # the inference key (radixserve/server/guard.py)
    admin_api_key: str | None = None  # the admin key: also other tenants' data, server state
    # `KEY TENANT` lines (radixserve/keys.py): inference keys of several tenants, beside
    # api_key (tenant "default"); None: $RADIXSERVE_API_KEYS_FILE, else none
    api_keys_file: str | None = None
    # "tenant": each tenant's requests are salted with its name (CacheSalt): no cached K/V
    # is shared across tenants; "none": shared (a request's cache_salt still separates it)
    cache_isolation: str = "none"
    allow_unauthenticated: bool = False  # serve an address other than loopback with no key
    allowed_hosts: tuple[str, ...] = ()  # Host names served ("*": any); () = loopback names
    # when bound to loopback, else any
    web_ui: bool = True  # GET / serves the web console (chat playground, cache tree, plots)
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
        check(
            self.quant_activations in QUANT_ACTIVATIONS,
            f"quant_activations must be one of {QUANT_ACTIVATIONS}, got {self.quant_activations!r}",
        )
        check(self.schedule_policy in POLICIES, f"schedule_policy must be one of {POLICIES}")
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}",
        )
        check(
            self.grammar_backend in GRAMMAR_BACKENDS,
            f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {self.grammar_backend!r}",
        )
        check(
            self.speculative_algorithm in SPECULATIVE_ALGORITHMS,
            f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
            f"got {self.speculative_algorithm!r}",
        )
        check(
            (self.speculative_algorithm == "draft-model")
            == (self.speculative_draft_model_path is not None),
            "speculative_algorithm draft-model and speculative_draft_model_path go together",
        )
        check(
            0 <= self.speculative_num_draft_tokens <= 64,
            "speculative_num_draft_tokens must be in [0, 64]",
        )
        check(1 <= self.speculative_topk <= 16, "speculative_topk must be in [1, 16]")
        check(
            self.attention_kernels in ATTENTION_KERNELS,
            f"attention_kernels must be one of {ATTENTION_KERNELS}, got {self.attention_kernels!r}",
        )
        check(
            self.native_ops or self.attention_kernels != "native",
            "attention_kernels native needs native_ops",
        )
        check(
            not self.decode_buckets or self.tp_size == 1,
            "decode_buckets runs at tp_size 1 (the padded rows would not reach the other ranks)",
        )
        check(
            self.packed_linear in PACKED_LINEAR,
            f"packed_linear must be one of {PACKED_LINEAR}, got {self.packed_linear!r}",
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
        check(
            self.max_swa_tokens is None or self.max_swa_tokens >= 16,
            f"max_swa_tokens must be >= 16, got {self.max_swa_tokens}",
        )
        check(self.max_queued_requests >= 1, "max_queued_requests must be >= 1")
        check(self.tp_size >= 1, "tp_size must be >= 1")
        check(self.threads is None or self.threads >= 1, f"threads must be >= 1: {self.threads}")
        check(self.hicache_size >= 0, f"hicache_size must be >= 0 GB, got {self.hicache_size}")
        check(self.hicache_disk_size > 0, "hicache_disk_size must be > 0 GB")
        check(
            self.hicache_dir is None or self.hicache_size > 0,
            "hicache_dir needs hicache_size > 0 (the disk tier is fed from the host tier)",
        )
        remote = self.remote_url()
        check(
            remote is None or remote.startswith(("redis://", "rediss://")),
            f"hicache_remote must be a redis:// or rediss:// URL, got {redact(str(remote))!r}",
        )
        check(
            not (self.disable_radix_cache and self.hicache_enabled),
            "the hicache tiers need the radix cache (drop --disable-radix-cache)",
        )
        check(
            self.hicache_remote_ttl is None or self.hicache_remote_ttl >= 1,
            "hicache_remote_ttl must be >= 1 second",
        )
        check(
            self.hicache_ttl is None or self.hicache_ttl > 0,
            f"hicache_ttl must be > 0 seconds, got {self.hicache_ttl}",
        )
        check(
            self.tp_size == 1 or not self.hicache_enabled,
            "the hicache tiers (--hicache-size, --hicache-remote, --hicache-reposition) work "
            "with --tp-size 1 only: each TP rank holds a shard of the K/V heads",
        )
        secret = env_key(self.hicache_secret, HICACHE_SECRET_ENV)
        check(
            secret is None or len(secret) >= 16,
            f"hicache_secret (or ${HICACHE_SECRET_ENV}) must be at least 16 characters",
        )
        check(
            not self.hicache_encrypt or importlib.util.find_spec("cryptography") is not None,
            "hicache_encrypt needs the cryptography package (pip install cryptography)",
        )
        check(
            self.cache_isolation in CACHE_ISOLATION,
            f"cache_isolation must be one of {CACHE_ISOLATION}, got {self.cache_isolation!r}",
        )
        check_exposure(
            self.host,
            bool(self.tenant_keys() or self.admin_key()),
            "anyone could run requests, read the cache and change server state",
            self.allow_unauthenticated,
        )
        check(
            self.hicache_prefetch_window >= 0,
            f"hicache_prefetch_window must be >= 0, got {self.hicache_prefetch_window}",
        )
        for name in ("max_queued_tokens", "max_connections"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"{name} must be >= 1, got {value}")

    def swa_rows_needed(self, window: int) -> int:
        """Sliding-window rows (kvcache/pool.py) one running sample may hold at once: its own
        window, the cache nodes its window reaches (a window and a prompt chunk at most),
        its next prompt chunk, its drafts and DECODE_RESERVE."""
        chunk = self.chunked_prefill_size
        return 2 * (window + chunk) + self.speculative_num_draft_tokens + DECODE_RESERVE

    @property
    def hicache_enabled(self) -> bool:
        return self.hicache_size > 0 or self.remote_url() is not None or self.hicache_reposition

    def remote_url(self) -> str | None:
        """The Redis tier's URL: `hicache_remote`, else $RADIXSERVE_HICACHE_REMOTE (which
        keeps a password in it off the process list)."""
        return env_key(self.hicache_remote, HICACHE_REMOTE_ENV)

    def hicache_key(self) -> bytes:
        """The tiers' MAC key (see `hicache_secret`); a random one when none is set, so call
        it once per process."""
        secret = env_key(self.hicache_secret, HICACHE_SECRET_ENV)
        return secret.encode() if secret else os.urandom(32)

    def inference_key(self) -> str | None:
        return env_key(self.api_key, API_KEY_ENV)

    def admin_key(self) -> str | None:
        return env_key(self.admin_api_key, ADMIN_API_KEY_ENV)

    def keys_file(self) -> str | None:
        """The api keys file: `api_keys_file`, else $RADIXSERVE_API_KEYS_FILE."""
        return env_key(self.api_keys_file, API_KEYS_FILE_ENV)

    def tenant_keys(self) -> dict[str, str]:
        """{key: tenant} of every inference key, the keys file read now (radixserve/keys.py);
        ValueError naming the line of a bad one."""
        return tenant_keys(self.keys_file(), self.inference_key(), self.admin_key())

    @property
    def several_tenants(self) -> bool:
        """Tenants come from a keys file: what one tenant sees of the server (the aggregate
        metrics, the cache tree) is only its own unless it holds the admin key."""
        return self.keys_file() is not None

    @property
    def packed_linear_request(self) -> bool | None:
        """`packed_linear` as the loader takes it: None = auto, True = on, False = off."""
        return {"auto": None, "on": True, "off": False}[self.packed_linear]

    @property
    def max_samples_in_flight(self) -> int:
        """Samples the server holds at once (running + waiting): the api server refuses
        more with 503 before they reach the pipeline."""
        return self.max_running_requests + self.max_queued_requests

    @property
    def connection_limit(self) -> int:
        """uvicorn's limit_concurrency: beyond it a connection gets uvicorn's own 503."""
        return self.max_connections or self.max_samples_in_flight + CONTROL_CONNECTIONS
