"""ModelConfig: the architecture facts the model and the engine need, read once from HF JSON.

Supported (`SUPPORTED_ARCHITECTURES`): Llama, Qwen2, Mistral, Qwen3, Gemma 2 and 3 (text),
Phi-3 / Phi-4-mini, SmolLM3 and the mixtures of experts Qwen3-MoE, OLMoE, Mixtral and gpt-oss,
all run by one decoder (radixserve.models.llama) whose per-family differences are the fields below,
set by one small reader per family (`FAMILIES`):

    Qwen3     per-head RMSNorm of q and k before RoPE (`qk_norm`)
    Gemma 2/3 RMSNorm weights applied as 1 + w (`norm_offset`), norms after attention and
              around the MLP (`sandwich_norms`), GeGLU with tanh GELU (`hidden_act`),
              embeddings times sqrt(hidden) (`embed_scale`), query scale
              `query_pre_attn_scalar` ** -0.5, final-logit and (Gemma 2) attention-score
              soft-capping (`attn_softcap`); Gemma 3 adds q/k
              norms and a second RoPE base for its sliding-window layers (`local_rope_theta`)
    Phi-3     fused qkv / gate_up checkpoint tensors (split by the loader), partial rotary
              (`rotary_dim`), longrope scaling
    SmolLM3   layers without RoPE (`rope_layers`)
    Qwen3-MoE, OLMoE, Mixtral
              a mixture-of-experts MLP (radixserve.models.moe) in place of the dense one:
              `num_experts` SwiGLU experts of `moe_intermediate_size`, a router picking
              `num_experts_per_tok` of them per token (softmax, then top-k, renormalised with
              `norm_topk_prob`); Qwen3-MoE keeps dense MLPs in some layers (`moe_layers`) and
              has Qwen3's q/k norms; OLMoE norms q and k over the whole projection
              (`qk_norm_full`); Mixtral weights the experts' outputs in float32
              (`routing_weights_f32`)
    gpt-oss   a mixture of experts whose router has a bias (`router_bias`) and takes the
              top-k of its logits, then a softmax over those k (`topk_softmax`); experts with
              biases (`expert_bias`) and a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`);
              q/k/v/o biases; a learned sink logit per head in every softmax (`attn_sinks`);
              alternating sliding and full layers; YaRN RoPE; norms multiplying by their
              weight in float32 (`norm_weight_f32`)

Sliding-window layers (`layer_types`, `sliding_window`: Gemma, Mistral v0.1, Qwen2/Qwen3 with
`use_sliding_window`) attend only the last `sliding_window` positions, as transformers does.

Everything is validated in `from_hf`: a field whose value changes the math and is not
implemented raises ValueError naming the field and value, so a checkpoint fails at load,
never with a silently wrong answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "SmolLM3ForCausalLM",
    "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM",
)  # fmt: skip
ROPE_SCALING_TYPES = ("llama3", "linear", "longrope", "yarn")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
DEFAULT_THETA = {"GptOssForCausalLM": 150000.0}  # RoPE bases of families whose default is not 1e4
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `linear` uses only `factor`; `llama3` its factor, band factors
    and original context; `longrope` its short / long per-frequency factors, original context
    and attention factor (cos and sin are multiplied by it); `yarn` its factor, original
    context, the rotation counts bounding its ramp (`beta_fast`, `beta_slow`, the bounds
    rounded outwards with `truncate`) and attention factor."""

    type: str  # "llama3" | "linear" | "longrope" | "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class Rope:
    """One RoPE table's parameters: the first `rotary_dim` dims of each head rotate."""

    theta: float
    scaling: RopeScaling | None
    rotary_dim: int


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
    rope_theta: float  # the full-attention layers' RoPE (all layers' unless local_rope_theta)
    rope_scaling: RopeScaling | None
    max_position_embeddings: int  # context length; the RoPE cache covers positions below it
    tie_word_embeddings: bool
    qkv_bias: bool  # q/k/v projections carry a bias (Qwen2 always; Llama `attention_bias`)
    o_bias: bool  # o_proj bias (Llama `attention_bias` only; never Qwen2)
    mlp_bias: bool  # gate/up/down bias (Llama `mlp_bias`)
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()  # per layer FULL or SLIDING; () = every layer FULL
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included
    local_rope_theta: float | None = None  # sliding layers' RoPE base (no scaling), if own
    rotary_dim: int = 0  # dims of a head that rotate; 0 = head_dim
    rope_layers: tuple[bool, ...] = ()  # per layer: applies RoPE; () = every layer does
    qk_norm: bool = False  # RMSNorm over head_dim of each q and k head, before RoPE
    norm_offset: float = 0.0  # every RMSNorm multiplies by (norm_offset + weight)
    sandwich_norms: bool = False  # norm the attention output and the MLP's input and output
    hidden_act: str = "silu"  # the MLP's gate activation (HIDDEN_ACTS)
    embed_scale: float = 1.0  # token embeddings are multiplied by it (in the model dtype)
    query_pre_attn_scalar: float = 0.0  # attention scale is its ** -0.5; 0 = head_dim's
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0 = none
    attn_softcap: float = 0.0  # attention scores = cap * tanh(scores / cap); 0 = none
    qk_norm_full: bool = False  # the q/k norms span the whole projection, not each head
    num_experts: int = 0  # experts of a mixture-of-experts MLP; 0 = a dense model
    num_experts_per_tok: int = 0  # experts each token is routed to (top-k)
    moe_intermediate_size: int = 0  # each expert's gate/up rows
    norm_topk_prob: bool = False  # the top-k routing weights are renormalised to sum to 1
    routing_weights_f32: bool = False  # weights multiply expert outputs in float32
    moe_layers: tuple[bool, ...] = ()  # per layer: its MLP is the experts; () = every layer
    router_bias: bool = False  # the router projection has a bias
    topk_softmax: bool = False  # top-k of the router logits, then softmax over those k
    expert_bias: bool = False  # every expert's gate/up and down projections have biases
    swiglu_alpha: float = 0.0  # > 0: experts compute (u + 1) * g * sigmoid(alpha * g) with
    swiglu_limit: float = 0.0  # g = min(gate, limit), u = clamp(up, -limit, limit)
    attn_sinks: bool = False  # each head's softmax has one more logit, learned, with no value
    norm_weight_f32: bool = False  # norms multiply by their weight in float32, then cast

    def __post_init__(self) -> None:
        assert self.architecture in SUPPORTED_ARCHITECTURES, self.architecture
        assert self.num_heads % self.num_kv_heads == 0, (
            f"num_heads={self.num_heads} not a multiple of num_kv_heads={self.num_kv_heads}"
        )
        assert self.head_dim % 2 == 0, f"RoPE needs an even head_dim, got {self.head_dim}"
        assert self.rotary_dim % 2 == 0 and self.rotary_dim <= self.head_dim, self.rotary_dim
        assert len(self.layer_types) in (0, self.num_layers), self.layer_types
        assert len(self.rope_layers) in (0, self.num_layers), self.rope_layers
        assert self.hidden_act in HIDDEN_ACTS, self.hidden_act
        assert SLIDING not in self.layer_types or self.sliding_window > 0, self.sliding_window
        assert len(self.moe_layers) in (0, self.num_layers), self.moe_layers
        assert 0 < self.num_experts_per_tok <= self.num_experts or not self.num_experts, (
            f"{self.num_experts_per_tok} experts per token of {self.num_experts}"
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rope(self) -> Rope:
        """The full-attention layers' RoPE."""
        return Rope(self.rope_theta, self.rope_scaling, self.rotary_dim or self.head_dim)

    @property
    def local_rope(self) -> Rope | None:
        """The sliding layers' own RoPE, or None when they use `rope`."""
        if self.local_rope_theta is None:
            return None
        return Rope(self.local_rope_theta, None, self.rotary_dim or self.head_dim)

    def sliding(self, layer: int) -> bool:
        """Whether layer `layer` is a sliding-window layer (its own RoPE base in Gemma 3)."""
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING

    def window(self, layer: int) -> int:
        """Keys layer `layer`'s queries see at most (0: the whole sequence). A window no
        shorter than the context never leaves a key out (Phi-4-mini's 262144 over 131072
        positions): 0."""
        binds = self.sliding_window < self.max_position_embeddings
        return self.sliding_window if self.sliding(layer) and binds else 0

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts (else the dense MLP)."""
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    def has_rope(self, layer: int) -> bool:
        return not self.rope_layers or self.rope_layers[layer]

    @property
    def uniform_rope(self) -> bool:
        """Every layer rotates every dim of K by the same table (cached K can be re-rotated
        to a new position)."""
        return (
            self.local_rope_theta is None
            and all(self.rope_layers or [True])
            and self.rope.rotary_dim == self.head_dim
            and (self.rope_scaling is None or self.rope_scaling.type != "longrope")
        )

    @classmethod
    def from_hf(
        cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Build from a config.json dict (and optionally generation_config.json for eos ids).

        Raises ValueError naming the field of an unsupported architecture, activation, RoPE
        scaling or other feature.
        """
        arch = _architecture(cfg)
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        num_layers = int(cfg["num_hidden_layers"])
        attention_bias = bool(cfg.get("attention_bias", False))
        layer_types = _layer_types(cfg, arch, num_layers)
        params = _rope_params(cfg, FULL, DEFAULT_THETA.get(arch, 10000.0))
        theta, scaling, rotary_dim = _rope(params, cfg, head_dim)
        base = dict(
            architecture=arch,
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
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
            layer_types=layer_types if SLIDING in layer_types else (),
            sliding_window=int(cfg["sliding_window"]) if SLIDING in layer_types else 0,
            rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
        )
        return cls(**{**base, **FAMILIES.get(arch, _no_fields)(cfg)})


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(HIDDEN_ACTS)}")
    return str(arch)


