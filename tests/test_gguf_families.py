"""GGUF files of llama.cpp's qwen3, gemma2, gemma3, phi3 and smollm3 architectures
(radixserve/models/gguf_config.py, gguf_weights.py), written here from tiny random HF models
the way llama.cpp's converter writes them (its tensor names through the `gguf` package's own
name map, its metadata keys and longrope factor tensors from radixserve/models/gguf_layout.py,
q/k rows permuted for smollm3, Gemma norms stored as 1 + w, Phi-3's fused tensors): the
converted folder's config.json equals the HF model's config on every field that changes the
math, and the weights read from the file equal its state_dict exactly (F32 tensors). A Q8_0
matrix stays in blocks under its HF name; metadata the HF config cannot express raises
ValueError naming the key and value."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from helpers import finish_gguf
from test_model_sources import llama_cpp_permute
from transformers import (
    AutoConfig,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from radixserve.models import resolve_model_path
from radixserve.models.gguf_config import config_from_metadata
from radixserve.models.gguf_layout import gguf_architecture, rope_tensors, write_metadata
from radixserve.models.gguf_weights import read_gguf_weights
from radixserve.models.quant import QuantLinear, QuantWeight, dequantize

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
# The tiny tokenizer: the 256 byte-level symbols, two merges, UNK, BOS and EOS.
TOKENS = [*bytes_to_unicode().values(), "Ġt", "he", "<unk>", "<|bos|>", "<|eos|>"]
VOCAB, UNK, BOS, EOS = len(TOKENS), len(TOKENS) - 3, len(TOKENS) - 2, len(TOKENS) - 1
SIZES = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
         "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": None}  # fmt: skip
# Config fields that change the math, compared between the HF model and the converted folder.
MATH = ["model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
        "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "rope_parameters"]  # fmt: skip
FAMILY_MATH = {
    "qwen3": ["head_dim", "attention_bias", "hidden_act", "use_sliding_window",
              "sliding_window", "layer_types"],
    "gemma2": ["head_dim", "attention_bias", "hidden_activation", "query_pre_attn_scalar",
               "sliding_window", "layer_types", "final_logit_softcapping",
               "attn_logit_softcapping"],
    "gemma3_text": ["head_dim", "attention_bias", "hidden_activation", "query_pre_attn_scalar",
                    "sliding_window", "layer_types", "final_logit_softcapping",
                    "attn_logit_softcapping", "use_bidirectional_attention"],
    "phi3": ["hidden_act", "original_max_position_embeddings", "sliding_window"],
    "smollm3": ["attention_bias", "mlp_bias", "hidden_act", "no_rope_layers",
                "use_sliding_window", "sliding_window", "layer_types"],
}  # fmt: skip


# ---------------------------------------------------------------- tiny random HF models


def randomized(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    """Every parameter random (biases and norms too). Gemma's norm weights w on a 1/64 grid,
    so that 1 + w and back is exact in float32 (real ones are bf16, for which it is too)."""
    g = torch.Generator().manual_seed(seed)
    gemma = model.config.model_type in ("gemma2", "gemma3_text")
    for name, p in model.named_parameters():
        if gemma and name.endswith("norm.weight"):
            p.data = torch.randint(-32, 32, p.shape, generator=g).float() / 64
        else:
            p.data = torch.randn(p.shape, generator=g) * 0.5
    return model.eval()


def sizes(vocab: int) -> dict[str, Any]:
    """SIZES with `vocab` tokens (the tiny tokenizer and tokens of its own after them)."""
    return {**SIZES, "vocab_size": vocab}


def tiny_qwen3(vocab: int = VOCAB) -> PreTrainedModel:
    """head_dim 32 (heads * head_dim != hidden), untied, no scaling."""
    config = Qwen3Config(**sizes(vocab), num_hidden_layers=2, head_dim=32,
                         max_position_embeddings=512, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # fmt: skip
    return randomized(Qwen3ForCausalLM(config), 1)


def tiny_gemma3(vocab: int = VOCAB) -> PreTrainedModel:
    """7 layers: 5 sliding (window 16), 1 global, 1 sliding; linear scaling on the global
    RoPE only; query_pre_attn_scalar = head_dim (as llama.cpp assumes below 62 layers)."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
    config = Gemma3TextConfig(**sizes(vocab), num_hidden_layers=7, head_dim=32,
                              query_pre_attn_scalar=32, sliding_window=16,
                              max_position_embeddings=512, rope_parameters=rope)  # fmt: skip
    assert "full_attention" in config.layer_types and "sliding_attention" in config.layer_types
    return randomized(Gemma3ForCausalLM(config), 2)


