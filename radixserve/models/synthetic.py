"""Models made in place, for tests and benchmarks: a tiny random HF checkpoint with the
embedded tokenizer, random blocks of the quantized formats, and the embedded tokenizer copied
into a GGUF being written. Nothing here is downloaded."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFWriter, TokenType

from radixserve.models.quant import FORMATS
from radixserve.models.resolve import EMBEDDED_GGUF, embedded_gguf

# Tiny configs of each family (transformers config class, its fields beyond TINY): small
# windows, partial rotary, longrope's original context and no-RoPE layers placed where a
# test's prompts of ~20-60 tokens cross them.
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)  # fmt: skip
SLIDING, FULL = "sliding_attention", "full_attention"
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {"num_hidden_layers": 2}),
    "qwen2": ("Qwen2Config", {  # layer 0 full, layer 1 sliding
        "num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 16,
        "max_window_layers": 1,
    }),
    "mistral": ("MistralConfig", {"num_hidden_layers": 2, "sliding_window": 16}),
    "qwen3": ("Qwen3Config", {"num_hidden_layers": 2, "head_dim": 32}),
    "gemma3": ("Gemma3TextConfig", {
        "num_hidden_layers": 4, "head_dim": 32, "query_pre_attn_scalar": 24,
        "sliding_window": 16, "layer_types": [SLIDING, FULL, SLIDING, SLIDING],
        "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                            FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}},
    }),
    "gemma2": ("Gemma2Config", {
        "num_hidden_layers": 2, "head_dim": 16, "sliding_window": 16,
        "attn_logit_softcapping": 1.5, "final_logit_softcapping": 5.0,
    }),
    "phi3": ("Phi3Config", {
        "num_hidden_layers": 2, "partial_rotary_factor": 0.5,
        "original_max_position_embeddings": 64,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "short_factor": [1.0, 1.1, 1.3, 1.7],
                            "long_factor": [2.0, 3.0, 4.0, 5.0]},
    }),
    "smollm3": ("SmolLM3Config", {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]}),
    # mixtures of experts: 8 experts, 2 a token; Qwen3-MoE's layer 1 a dense MLP
    "qwen3_moe": ("Qwen3MoeConfig", {
        "num_hidden_layers": 3, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1],
    }),
    "olmoe": ("OlmoeConfig", {"num_hidden_layers": 2, "num_experts": 8,
                              "num_experts_per_tok": 2, "intermediate_size": 32}),
    "mixtral": ("MixtralConfig", {"num_hidden_layers": 2, "num_local_experts": 8,
                                  "num_experts_per_tok": 2, "intermediate_size": 32,
                                  "sliding_window": 16}),
    # sliding (window 8), full, sliding, full; YaRN past an original context of 64; head_dim
    # 32 (q/k/v 128 wide in a hidden of 64); weights of 0.3: at 0.5 the float32 rounding of
    # its large attention scores grows through the four layers to 1e-4 of the logits, as
    # much in transformers' own runs (whole prompt vs one token at a time) as against ours
    "gpt_oss": ("GptOssConfig", {
        "num_hidden_layers": 4, "initializer_range": 0.3, "head_dim": 32, "num_local_experts": 8,
        "num_experts_per_tok": 2, "intermediate_size": 32, "sliding_window": 8,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 16.0,
                            "original_max_position_embeddings": 64, "beta_fast": 32.0,
                            "beta_slow": 1.0, "truncate": False},
    }),
}  # fmt: skip
# Families whose init zeroes their biases: random ones show where each bias goes.
RANDOM_BIASES = {"gpt_oss"}


def build_tiny_model(folder: Path, seed: int = 0, family: str = "llama") -> Path:
    """A seeded random tiny checkpoint of `family` (TINY_FAMILIES; hidden 64, 1024 positions)
    + the embedded SmolLM2 tokenizer, saved HF-style into `folder`, which is returned."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    tok = embedded_tokenizer()
    torch.manual_seed(seed)
    cls, fields = TINY_FAMILIES[family]
    config = getattr(transformers, cls)(
        # large weights: peaked logits, so greedy has clear winners
        **{**TINY, "initializer_range": 0.5, **fields},
        vocab_size=len(tok),
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=None,  # no padding row: every family initialises every embedding row
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family in RANDOM_BIASES:
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.data.normal_(std=config.initializer_range)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@functools.cache
def embedded_tokenizer() -> Any:
    """The embedded model's tokenizer (read from its GGUF once per process: seconds)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_gguf().parent, gguf_file=EMBEDDED_GGUF)


def copy_tokenizer(reader: GGUFReader, writer: GGUFWriter, vocab: int | None = None) -> None:
    """Every `tokenizer.*` field of `reader` (vocabulary, merges, chat template) into `writer`;
    with `vocab`, the vocabulary padded to that many tokens with unused ones
    (`<|unused_{i}|>`, never produced by the merges)."""
    tokens = len(reader.fields["tokenizer.ggml.tokens"].contents())
    pad = max(0, (vocab or tokens) - tokens)
    extra = {"tokenizer.ggml.tokens": [f"<|unused_{i}|>" for i in range(pad)],
             "tokenizer.ggml.token_type": [int(TokenType.UNUSED)] * pad}  # fmt: skip
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            value = field.contents() + extra[name] if name in extra else field.contents()
            writer.add_key_value(name, value, field.types[0], sub_type=sub)


def random_blocks(n: int, k: int, fmt: str, seed: int) -> np.ndarray:
    """(N, K) weights in block format `fmt` as (N, row bytes) uint8: random bytes (every
    pattern of scales and quants is a valid block) with finite fp16 scales (MXFP4: E8M0
    exponents) of a realistic size. For the formats radixserve does not quantize to
    (quant.LLAMA_CPP_ONLY) and kernel benchmarks."""
    f = FORMATS[fmt]
    g = np.random.default_rng(seed)
    b = g.integers(0, 256, size=(n, k // f.block, f.block_bytes), dtype=np.uint8)
    step = 0.05 / (64 if f.block == 256 else 16)  # a K-quant's sub-scale multiplies up to 63
    scales = (g.uniform(0.5, 1.5, size=(n, k // f.block, 2)) * step).astype(np.float16)
    scales[..., 1] *= -1 if fmt == "q5_1" else 1  # Q5_1's second field is an offset m
    at, count = {"q6_k": (208, 1), "q5_0": (0, 1)}.get(fmt, (0, 2))  # fp16 fields: where, how many
    if fmt == "mxfp4":  # an E8M0 exponent byte: 2^(e - 128) * 12 of about 0.02-0.1
        b[..., 0] = g.integers(119, 122, size=b.shape[:-1], dtype=np.uint8)
        return b.reshape(n, -1)
    b[..., at : at + 2 * count] = scales[..., :count].view(np.uint8)
    return b.reshape(n, -1)