def _layer_types(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention kind: the config's `layer_types`, or what transformers derives
    for the family when the file predates that field."""
    if cfg.get("layer_types"):
        types = tuple(str(t) for t in cfg["layer_types"])
        bad = sorted(set(types) - {FULL, SLIDING})
        if bad or len(types) != num_layers:
            raise ValueError(f"unsupported layer_types {list(types)}: {num_layers} of {FULL!r}"
                             f" / {SLIDING!r} expected")  # fmt: skip
        return types if cfg.get("sliding_window") else (FULL,) * num_layers
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", True):  # Mistral has no flag
        return (FULL,) * num_layers
    if arch.startswith("Gemma"):
        every = int(cfg.get("sliding_window_pattern") or (6 if arch.startswith("Gemma3") else 2))
        return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers))
    # Qwen2 / Qwen3: layers from max_window_layers on slide; Qwen3-MoE: every layer does.
    dense_qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    first = int(cfg.get("max_window_layers", 0)) if dense_qwen else 0
    return tuple(SLIDING if i >= first else FULL for i in range(num_layers))


def _rope_params(cfg: dict[str, Any], layer_type: str, theta: float) -> dict[str, Any]:
    """The `rope_parameters` of layers of `layer_type`, from transformers-5's layout (flat or
    per layer type) or the older `rope_theta` / `rope_scaling` fields; `theta` where neither
    gives one (the family's default)."""
    params = cfg.get("rope_parameters")
    if params is None:  # pre-v5 layout: theta at top level, scaling in its own dict
        params = dict(cfg.get("rope_scaling") or {})
    elif isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    else:
        params = dict(params)
    params.setdefault("rope_theta", cfg.get("rope_theta", theta))
    return params


def _rope(
    params: dict[str, Any], cfg: dict[str, Any], head_dim: int
) -> tuple[float, RopeScaling | None, int]:
    """(theta, scaling, rotary_dim) of one rope_parameters dict."""
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"unsupported partial_rotary_factor {partial}: {rotary_dim} rotary dims")
    theta = float(params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None, rotary_dim
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(
            f"unsupported rope scaling type {kind!r}; supported: default, "
            f"{', '.join(ROPE_SCALING_TYPES)}"
        )
    if kind == "linear":
        return theta, RopeScaling(type="linear", factor=float(params["factor"])), rotary_dim
    if kind == "longrope":
        return theta, _longrope(params, cfg, rotary_dim), rotary_dim
    if kind == "yarn":
        return theta, _yarn(params, cfg), rotary_dim
    return (
        theta,
        RopeScaling(
            type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        ),
        rotary_dim,
    )


def _longrope(params: dict[str, Any], cfg: dict[str, Any], rotary_dim: int) -> RopeScaling:
    """Phi-3's longrope, with transformers' defaults for the factor and attention factor."""
    context = int(cfg.get("max_position_embeddings", 2048))
    original = int(
        params.get("original_max_position_embeddings")
        or cfg.get("original_max_position_embeddings")
        or context
    )
    factor = params.get("factor") or context / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (
        tuple(map(float, params["short_factor"])),
        tuple(map(float, params["long_factor"])),
    )
    if len(short) != rotary_dim // 2 or len(long) != rotary_dim // 2:
        raise ValueError(
            f"longrope short_factor / long_factor have {len(short)} / {len(long)} entries; "
            f"{rotary_dim // 2} (rotary dims / 2) expected"
        )
    return RopeScaling(
        type="longrope", factor=float(factor), original_max_position_embeddings=original,
        short_factor=short, long_factor=long, attention_factor=float(attention),
    )  # fmt: skip


def _yarn(params: dict[str, Any], cfg: dict[str, Any]) -> RopeScaling:
    """YaRN with transformers' defaults: the original context from the config's own field or
    the context length, the factor their ratio, the attention factor from the factor (or
    `mscale` / `mscale_all_dim`), betas 32 / 1, truncated bounds."""
    original = int(
        cfg.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or cfg.get("max_position_embeddings", 2048)
    )
    factor = float(params.get("factor") or int(cfg.get("max_position_embeddings", 2048)) / original)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = _yarn_mscale(factor, 1.0)
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return RopeScaling(
        type="yarn", factor=factor, original_max_position_embeddings=original,
        attention_factor=float(attention), beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1), truncate=bool(params.get("truncate", True)),
    )  # fmt: skip


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    """Union (in order of appearance) of config.json and generation_config.json eos ids."""
    ids: list[int] = []
    for source in (cfg.get("eos_token_id"), gen.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def _refuse(cfg: dict[str, Any], field: str, allowed: tuple[Any, ...]) -> None:
    """ValueError naming `field` when the config sets it to a value we do not implement."""
    if cfg.get(field) not in allowed:
        raise ValueError(f"unsupported {field}={cfg[field]!r}: only {allowed} is implemented")


def _no_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return {}


def _qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"qk_norm": True}


