"""Models made in place, for tests and benchmarks: a tiny random HF checkpoint with the
embedded tokenizer, random blocks of the quantized formats, and the embedded tokenizer copied
into a GGUF being written. Nothing here is downloaded."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

from radixserve.models.quant import FORMATS
from radixserve.models.resolve import EMBEDDED_GGUF, embedded_gguf


def build_tiny_model(folder: Path, seed: int = 0) -> Path:
    """A seeded random tiny Llama checkpoint (hidden 64, 2 layers, 1024 positions) + the
    embedded SmolLM2 tokenizer, saved HF-style into `folder`, which is returned."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(embedded_gguf().parent, gguf_file=EMBEDDED_GGUF)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        initializer_range=0.5,  # large weights: peaked logits, so greedy has clear winners
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def copy_tokenizer(reader: GGUFReader, writer: GGUFWriter) -> None:
    """Every `tokenizer.*` field of `reader` (vocabulary, merges, chat template) into `writer`."""
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)


def random_blocks(n: int, k: int, fmt: str, seed: int) -> np.ndarray:
    """(N, K) weights in block format `fmt` as (N, row bytes) uint8: random bytes (every
    pattern of scales and quants is a valid block) with finite fp16 scales of a realistic
    size. For the formats only llama.cpp makes (quant.LLAMA_CPP_ONLY) and kernel benchmarks."""
    f = FORMATS[fmt]
    g = np.random.default_rng(seed)
    b = g.integers(0, 256, size=(n, k // f.block, f.block_bytes), dtype=np.uint8)
    step = 0.05 / (64 if f.block == 256 else 16)  # a K-quant's sub-scale multiplies up to 63
    scales = (g.uniform(0.5, 1.5, size=(n, k // f.block, 2)) * step).astype(np.float16)
    scales[..., 1] *= -1 if fmt == "q5_1" else 1  # Q5_1's second field is an offset m
    at, count = {"q6_k": (208, 1), "q5_0": (0, 1)}.get(fmt, (0, 2))  # fp16 fields: where, how many
    b[..., at : at + 2 * count] = scales[..., :count].view(np.uint8)
    return b.reshape(n, -1)
