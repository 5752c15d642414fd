"""ModelConfig: the architecture facts the model and the engine need, read once from HF JSON.

Supported: LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM (one implementation,
radixserve.models.llama). Everything is validated in `from_hf`; unsupported features raise
ValueError naming what is supported, so a bad checkpoint fails at load, not mid-request.

Sliding-window attention (Mistral v0.1 `sliding_window`, Qwen2 `use_sliding_window`) is
IGNORED: we always attend the full context. That is exact while a sequence is no longer than
the window (Mistral v0.2+ and Qwen2 default configs disable the window anyway); a warning is
logged when a checkpoint declares a window shorter than its context length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
ROPE_SCALING_TYPES = ("llama3", "linear")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `linear` uses only `factor`; `llama3` uses all fields."""

    type: str  # "llama3" | "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int  # context length; the RoPE cache covers positions below it
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2 always; Llama `attention_bias`)
    o_bias: bool  # o_proj bias (Llama `attention_bias` only; never Qwen2)
    mlp_bias: bool  # gate/up/down bias (Llama `mlp_bias`)
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.architecture in SUPPORTED_ARCHITECTURES, self.architecture
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}"
        )
        assert self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(
        cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a config.json dict (and optionally generation_config.json for eos ids).

        Raises ValueError on an unsupported architecture, activation or RoPE scaling type.
        """
        arch = _architecture(cfg)
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        _warn_sliding_window(cfg)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=_eos_ids(cfg, generation_config or {}),
        )


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
    return str(arch)


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from transformers-5 `rope_parameters` or old `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters")
    if params is None:  # pre-v5 layout: theta at top level, scaling in its own dict
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type layout; all our layers are full
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    theta = float(params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {kind!r}; supported: default, "
            f"{', '.join(ROPE_SCALING_TYPES)}"
        )
    if kind == "linear":
        return theta, RopeScaling(type="linear", factor=float(params["factor"]))
    return theta, RopeScaling(
        type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    """Union (in order of appearance) of config.json and generation_config.json eos ids."""
    ids: list[int] = []
    for source in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def _warn_sliding_window(cfg: dict[str, Any]) -> None:
    window = cfg.get("sliding_window")
    enabled = cfg.get("use_sliding_window", True)  # Mistral has no flag: a window means on
    context = int(cfg.get("max_position_embeddings", 2048))
    if window and enabled and int(window) < context:
        logger.warning(
            "sliding_window=%s < context %s is ignored: full attention is used, which "
            "differs from the checkpoint's training once a sequence exceeds the window",
            window,
            context,
        )