def tiny_gemma2(vocab: int = VOCAB) -> PreTrainedModel:
    """3 layers: sliding (window 16), global, sliding; soft caps low enough to bite on
    random weights."""
    config = Gemma2Config(**sizes(vocab), num_hidden_layers=3, head_dim=32,
                          query_pre_attn_scalar=32, sliding_window=16,
                          max_position_embeddings=512, attn_logit_softcapping=1.5,
                          final_logit_softcapping=5.0)  # fmt: skip
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    return randomized(Gemma2ForCausalLM(config), 5)


def tiny_phi3(vocab: int = VOCAB) -> PreTrainedModel:
    """Partial rotary (8 of 16 dims), longrope (4 short / long factors), context 256 over an
    original 64 (so the attention factor is not 1)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.125, 1.5, 2.25],
            "long_factor": [1.5, 3.0, 4.75, 8.5]}  # fmt: skip
    config = Phi3Config(**sizes(vocab), num_hidden_layers=2, max_position_embeddings=256,
                        original_max_position_embeddings=64, rope_parameters=rope)  # fmt: skip
    return randomized(Phi3ForCausalLM(config), 3)


def tiny_smollm3(vocab: int = VOCAB) -> PreTrainedModel:
    """4 layers, the last without RoPE (llama.cpp's fixed step of 4); q/k/v/o biases."""
    config = SmolLM3Config(**sizes(vocab), num_hidden_layers=4, max_position_embeddings=512,
                           rope_parameters={"rope_type": "default", "rope_theta": 5e6},
                           attention_bias=True)  # fmt: skip
    assert config.no_rope_layers == [1, 1, 1, 0]
    return randomized(SmolLM3ForCausalLM(config), 4)


FAMILIES = {"qwen3": tiny_qwen3, "gemma2": tiny_gemma2, "gemma3": tiny_gemma3, "phi3": tiny_phi3,
            "smollm3": tiny_smollm3}  # fmt: skip


# ---------------------------------------------------------------- llama.cpp's converter


def write_gguf(
    model: PreTrainedModel, out: Path, quant: gguf.GGMLQuantizationType = F32,
    extra: dict[str, Any] | None = None,
    tokenizer: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:  # fmt: skip
    """`model` as llama.cpp's converter writes it, + `extra` metadata; 2-D layer tensors in
    `quant`; the tiny tokenizer unless `tokenizer` writes another."""
    cfg = model.config
    arch = gguf_architecture(cfg)
    w = gguf.GGUFWriter(str(out), arch)
    write_metadata(w, cfg)
    for name, x in rope_tensors(cfg).items():
        w.add_tensor(name, x)
    for key, value in (extra or {}).items():
        w.add_float32(f"{arch}.{key}", value)
    (tokenizer or write_tokenizer)(w)
    finish_gguf(w, llama_cpp_tensors(model, arch), quant)
    return out


def write_tokenizer(w: gguf.GGUFWriter) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.NORMAL] * UNK + [gguf.TokenType.CONTROL] * 3)
    w.add_token_merges(["Ġ t", "h e"])
    w.add_unk_token_id(UNK)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|eos|>{% endfor %}")


def llama_cpp_tensors(model: PreTrainedModel, arch: str) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, values) of the model's tensors: names by the gguf package's map (as the
    converter names them), Gemma norms + 1, llama's and smollm3's q/k rows permuted (weights
    and biases), no lm_head when tied."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    out = []
    for hf, t in as_converted(model.state_dict()).items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = t.float().numpy().copy()
        if arch in ("gemma2", "gemma3") and hf.endswith("norm.weight"):
            x += 1  # the converter's Gemma norm shift
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        proj = hf.split(".")[-2]
        if arch in ("llama", "smollm3") and proj in heads:
            x = llama_cpp_permute(x, heads[proj])
        out.append((names.get_name(hf, try_suffixes=(".weight", ".bias")), x))
    return out


def as_converted(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with transformers' fused experts (`mlp.experts.gate_up_proj` (E, 2I, hidden),
    `mlp.experts.down_proj`) as the stacked `mlp.experts.{gate,up,down}_proj.weight` that
    llama.cpp's converter stacks from the per-expert tensors a checkpoint holds (and names
    through the gguf package's map)."""
    out = {}
    for name, t in state.items():
        stem, _, part = name.rpartition(".")
        if stem.endswith("mlp.experts") and part == "gate_up_proj":
            gate, up = t.chunk(2, dim=1)
            out[f"{stem}.gate_proj.weight"], out[f"{stem}.up_proj.weight"] = gate, up
        elif stem.endswith("mlp.experts") and part == "down_proj":
            out[f"{stem}.down_proj.weight"] = t
        else:
            out[name] = t
    return out


# ---------------------------------------------------------------- what radixserve reads


def hf_weights(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]  # the file has no output.weight: tied
    return state


