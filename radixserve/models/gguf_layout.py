"""What llama.cpp's converter (convert_hf_to_gguf.py) writes for an HF model, from its
transformers config alone: the GGUF architecture, the `{arch}.*` metadata keys, the RoPE
parameter tensors and the name and shape of every weight tensor. For files made in place
(tests, benchmarks/make_gguf.py); radixserve/models/gguf_config.py reads these keys back.

    architecture  HF model_type -> general.architecture (GGUF_ARCHITECTURES)
    metadata      TextModel.set_gguf_parameters' keys (block count, context, sizes, heads,
                  RoPE base and linear scaling, RMS epsilon, head_dim as key/value length);
                  + LlamaModel's vocabulary size and rotary dimensions (llama, smollm3);
                  + Gemma3Model's sliding window, Gemma2Model's and its soft caps;
                  + the expert counts of every mixture of experts (Mixtral's file is a
                  llama one with them), Qwen2MoeModel's expert rows (qwen3moe);
                  + YaRN's keys, and GptOssModel's window and expert rows (gpt-oss);
                  Phi3MiniModel writes its own (partial
                  rotary dimensions, original context, longrope attention factor, window)
    RoPE tensors  Phi-3 longrope's factors: rope_factors_long / _short.weight (F32)
    weights       HF tensors under llama.cpp's names (`tensor_dims`); Phi-3's q/k/v and
                  gate/up stay fused (attn_qkv, ffn_up: gate rows, then up rows); a mixture
                  of experts' experts stacked per layer (ffn_{gate,up,down}_exps, (E, rows,
                  cols)) beside its router ffn_gate_inp; gpt-oss's biases of those, and
                  its attn_sinks

Values are the caller's: the converter stores Gemma's RMSNorm weights as 1 + w, and permutes
the q/k rows of llama and smollm3 (radixserve/models/gguf_weights.py undoes both).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFWriter, RopeScalingType

# HF model_type -> llama.cpp's architecture name for it.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3_text": "gemma3", "phi3": "phi3", "smollm3": "smollm3",
                      "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "gpt_oss": "gpt-oss",
                      "mixtral": "llama"}  # fmt: skip
LLAMA_KEYS = ("llama", "smollm3")  # LlamaModel's converter (SmolLM3Model is one) adds keys
# Per-layer norms besides attn_norm: llama.cpp's name -> the size it normalizes ("hidden"
# or "head": q/k norms act on each head). Gemma 3's ffn_norm is its pre-feedforward norm.
GEMMA_NORMS = {"post_attention_norm": "hidden", "ffn_norm": "hidden", "post_ffw_norm": "hidden"}
LAYER_NORMS = {
    "gemma2": GEMMA_NORMS,
    "gemma3": {"attn_q_norm": "head", "attn_k_norm": "head", **GEMMA_NORMS},
    "qwen3": {"attn_q_norm": "head", "attn_k_norm": "head", "ffn_norm": "hidden"},
    "qwen3moe": {"attn_q_norm": "head", "attn_k_norm": "head", "ffn_norm": "hidden"},
    "olmoe": {"attn_q_norm": "q", "attn_k_norm": "kv", "ffn_norm": "hidden"},  # whole rows
    "gpt-oss": {"post_attention_norm": "hidden"},  # its norm before the experts
}  # fmt: skip
OLMOE_RMS_EPS = 1e-5  # OlmoeModel.set_gguf_parameters writes this, whatever the config says
PLAIN_NORMS = {"ffn_norm": "hidden"}


def gguf_architecture(cfg: Any) -> str:
    """llama.cpp's architecture for the transformers config `cfg`; ValueError for a model
    type not listed in GGUF_ARCHITECTURES."""
    if cfg.model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"no llama.cpp architecture listed for model_type {cfg.model_type!r}")
    return GGUF_ARCHITECTURES[cfg.model_type]


def write_metadata(w: GGUFWriter, cfg: Any) -> None:
    """The `{arch}.*` keys llama.cpp's converter writes for `cfg` (`w` made for
    gguf_architecture(cfg))."""
    if w.arch == "phi3":
        _phi3_metadata(w, cfg)
    else:
        _text_metadata(w, cfg)


def _text_metadata(w: GGUFWriter, cfg: Any) -> None:
    """TextModel.set_gguf_parameters' keys (+ LlamaModel's, + Gemma3Model's window)."""
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma: global's
    _sizes(w, cfg)
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "yarn":
        _yarn_metadata(w, rope)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "head_dim", None) is not None:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if w.arch in LLAMA_KEYS:
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    if w.arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if w.arch == "gemma2":  # Gemma2Model's keys
        w.add_sliding_window(cfg.sliding_window)
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if getattr(cfg, "num_experts_per_tok", 0):  # TextModel's expert keys
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    if w.arch == "qwen3moe":
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if w.arch == "olmoe":
        w.add_layer_norm_rms_eps(OLMOE_RMS_EPS)
    if w.arch == "gpt-oss":  # GptOssModel's keys
        w.add_sliding_window(cfg.sliding_window)
        w.add_expert_feed_forward_length(cfg.intermediate_size)


