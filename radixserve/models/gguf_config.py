"""GGUF metadata -> the HF config.json of the checkpoint a file was converted from, for the
llama.cpp architectures whose files transformers cannot turn into an exact HF config
(`READERS`: qwen3, gemma2, gemma3, phi3, smollm3, qwen3moe, olmoe, gpt-oss, and Mixtral,
whose files are llama ones with experts), and the RoPE parameters llama.cpp writes as
tensors.

What a file says, and where it says it, follows llama.cpp's converter (convert_hf_to_gguf.py,
now conversion/*.py: TextModel.set_gguf_parameters and each family's class) and its loader
(src/llama-model.cpp, llama_model::load_hparams):

    generic     {arch}.block_count, .embedding_length, .feed_forward_length, .context_length,
                .attention.head_count(_kv), .attention.key_length (head_dim),
                .attention.layer_norm_rms_epsilon, .rope.freq_base, .rope.scaling.type /
                .factor (absent type: linear; factor 0 or 1: none); tied embeddings = no
                `output.weight`; biases = their tensors
    qwen3       nothing more (q/k norms are tensors); Llama-3 scaling as rope_freqs.weight
    gemma2      every even layer slides (with .attention.sliding_window); soft caps
                .attn_logit_softcapping / .final_logit_softcapping (llama.cpp's defaults 50
                and 30 when absent); query scale as gemma3's, 27B at 46 layers
    gemma3      sliding layers: with .attention.sliding_window, layer i slides unless it ends a
                period of .attention.sliding_window_pattern (default 6; or a bool per layer);
                sliding layers use RoPE base .rope.freq_base_swa (default 10000) unscaled;
                query_pre_attn_scalar = hidden / heads for 62 layers (27B), else head_dim
    phi3        .rope.dimension_count < head_dim: partial rotary; longrope's factors are the
                tensors rope_factors_long/short.weight, with .rope.scaling.original_context_length
                and .rope.scaling.attn_factor; .attention.sliding_window (0: none)
    smollm3     RoPE skipped in every 4th layer (llama.cpp fixes n_no_rope_layer_step = 4: no
                key says it)
    qwen3moe    .expert_count, .expert_used_count, .expert_feed_forward_length (each expert's
                rows); top-k weights renormalised (llama.cpp's graph fixes it); a layer
                without `ffn_gate_inp` is dense
    olmoe       .expert_count, .expert_used_count; experts of .feed_forward_length rows, not
                renormalised; q/k norms over the whole projection (their tensors' sizes)
    mixtral     a llama file with .expert_count and .expert_used_count (llama.cpp's converter
                writes Mixtral as llama): experts of .feed_forward_length rows, top-k
                weights renormalised (llama.cpp's llama graph fixes it); no sliding window
                (llama.cpp has none for it)
    gpt-oss     .expert_count, .expert_used_count, .expert_feed_forward_length (=
                .feed_forward_length); .attention.sliding_window, layer i sliding unless it
                ends a period of .attention.sliding_window_pattern (default 2); YaRN from
                .rope.scaling.type / .factor / .original_context_length / .yarn_beta_fast /
                .yarn_beta_slow / .yarn_attn_factor; the router, experts and sinks as tensors

Every `{arch}.*` key must be read by the family's reader: any other key (Gemma 3's logit
soft-capping, expert counts outside a MoE architecture, shared experts, a pooling type, YaRN
parameters, ...) changes the math in a way the config would not say, so it raises ValueError
naming the key and its value, as does a value the HF model cannot express (an unknown RoPE
scaling type, partial rotary in Qwen3).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf.quants import dequantize as gguf_dequantize

from radixserve.models.gguf_weights import (
    NOT_WEIGHTS,
    ROPE_FACTORS,
    ROPE_FREQS,
    gguf_metadata,
    gguf_tensors,
)

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
                 "gpt-oss": "GptOssForCausalLM", "mixtral": "MixtralForCausalLM"}  # fmt: skip
TOKEN_IDS = {"tokenizer.ggml.bos_token_id": "bos_token_id",
             "tokenizer.ggml.eos_token_id": "eos_token_id",
             "tokenizer.ggml.padding_token_id": "pad_token_id"}  # fmt: skip
# Keys that change nothing the HF model computes: the vocabulary size is the embedding's
# rows; `finetuned` is a note; the original context matters only to YaRN (refused).
HARMLESS = ("vocab_size", "rope.scaling.finetuned", "rope.scaling.original_context_length")
# Llama-3 scaling's parameters besides its factor: the same in every Llama 3.1 / 3.2 / 3.3.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
GEMMA3_PERIOD, GEMMA3_LOCAL_THETA = 6, 10000.0  # llama.cpp's defaults (load_hparams)
GEMMA3_27B_LAYERS = 62  # llama.cpp scales its queries by (hidden / heads) ** -0.5
GEMMA2_27B_LAYERS, GEMMA2_PERIOD = 46, 2  # likewise; layer i slides when i % 2 == 0
GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp: layer i skips RoPE when (i + 1) % 4 == 0
SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
GPT_OSS_PERIOD = 2  # llama.cpp's default swa period for gpt-oss: even layers slide
# Whether llama.cpp renormalises the top-k routing weights (its graph fixes it per
# architecture: build_moe_ffn's norm_w), which is HF's norm_topk_prob.
RENORMALISED = {"qwen3moe": True, "olmoe": False, "llama": True}
FULL, SLIDING = "full_attention", "sliding_attention"


class Metadata:
    """One file's `{arch}.*` metadata (keys without the prefix), tensor shapes (numpy order)
    and RoPE tensors; remembers what the reader used, so `check_all_used` refuses the rest."""

    def __init__(
        self, arch: str, metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]],
        rope_tensors: dict[str, np.ndarray],
    ) -> None:  # fmt: skip
        self.arch, self.shapes, self.rope_tensors = arch, shapes, rope_tensors
        prefix = arch + "."
        self.values = {k[len(prefix) :]: v for k, v in metadata.items() if k.startswith(prefix)}
        self.token_ids = {name: int(metadata[k]) for k, name in TOKEN_IDS.items() if k in metadata}
        self.used: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        return self.values.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.values:
            raise ValueError(f"{self.arch}.{key} is missing from the GGUF metadata")
        return self.get(key)

    def decimal(self, key: str, default: float | None = None) -> float:
        value = self.need(key) if default is None else self.get(key, default)
        return f32_decimal(value)

    def uniform(self, key: str, default: int | None = None) -> int:
        """An int that llama.cpp allows per layer (an array): one value for every layer."""
        value = self.need(key) if default is None else self.get(key, default)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise self.refuse(key, "differs between layers; the HF model has one value")
            value = value[0]
        return int(value)

    def tensor(self, name: str) -> np.ndarray | None:
        self.used.add(name)
        return self.rope_tensors.get(name)

    def refuse(self, key: str, why: str) -> ValueError:
        value = self.values.get(key)
        return ValueError(f"{self.arch}.{key} = {value!r} in the GGUF metadata: {why}")

    def check_all_used(self) -> None:
        """Raises ValueError naming the first key (and the other keys) or RoPE tensor that
        no reader used."""
        unused = sorted(set(self.values) - self.used)
        if unused:
            others = f" (nor {', '.join(unused[1:])})" if len(unused) > 1 else ""
            raise self.refuse(unused[0], f"radixserve does not read this {self.arch} key{others};"
                              " it would change the model's math unseen")  # fmt: skip
        tensors = sorted(set(self.rope_tensors) - self.used)
        if tensors:
            raise ValueError(f"{tensors[0]} in a {self.arch} GGUF: RoPE factors its HF model lacks")


def f32_decimal(value: float) -> float:
    """An F32 metadata value as the shortest decimal that rounds to it (1e-06, not
    9.99999997e-07): the number the converter was given, when that had no more digits."""
    return float(str(np.float32(value)))


def family(arch: str, metadata: dict[str, Any]) -> str:
    """The READERS entry for a file of `arch` with this metadata: its architecture, or
    "mixtral" for a llama file with experts."""
    return "mixtral" if arch == "llama" and "llama.expert_count" in metadata else arch


def reads_config(path: Path) -> bool:
    """Whether radixserve reads the config of the GGUF at `path` (else transformers does)."""
    return family(gguf_tensors(path).architecture, gguf_metadata(path)) in READERS


def hf_config(path: Path) -> dict[str, Any]:
    """config.json of the GGUF at `path`, one `reads_config` accepts. Raises ValueError
    naming metadata the HF config cannot express (module docstring)."""
    file = gguf_tensors(path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in file.tensors}
    return config_from_metadata(file.architecture, gguf_metadata(path), shapes, rope_tensors(path))


def rope_tensors(path: Path) -> dict[str, np.ndarray]:
    """The file's RoPE-parameter tensors (NOT_WEIGHTS), name -> float64 values."""
    return {
        t.name: gguf_dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
        for t in gguf_tensors(path).tensors
        if t.name in NOT_WEIGHTS
    }