def heads(model: PreTrainedModel) -> SimpleNamespace:
    """What read_gguf_weights needs of a ModelConfig."""
    cfg = model.config
    return SimpleNamespace(num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path


@pytest.mark.parametrize("arch", FAMILIES)
def test_converted_config_and_weights_equal_the_hf_models(arch: str, cache: Path) -> None:
    model = FAMILIES[arch]()
    file = write_gguf(model, cache / f"tiny-{arch}.gguf")
    folder = resolve_model_path(str(file))
    ours, theirs = AutoConfig.from_pretrained(folder), model.config
    assert ours.architectures == [type(model).__name__]
    for field in MATH + FAMILY_MATH[theirs.model_type]:
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (BOS, EOS, None)
    weights, dequantized = read_gguf_weights(file, heads(model), torch.float32, quantized=False)
    want = hf_weights(model)
    assert dequantized == {} and set(weights) == set(want)
    for name, w in weights.items():
        assert torch.equal(w, want[name]), name


@pytest.mark.parametrize("arch", ["phi3", "smollm3"])
def test_q8_0_matrices_stay_in_blocks_under_their_hf_names(arch: str, tmp_path: Path) -> None:
    """Phi-3's fused qkv stays one block matrix; smollm3's permuted q/k blocks are put back
    in HF's row order (each dequantizes to the dequantized reading, which un-permutes)."""
    model = FAMILIES[arch]()
    file = write_gguf(model, tmp_path / f"tiny-{arch}-q8.gguf", Q8_0)
    ours, dequantized = read_gguf_weights(file, heads(model), torch.float32)
    plain, _ = read_gguf_weights(file, heads(model), torch.float32, quantized=False)
    assert dequantized == {} and set(ours) == set(plain) == set(hf_weights(model))
    fused = "self_attn.qkv_proj" if arch == "phi3" else "self_attn.q_proj"
    assert isinstance(ours[f"model.layers.0.{fused}.weight"], QuantWeight)
    blocks = {name: w for name, w in ours.items() if isinstance(w, QuantWeight)}
    assert len(blocks) == model.config.num_hidden_layers * (4 if arch == "phi3" else 7)
    for name, w in blocks.items():
        assert w.fmt == "q8_0", name
        assert torch.equal(dequantize(w.blocks, w.fmt, w.in_features), plain[name]), name
    q = plain["model.layers.0.self_attn.q_proj.weight" if arch == "smollm3" else
              "model.layers.0.self_attn.qkv_proj.weight"]  # fmt: skip
    hf = hf_weights(model)[f"model.layers.0.{fused}.weight"]
    assert (q - hf).abs().max() < 0.02 * hf.abs().max()  # Q8_0's error: rows are in place


# ---------------------------------------------------------------- metadata rules


def metadata(arch: str, **keys: Any) -> dict[str, Any]:
    """A minimal valid metadata dict of `arch` (2 layers, hidden 64), with `keys` added."""
    base = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 128,
            "context_length": 256, "attention.head_count": 4, "attention.head_count_kv": 2,
            "attention.layer_norm_rms_epsilon": 1e-6, **keys}  # fmt: skip
    return {f"{arch}.{key}": value for key, value in base.items()}


SHAPES = {"token_embd.weight": (VOCAB, 64)}


def gemma3(**keys: Any) -> dict[str, Any]:
    return config_from_metadata("gemma3", metadata("gemma3", **keys), SHAPES, {})


@pytest.mark.parametrize(
    ("arch", "key", "value"),
    [("gemma3", "final_logit_softcapping", 30.0), ("gemma3", "attn_logit_softcapping", 50.0),
     ("qwen3", "rope.scaling.type", "yarn"), ("qwen3", "rope.dimension_count", 8),
     ("qwen3", "pooling_type", 3), ("smollm3", "expert_count", 8),
     ("phi3", "rope.scaling.factor", 4.0), ("phi3", "rope.scaling.type", "longrope"),
     ("smollm3", "rope.scaling.attn_factor", 2.0)],
)  # fmt: skip
def test_metadata_the_hf_config_cannot_express_raises_naming_it(
    arch: str, key: str, value: Any
) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{arch}.{key} = {value!r} in the GGUF")):
        config_from_metadata(arch, metadata(arch, **{key: value}), SHAPES, {})


def test_a_file_with_logit_softcapping_is_refused_at_conversion(cache: Path) -> None:
    file = write_gguf(tiny_gemma3(), cache / "capped.gguf", extra={"final_logit_softcapping": 30})
    with pytest.raises(ValueError, match=r"gemma3\.final_logit_softcapping = 30\.0"):
        resolve_model_path(str(file))