def _gemma(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 and 3 (text): see the module docstring."""
    _refuse(cfg, "use_bidirectional_attention", (None, False))
    fields: dict[str, Any] = dict(
        norm_offset=1.0,
        sandwich_norms=True,
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or 0.0),
        final_logit_softcap=float(cfg.get("final_logit_softcapping") or 0.0),
        attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
    )
    if cfg["architectures"][0] == "Gemma3ForCausalLM":
        params = cfg.get("rope_parameters") or {}
        local = params.get(SLIDING)
        if not isinstance(local, dict):  # the older layout: a base, never scaled
            local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 1e4)}
        theta, scaling, _ = _rope(local, cfg, int(cfg.get("head_dim") or 2))
        if scaling is not None:
            raise ValueError(f"unsupported sliding-layer rope scaling {local!r}: default only")
        fields |= {"qk_norm": True, "local_rope_theta": theta}
    return fields


def _smollm3(cfg: dict[str, Any]) -> dict[str, Any]:
    flags = cfg.get("no_rope_layers")  # 1 = the layer applies RoPE (transformers' meaning)
    if not flags:
        return {}
    if len(flags) != int(cfg["num_hidden_layers"]):
        raise ValueError(f"no_rope_layers has {len(flags)} entries for "
                         f"{cfg['num_hidden_layers']} layers")  # fmt: skip
    return {"rope_layers": tuple(bool(f) for f in flags)}


# Config fields of mixtures of experts that change the math and are not implemented, with the
# values that mean "absent": shared experts, other scoring or grouped routing, scaled weights.
MOE_REFUSED: dict[str, tuple[Any, ...]] = {
    "shared_expert_intermediate_size": (None, 0),
    "n_shared_experts": (None, 0),
    "num_shared_experts": (None, 0),
    "moe_shared_expert_intermediate_size": (None, 0),
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "routed_scaling_factor": (None, 1.0),
    "first_k_dense_replace": (None, 0),
}


def _experts(cfg: dict[str, Any], intermediate: int, renormalise: bool) -> dict[str, Any]:
    """The fields every mixture of experts sets: its experts' count and size and the router's
    top-k (`router_jitter_noise`, `output_router_logits` and aux-loss fields act only in
    training)."""
    for field, absent in MOE_REFUSED.items():
        _refuse(cfg, field, absent)
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"unsupported num_experts_per_tok={top_k} with {experts} experts")
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": intermediate, "norm_topk_prob": renormalise}  # fmt: skip


def _qwen3_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's q/k norms; layer i has experts unless it is in `mlp_only_layers` or
    (i + 1) is not a multiple of `decoder_sparse_step` (transformers' rule)."""
    n, step = int(cfg["num_hidden_layers"]), int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(n))
    renormalise = bool(cfg.get("norm_topk_prob", False))
    return {"qk_norm": True, **_experts(cfg, int(cfg["moe_intermediate_size"]), renormalise),
            "moe_layers": () if all(sparse) else sparse}  # fmt: skip