def config_from_metadata(
    arch: str, metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]],
    rope_tensors: dict[str, np.ndarray],
) -> dict[str, Any]:  # fmt: skip
    """The HF config dict a file of `arch` with this metadata, tensor shapes (numpy order)
    and RoPE tensors was converted from."""
    name = family(arch, metadata)
    if name not in READERS:
        raise ValueError(f"GGUF architecture {arch!r}: configs are read for {', '.join(READERS)}")
    m = Metadata(arch, metadata, shapes, rope_tensors)
    cfg = READERS[name](m)
    m.check_all_used()
    # Token ids the file lacks are None, not the HF class's defaults (another vocabulary's).
    ids = {key: m.token_ids.get(key) for key in TOKEN_IDS.values()}
    return {"architectures": [ARCHITECTURES[name]], **cfg, **ids}


def _base(m: Metadata) -> dict[str, Any]:
    """The fields every family reads the same way (llama.cpp's generic keys)."""
    hidden, heads = int(m.need("embedding_length")), m.uniform("attention.head_count")
    head_dim = int(m.get("attention.key_length", hidden // heads))
    if m.get("attention.value_length", head_dim) != head_dim:
        raise m.refuse("attention.value_length", f"differs from the key length {head_dim}")
    for key in HARMLESS:
        m.get(key)
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(m.need("block_count")),
        "intermediate_size": m.uniform("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.uniform("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "vocab_size": m.shapes["token_embd.weight"][0],  # (vocab, hidden)
        "rms_norm_eps": m.decimal("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": int(m.need("context_length")),
        "tie_word_embeddings": "output.weight" not in m.shapes,
        "attention_bias": "blk.0.attn_q.bias" in m.shapes,
    }


def _whole_head_rotates(m: Metadata, head_dim: int) -> None:
    if m.get("rope.dimension_count", head_dim) != head_dim:
        raise m.refuse("rope.dimension_count", f"partial rotary (head_dim {head_dim}) is not "
                       f"in the HF {m.arch} model")  # fmt: skip


def _scaling(m: Metadata) -> dict[str, Any]:
    """rope_parameters' scaling fields: {} or linear's. llama.cpp reads the type (absent:
    linear), the factor (0 or 1: none) and a cos/sin multiplier attn_factor (1: none)."""
    kind = m.get("rope.scaling.type")
    factor = f32_decimal(m.get("rope.scaling.factor", m.get("rope.scale_linear")) or 0.0)
    if m.get("rope.scaling.attn_factor", 1.0) != 1.0:
        raise m.refuse("rope.scaling.attn_factor", "not in the HF model without longrope")
    if kind in (None, "linear") and factor not in (0.0, 1.0):
        return {"rope_type": "linear", "factor": factor}
    if kind in (None, "none", "linear"):
        return {}
    raise m.refuse("rope.scaling.type", "only none and linear RoPE scaling are read")


def _rope(m: Metadata, head_dim: int) -> dict[str, Any]:
    """rope_parameters of a family whose whole head rotates with one base: default, linear,
    or Llama-3 scaling (written as the rope_freqs.weight tensor)."""
    _whole_head_rotates(m, head_dim)
    theta, scaling = m.decimal("rope.freq_base", 10000.0), _scaling(m)
    divisors = m.tensor(ROPE_FREQS)
    if divisors is None:
        return {"rope_type": "default", "rope_theta": theta, **scaling}
    if scaling:
        raise m.refuse("rope.scaling.factor", f"linear scaling on top of {ROPE_FREQS}")
    return llama3_parameters(divisors, theta, head_dim, m.arch)


def _qwen3(m: Metadata) -> dict[str, Any]:
    cfg = _base(m)
    return {"model_type": "qwen3", **cfg, "rope_parameters": _rope(m, cfg["head_dim"])}


def _experts(m: Metadata) -> dict[str, Any]:
    """A mixture of experts' counts and routing. Softmax gating and llama.cpp's fixed
    renormalisation are all it runs: a file saying otherwise is refused."""
    if m.get("expert_gating_func", SOFTMAX_GATING) != SOFTMAX_GATING:
        raise m.refuse("expert_gating_func", "only softmax routing is implemented")
    renormalised = RENORMALISED[m.arch]
    if bool(m.get("expert_weights_norm", renormalised)) != renormalised:
        raise m.refuse("expert_weights_norm", f"llama.cpp's {m.arch} graph fixes it at "
                       f"{renormalised}")  # fmt: skip
    return {"num_experts": int(m.need("expert_count")),
            "num_experts_per_tok": int(m.need("expert_used_count")),
            "norm_topk_prob": renormalised}  # fmt: skip


def _qwen3moe(m: Metadata) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's keys, the experts' and their rows (.expert_feed_forward_length);
    a layer without a router (`ffn_gate_inp`) is a dense MLP of .feed_forward_length."""
    cfg = _base(m)
    n = cfg["num_hidden_layers"]
    dense = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" not in m.shapes]
    return {
        "model_type": "qwen3_moe", **cfg, **_experts(m),
        "moe_intermediate_size": int(m.need("expert_feed_forward_length")),
        "mlp_only_layers": dense, "decoder_sparse_step": 1, "use_sliding_window": False,
        "rope_parameters": _rope(m, cfg["head_dim"]),
    }  # fmt: skip


def _olmoe(m: Metadata) -> dict[str, Any]:
    """OLMoE: experts of .feed_forward_length rows; head_dim is hidden / heads (its q/k norms
    span hidden and hidden / heads * KV heads)."""
    cfg = _base(m)
    head_dim = cfg.pop("head_dim")
    if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
        raise m.refuse("attention.key_length", "OLMoE's head_dim is hidden / heads")
    return {"model_type": "olmoe", **cfg, **_experts(m), "clip_qkv": None,
            "rope_parameters": _rope(m, head_dim)}  # fmt: skip


def _mixtral(m: Metadata) -> dict[str, Any]:
    """Mixtral (a llama file with experts): experts of .feed_forward_length rows, the whole
    head rotated, no attention biases (HF's Mixtral has none)."""
    cfg = _base(m)
    if cfg.pop("attention_bias"):
        raise ValueError("blk.0.attn_q.bias in a Mixtral GGUF: HF's Mixtral has no attention bias")
    rows = cfg["intermediate_size"]
    if m.get("expert_feed_forward_length", rows) != rows:
        raise m.refuse("expert_feed_forward_length", f"Mixtral's experts have {rows} rows")
    experts = _experts(m)
    del experts["norm_topk_prob"]  # HF's Mixtral always renormalises; no field says it
    return {"model_type": "mixtral", **cfg, **experts, "sliding_window": None,
            "rope_parameters": _rope(m, cfg["head_dim"])}  # fmt: skip


def _smollm3(m: Metadata) -> dict[str, Any]:
    cfg = _base(m)
    n = cfg["num_hidden_layers"]
    return {
        "model_type": "smollm3", **cfg, "rope_parameters": _rope(m, cfg["head_dim"]),
        "no_rope_layers": [int((i + 1) % SMOLLM3_NO_ROPE_STEP != 0) for i in range(n)],
        "no_rope_layer_interval": SMOLLM3_NO_ROPE_STEP,
        "mlp_bias": "blk.0.ffn_up.bias" in m.shapes,
        "use_sliding_window": False,
    }  # fmt: skip


def _gemma3(m: Metadata) -> dict[str, Any]:
    cfg = _base(m)
    n, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    _whole_head_rotates(m, head_dim)
    window = int(m.get("attention.sliding_window", 0))
    full = {"rope_type": "default", "rope_theta": m.decimal("rope.freq_base", 10000.0)}
    local = {"rope_type": "default",
             "rope_theta": m.decimal("rope.freq_base_swa", GEMMA3_LOCAL_THETA)}  # fmt: skip
    # llama.cpp: f_attention_scale = 1 / sqrt(n_embd / n_head) for 27B (integer division)
    wide = cfg["hidden_size"] // cfg["num_attention_heads"]
    return {
        "model_type": "gemma3_text", **cfg,
        "query_pre_attn_scalar": wide if n == GEMMA3_27B_LAYERS else head_dim,
        "sliding_window": window or None,
        "layer_types": _gemma_layer_types(m, n, window, GEMMA3_PERIOD),
        "rope_parameters": {"full_attention": {**full, **_scaling(m)}, "sliding_attention": local},
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }  # fmt: skip


def _gemma2(m: Metadata) -> dict[str, Any]:
    cfg = _base(m)
    n, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    window = int(m.get("attention.sliding_window", 0))
    wide = cfg["hidden_size"] // cfg["num_attention_heads"]
    caps = {key: m.decimal(key, default) for key, default in GEMMA2_SOFTCAPS.items()}
    return {
        "model_type": "gemma2", **cfg, **caps,
        "query_pre_attn_scalar": wide if n == GEMMA2_27B_LAYERS else head_dim,
        "sliding_window": window or None,
        "layer_types": _gemma_layer_types(m, n, window, GEMMA2_PERIOD),
        "rope_parameters": _rope(m, head_dim),
    }  # fmt: skip


def _gemma_layer_types(m: Metadata, n: int, window: int, period: int) -> list[str]:
    """Without a window every layer is global; with one, layer i slides unless it ends a
    period (llama_hparams::set_swa_pattern: i % period < period - 1), or as the per-layer
    bools say."""
    pattern = m.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != n:
            raise m.refuse("attention.sliding_window_pattern", f"not one bool per layer ({n})")
        sliding = [bool(s) for s in pattern]
    else:
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(n)]
    return [SLIDING if s and window else FULL for s in sliding]


def _phi3(m: Metadata) -> dict[str, Any]:
    cfg = _base(m)
    head_dim = cfg.pop("head_dim")
    if head_dim != cfg["hidden_size"] // cfg["num_attention_heads"]:
        raise m.refuse("attention.key_length", "Phi-3's head_dim is hidden / heads")
    if cfg.pop("attention_bias"):
        raise ValueError(f"{m.arch} GGUF with attention biases: Phi-3 has none")
    rotary = int(m.get("rope.dimension_count", head_dim))
    factor = rotary / head_dim
    if int(head_dim * factor) != rotary or rotary % 2:
        raise m.refuse("rope.dimension_count", f"not an even fraction of head_dim {head_dim}")
    context = cfg["max_position_embeddings"]
    original = int(m.get("rope.scaling.original_context_length", context))
    rope = {"rope_type": "default", "rope_theta": m.decimal("rope.freq_base", 10000.0),
            "partial_rotary_factor": factor}  # fmt: skip
    return {
        "model_type": "phi3", **cfg, "original_max_position_embeddings": original,
        "sliding_window": int(m.get("attention.sliding_window", 0)) or None,
        "rope_parameters": {**rope, **_longrope(m, context, original)},
    }  # fmt: skip


def _longrope(m: Metadata, context: int, original: int) -> dict[str, Any]:
    """Phi-3's longrope fields, {} without its factor tensors. llama.cpp's converter derives
    attn_factor as HF does from context / original; it is kept only if it differs."""
    long, short = (m.tensor(name) for name in ROPE_FACTORS)
    kind, attn = m.get("rope.scaling.type"), m.get("rope.scaling.attn_factor")
    if m.get("rope.scaling.factor", 0.0) not in (0.0, 1.0):
        raise m.refuse("rope.scaling.factor", "Phi-3 has no linear RoPE scaling")
    if long is None and short is None:
        if kind not in (None, "none"):
            raise m.refuse("rope.scaling.type", f"without {' / '.join(ROPE_FACTORS)}")
        if attn not in (None, 1.0):
            raise m.refuse("rope.scaling.attn_factor", "not in the HF model without longrope")
        return {}
    if long is None or short is None:
        raise ValueError(f"{m.arch} GGUF with only one of {' / '.join(ROPE_FACTORS)}")
    if kind not in (None, "longrope"):
        raise m.refuse("rope.scaling.type", "Phi-3's RoPE factors are longrope's")
    fields: dict[str, Any] = {
        "rope_type": "longrope", "long_factor": [f32_decimal(x) for x in long],
        "short_factor": [f32_decimal(x) for x in short],
        "original_max_position_embeddings": original,
    }  # fmt: skip
    if attn is not None and not math.isclose(
        attn, _longrope_attention(context, original), rel_tol=1e-6
    ):
        fields["attention_factor"] = f32_decimal(attn)
    return fields


def _longrope_attention(context: int, original: int) -> float:
    """HF's default longrope attention factor (and llama.cpp converter's attn_factor)."""
    scale = context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0


def _gpt_oss(m: Metadata) -> dict[str, Any]:
    """gpt-oss: experts of .feed_forward_length rows (llama.cpp reads them from
    .expert_feed_forward_length: the two must agree), alternating windows, YaRN with one
    RoPE base."""
    cfg = _base(m)
    n, head_dim = cfg["num_hidden_layers"], cfg["head_dim"]
    if int(m.need("expert_feed_forward_length")) != cfg["intermediate_size"]:
        raise m.refuse("expert_feed_forward_length", "differs from .feed_forward_length (the"
                       " HF model's intermediate_size is both)")  # fmt: skip
    _whole_head_rotates(m, head_dim)
    theta = m.decimal("rope.freq_base", 10000.0)
    if m.get("rope.freq_base_swa", theta) != theta:
        raise m.refuse("rope.freq_base_swa", "the HF model has one RoPE base")
    window = int(m.need("attention.sliding_window"))
    return {
        "model_type": "gpt_oss", **cfg, "num_local_experts": int(m.need("expert_count")),
        "num_experts_per_tok": int(m.need("expert_used_count")), "sliding_window": window,
        "layer_types": _gemma_layer_types(m, n, window, GPT_OSS_PERIOD),
        "rope_parameters": {"rope_theta": theta, **_yarn(m)},
    }  # fmt: skip


def _yarn(m: Metadata) -> dict[str, Any]:
    """YaRN's rope_parameters. The converter writes no `truncate`: every gpt-oss checkpoint
    has it false, as its transformers config defaults it."""
    if m.get("rope.scaling.type") != "yarn":
        raise m.refuse("rope.scaling.type", "gpt-oss's RoPE is YaRN")
    params = {
        "rope_type": "yarn", "factor": m.decimal("rope.scaling.factor"),
        "original_max_position_embeddings": int(m.need("rope.scaling.original_context_length")),
        "beta_fast": m.decimal("rope.scaling.yarn_beta_fast", 32.0),
        "beta_slow": m.decimal("rope.scaling.yarn_beta_slow", 1.0), "truncate": False,
    }  # fmt: skip
    if m.get("rope.scaling.yarn_attn_factor") is not None:
        params["attention_factor"] = m.decimal("rope.scaling.yarn_attn_factor")
    return params


READERS: dict[str, Callable[[Metadata], dict[str, Any]]] = {
    "qwen3": _qwen3, "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "smollm3": _smollm3,
    "qwen3moe": _qwen3moe, "olmoe": _olmoe, "gpt-oss": _gpt_oss, "mixtral": _mixtral,
}  # fmt: skip


def llama3_rope_parameters(path: Path, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The Llama-3 `rope_parameters` a GGUF's `rope_freqs.weight` was made from, or None when
    the file has no such tensor."""
    divisors = rope_tensors(path).get(ROPE_FREQS)
    return None if divisors is None else llama3_parameters(divisors, theta, head_dim, str(path))


def llama3_parameters(
    divisors: np.ndarray, theta: float, head_dim: int, where: str
) -> dict[str, Any]:
    """Llama-3 `rope_parameters` whose per-frequency divisors are `divisors` (the factor is
    the largest). Raises ValueError, naming `where`, when they are not Llama-3 scaling with
    the standard parameters (LLAMA3_ROPE)."""
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": float(divisors.max()),
              **LLAMA3_ROPE}  # fmt: skip
    want = llama3_divisors(params, head_dim)
    if want.shape != divisors.shape or not np.allclose(want, divisors, rtol=1e-5):
        raise ValueError(
            f"{where}: {ROPE_FREQS} is not Llama-3 RoPE scaling with {LLAMA3_ROPE}: unsupported"
        )
    return params


def llama3_divisors(params: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per rotary frequency (head_dim / 2), what Llama-3 scaling divides it by (1 for short
    wavelengths, `factor` for long ones, a smooth blend between): llama.cpp's rope_freqs."""
    freqs = params["rope_theta"] ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blend))