def test_rope_tensors_an_architecture_lacks_are_refused() -> None:
    factors = {"rope_factors_long.weight": np.ones(8), "rope_factors_short.weight": np.ones(8)}
    with pytest.raises(ValueError, match="rope_factors_long.weight in a qwen3 GGUF"):
        config_from_metadata("qwen3", metadata("qwen3"), SHAPES, factors)


def test_phi3_keeps_an_attention_factor_only_where_it_differs_from_hfs() -> None:
    """llama.cpp's converter writes attn_factor = sqrt(1 + ln(256 / 64) / ln(64)) (HF's own
    default, left out); a file with another one keeps it."""
    factors = {"rope_factors_long.weight": np.ones(8), "rope_factors_short.weight": np.ones(8)}
    keys = {"rope.scaling.original_context_length": 64, "rope.dimension_count": 16}
    for attn, kept in [(float(np.float32(np.sqrt(1 + np.log(4) / np.log(64)))), None), (1.5, 1.5)]:
        meta = metadata("phi3", **keys, **{"rope.scaling.attn_factor": attn})
        rope = config_from_metadata("phi3", meta, SHAPES, factors)["rope_parameters"]
        assert rope["rope_type"] == "longrope" and rope.get("attention_factor") == kept


def test_gemma3_query_scale_follows_llama_cpps_rule_by_layer_count() -> None:
    """llama.cpp scales queries by (hidden / heads) ** -0.5 for 62 layers (27B: 5376 / 32 =
    168, not head_dim 128), else by head_dim ** -0.5."""
    sizes = {"embedding_length": 5376, "attention.head_count": 32, "attention.key_length": 128,
             "attention.value_length": 128}  # fmt: skip
    assert gemma3(**sizes, block_count=62)["query_pre_attn_scalar"] == 168
    assert gemma3(**sizes, block_count=48)["query_pre_attn_scalar"] == 128


def test_gemma3_layer_types_from_the_window_and_its_pattern() -> None:
    full, sliding = "full_attention", "sliding_attention"
    assert gemma3(block_count=7, **{"attention.sliding_window": 512})["layer_types"] == (
        [sliding] * 5 + [full, sliding]
    )  # llama.cpp's default period 6
    by_period = gemma3(**{"attention.sliding_window": 512, "attention.sliding_window_pattern": 2})
    assert by_period["layer_types"] == [sliding, full]
    per_layer = gemma3(**{"attention.sliding_window": 512,
                          "attention.sliding_window_pattern": [False, True]})  # fmt: skip
    assert per_layer["layer_types"] == [full, sliding]
    unwindowed = gemma3()
    assert unwindowed["layer_types"] == [full, full] and unwindowed["sliding_window"] is None
    assert unwindowed["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0


@pytest.mark.parametrize("quant", [F32, Q8_0])
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_a_gguf_file_runs_as_its_hf_model(
    arch: str, quant: gguf.GGMLQuantizationType, cache: Path
) -> None:
    """The file loaded by the engine's loader (Q8_0 matrices kept in blocks) gives the HF
    model's logits through a prefill, an extend and decodes past Gemma's window (16) and
    Phi-3's original context (64): F32 within 1e-4 of the logit scale, Q8_0 with its
    weights dequantized into the HF model (the same numbers) within 1e-3."""
    from helpers import alloc_slots, extend, make_pool
    from test_families import hf_logits_one_at_a_time

    from radixserve.attention.flat import FlatBackend
    from radixserve.models import load_model

    hf = FAMILIES[arch]()
    path = write_gguf(hf, cache / f"{arch}.gguf", quant)
    model, _ = load_model(resolve_model_path(str(path)), torch.float32)
    if quant == Q8_0:  # the oracle holds the same rounded weights
        for name, w in read_gguf_weights(path, heads(hf), torch.float32, quantized=False)[
            0
        ].items():
            hf.get_parameter(name).data.copy_(w)
    assert (quant == Q8_0) == any(isinstance(m, QuantLinear) for m in model.modules())
    ids = torch.randint(0, VOCAB, (80,), generator=torch.Generator().manual_seed(7)).tolist()
    pool = make_pool(model, 80)
    slots = alloc_slots(pool, 80)
    parts = [extend(model, FlatBackend(), pool, slots, ids[:20], 0)]
    parts.append(extend(model, FlatBackend(), pool, slots, ids[20:45], 20))
    parts += [extend(model, FlatBackend(), pool, slots, [ids[p]], p) for p in range(45, 80)]
    want = hf_logits_one_at_a_time(hf, ids)
    tol = 1e-4 if quant == F32 else 1e-3
    diff = (torch.cat(parts) - want).abs().max().item()
    assert diff <= tol * want.abs().max().item(), f"{arch}: max abs diff {diff:.2e}"