def _olmoe(cfg: dict[str, Any]) -> dict[str, Any]:
    """OLMoE: q/k RMSNorm over the whole projection; experts of `intermediate_size`."""
    _refuse(cfg, "clip_qkv", (None,))
    renormalise = bool(cfg.get("norm_topk_prob", False))
    fields = _experts(cfg, int(cfg["intermediate_size"]), renormalise)
    return {"qk_norm": True, "qk_norm_full": True, **fields}


def _mixtral(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mixtral: top-k of the logits, softmax over those k (= softmax, top-k, renormalise),
    the weights kept in float32."""
    return {**_experts(cfg, int(cfg["intermediate_size"]), True), "routing_weights_f32": True}


def _gpt_oss(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: see the module docstring. Checkpoints whose experts are quantized
    (`quantization_config`, MXFP4 blocks) are refused: only float experts load."""
    _refuse(cfg, "quantization_config", (None,))
    fields = _experts(cfg, int(cfg["intermediate_size"]), True)
    return {**fields, "router_bias": True, "topk_softmax": True, "expert_bias": True,
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
            "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
            "attn_sinks": True, "norm_weight_f32": True}  # fmt: skip


FAMILIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "GptOssForCausalLM": _gpt_oss,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "OlmoeForCausalLM": _olmoe,
    "MixtralForCausalLM": _mixtral,
    "Qwen3ForCausalLM": _qwen3,
    "Gemma2ForCausalLM": _gemma,
    "Gemma3ForCausalLM": _gemma,
    "SmolLM3ForCausalLM": _smollm3,
}