def _yarn_metadata(w: GGUFWriter, rope: dict[str, Any]) -> None:
    """TextModel's YaRN keys: type, factor, original context, and the parameters present."""
    w.add_rope_scaling_type(RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("attention_factor") is not None:
        w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
    if rope.get("beta_fast") is not None:
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    if rope.get("beta_slow") is not None:
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


def _sizes(w: GGUFWriter, cfg: Any) -> None:
    """The keys every converter writes: depth, context, widths and head counts."""
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)


def _phi3_metadata(w: GGUFWriter, cfg: Any) -> None:
    """Phi3MiniModel.set_gguf_parameters' keys."""
    rope = cfg.rope_parameters
    rotary = int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads
    original = rope["original_max_position_embeddings"]
    _sizes(w, cfg)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(rotary)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(cfg.sliding_window or 0)
    scale = cfg.max_position_embeddings / original
    w.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(original)))


def rope_tensors(cfg: Any) -> dict[str, np.ndarray]:
    """The RoPE parameters the converter writes as F32 tensors (Phi3MiniModel's
    generate_extra_tensors: longrope's per-frequency factors), name -> values; {} for the
    other architectures."""
    rope = cfg.rope_parameters
    if cfg.model_type != "phi3" or rope.get("rope_type") != "longrope":
        return {}
    return {
        "rope_factors_long.weight": np.array(rope["long_factor"], dtype=np.float32),
        "rope_factors_short.weight": np.array(rope["short_factor"], dtype=np.float32),
    }


def tensor_dims(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every weight tensor the converter writes for `cfg` (RoPE tensors aside): llama.cpp's
    name -> dims in numpy order ((rows, cols) for a matrix: out, in features). No output
    matrix when the embedding is tied."""
    arch = gguf_architecture(cfg)
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    dims: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, hidden)}
    for i in range(cfg.num_hidden_layers):
        dims |= {f"blk.{i}.{name}": d for name, d in _layer_dims(cfg, arch, i).items()}
    dims["output_norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        dims["output.weight"] = (vocab, hidden)
    return dims


def _layer_dims(cfg: Any, arch: str, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s tensors, names without the `blk.{i}.` prefix."""
    hidden, ffn = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    sizes = {"hidden": hidden, "head": head_dim, "q": q, "kv": kv}
    dims: dict[str, tuple[int, ...]] = {"attn_norm.weight": (hidden,)}
    norms = LAYER_NORMS.get(arch, PLAIN_NORMS)
    dims |= {f"{name}.weight": (sizes[size],) for name, size in norms.items()}
    moe = layer in _moe_layers(cfg)
    if arch == "phi3":
        dims |= {"attn_qkv.weight": (q + 2 * kv, hidden), "ffn_up.weight": (2 * ffn, hidden)}
    else:
        rows = {"attn_q": q, "attn_k": kv, "attn_v": kv}
        dims |= {f"{name}.weight": (n, hidden) for name, n in rows.items()}
        if not moe:
            dims |= {f"{name}.weight": (ffn, hidden) for name in ("ffn_gate", "ffn_up")}
        dims |= {f"{name}.bias": (n,) for name, n in _biases(cfg, arch, rows).items()}
    dims["attn_output.weight"] = (hidden, q)
    dims |= _expert_dims(cfg) if moe else {"ffn_down.weight": (hidden, ffn)}
    if arch == "gpt-oss":
        dims |= _gpt_oss_dims(cfg)
    if getattr(cfg, "attention_bias", False):  # Qwen2's config has no such field: no o bias
        dims["attn_output.bias"] = (hidden,)
    return dims


def _moe_layers(cfg: Any) -> set[int]:
    """The layers with experts (transformers' rule: Qwen3-MoE's mlp_only_layers and
    decoder_sparse_step; every layer of the others)."""
    if not getattr(cfg, "num_experts_per_tok", 0):
        return set()
    dense, step = set(getattr(cfg, "mlp_only_layers", [])), getattr(cfg, "decoder_sparse_step", 1)
    n = cfg.num_hidden_layers
    return {i for i in range(n) if i not in dense and (i + 1) % step == 0}


def _expert_dims(cfg: Any) -> dict[str, tuple[int, ...]]:
    """A MoE layer's router (F32 in llama.cpp's files) and stacked experts."""
    e, hidden = cfg.num_experts, cfg.hidden_size
    rows = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    return {"ffn_gate_inp.weight": (e, hidden), "ffn_gate_exps.weight": (e, rows, hidden),
            "ffn_up_exps.weight": (e, rows, hidden),
            "ffn_down_exps.weight": (e, hidden, rows)}  # fmt: skip


def _gpt_oss_dims(cfg: Any) -> dict[str, tuple[int, ...]]:
    """gpt-oss's sinks and the biases of its router and experts."""
    e, rows = cfg.num_experts, cfg.intermediate_size
    return {"attn_sinks.weight": (cfg.num_attention_heads,), "ffn_gate_inp.bias": (e,),
            "ffn_gate_exps.bias": (e, rows), "ffn_up_exps.bias": (e, rows),
            "ffn_down_exps.bias": (e, cfg.hidden_size)}  # fmt: skip


def _biases(cfg: Any, arch: str, rows: dict[str, int]) -> dict[str, int]:
    """q/k/v biases: Qwen2 always has them, the others as `attention_bias` says."""
    return rows if arch == "qwen2" or getattr(cfg, "attention_bias", False) else {}
