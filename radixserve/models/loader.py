"""Load checkpoints from the local folder `resolve.resolve_model_path` gives: an HF folder
(safetensors), or a GGUF's converted folder, whose quantized tensors are read from the file.

- `load_model` reads config.json and safetensors (single file or sharded index) directly with
  the safetensors library, or the GGUF's quantized weights, stacks a mixture of experts'
  tensors (moe_weights.py), fuses q/k/v and gate/up, and checks the weight names exactly.
- `load_tokenizer` returns the checkpoint's fast HF tokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.config import QUANT_ACTIVATIONS, QUANT_ACTIVATIONS_DEFAULT, QUANTIZATIONS
from radixserve.models import native, quant
from radixserve.models.config import ModelConfig
from radixserve.models.gguf_weights import Weight, matrix_formats, read_gguf_weights, release_pages
from radixserve.models.llama import LlamaForCausalLM, packed_linear_supported
from radixserve.models.moe import QuantExperts
from radixserve.models.moe_weights import expert_names, fuse_experts, stack_experts
from radixserve.models.quant import (
    X8_CODES,
    QuantLinear,
    QuantStack,
    QuantWeight,
    dequantize,
    quantize,
)
from radixserve.models.resolve import gguf_source
from radixserve.models.sharding import shard_hf_weights

logger = logging.getLogger(__name__)

# HF tensors that carry no weights we need (old checkpoints saved the RoPE table).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_config(path: str | Path) -> ModelConfig:
    """ModelConfig from `path`/config.json (+ generation_config.json for eos ids, if any)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return ModelConfig.from_hf(cfg, gen)


def keeps_gguf_blocks(quantization: str, tp_size: int, device: torch.device | str) -> bool:
    """Whether `load_model` keeps a GGUF's NATIVE-format matrices as their blocks."""
    on_cpu = torch.device(device).type == "cpu"
    return quantization == "auto" and tp_size == 1 and on_cpu and quant.ops() is not None


def int8_x_only(
    path: str | Path, quantization: str, activations: str, tp_size: int, device: str
) -> bool:
    """Whether `load_model` keeps every matrix of the checkpoint at `path` in a format whose
    kernels round x to int8 (a GGUF of Q4_K / Q6_K under int8 activations, as most Q4_K_M
    files): the activations' float dtype then changes no matmul's speed."""
    gguf = gguf_source(Path(path))
    if (
        gguf is None
        or activations != "int8"
        or not keeps_gguf_blocks(quantization, tp_size, device)
    ):
        return False
    return matrix_formats(gguf) <= set(X8_CODES)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    packed_linear: bool | None = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    quantization: str = "auto",
    activations: str = QUANT_ACTIVATIONS_DEFAULT,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build our model from an HF checkpoint folder, weights cast to `dtype` on `device`.

    `quantization` (the one place weights' storage is chosen, logged):
    - "auto": a folder converted from a GGUF keeps the file's Q4_0 / Q4_1 / Q5_0 / Q5_1 /
      Q8_0 / Q4_K / Q5_K / Q6_K tensors quantized, in place in the file's memory map (QuantLinear;
      float32 compute), and dequantizes other types with a warning naming them and their
      memory; an HF folder loads as `dtype`. Tensor
      parallelism (tp_size > 1), non-CPU devices and CPUs where the native kernels do not
      build (or native ops are off: EngineConfig.native_ops) load dequantized.
    - "none": every weight dequantized to `dtype` (the reference).
    - "int8": every projection and an untied LM head as Q8_0 blocks (weight-only int8,
      one fp16 scale per 32 weights), from whatever the checkpoint holds.

    `activations` ("int8" or "int16"): how x is rounded for Q4_K and Q6_K weights
    (QuantLinear).

    With `tp_size` > 1 the model holds rank `tp_rank`'s shard of the attention and MLP
    projections (radixserve.distributed.parallel); the returned config is the full model's.

    `packed_linear` selects the plain-weight matmul (logged): None = auto (oneDNN packed
    weights for bf16 on CPU, else plain F.linear), True = packed (ValueError where
    unsupported), False = plain (EngineConfig.packed_linear_request).

    Raises ValueError (unsupported config or quantization, weights missing / unexpected for
    the config: the message names them, or a tp_size that does not divide the heads) or
    FileNotFoundError (no config.json or no safetensors).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if activations not in QUANT_ACTIVATIONS:
        raise ValueError(f"activations must be one of {QUANT_ACTIVATIONS}, got {activations!r}")
    path = Path(path)
    config = load_config(path)
    on_cpu = torch.device(device).type == "cpu"
    if quantization == "int8" and (tp_size > 1 or not on_cpu):
        raise ValueError("quantization int8 needs tp_size 1 on CPU")
    gguf = gguf_source(path)
    weights: dict[str, Weight] = {}
    if gguf is not None:
        keep = keeps_gguf_blocks(quantization, tp_size, device)
        found, dequantized = read_gguf_weights(gguf, config, dtype, quantized=keep)
        weights.update(found)
        if keep and dequantized:
            _warn_dequantized(gguf, dequantized, weights, dtype)
    else:
        weights.update(_read_safetensors(path, dtype))
    weights = stack_experts(split_fused(weights, config), config)
    _check_names(set(weights), hf_weight_names(config), path)
    if tp_size > 1:
        weights.update(shard_hf_weights(_plain(weights), config, tp_rank, tp_size))
    state = fuse_weights(weights, config, dtype)
    if quantization == "int8":
        state = {k: _int8(k, v) for k, v in state.items()}
    with torch.device("meta"):  # no allocation or random init: weights are assigned below
        model = LlamaForCausalLM(config, tp_size)
    tensors = _install_quantized(model, state, activations)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.build_rope_cache()  # replaces the meta placeholder buffer (on the weights' device)
    model.to(device)
    model.requires_grad_(False)
    model.eval()
    packed = _use_packed_linear(packed_linear, dtype, device)
    if packed:
        model.pack_linear_weights()
    if dtype in (torch.bfloat16, torch.float32) and on_cpu:
        native.ops()  # build (or load the cached build of) the fused ops now, not mid-request
    if gguf is not None and quant.ops() is not None:
        _pack_quantized(model, gguf)
    formats = sorted(
        {f.name for m in model.modules() if isinstance(m, QuantLinear) for f in m.formats}
    )
    x8 = f" (Q4_K/Q6_K x: {activations})" if {"q4_k", "q6_k"} & set(formats) else ""
    native_layers = model.use_native_layers()
    logger.info(
        "loaded %s (%s, %d layers) as %s on %s; weights: %s; linear: %s%s",
        gguf or path, config.architecture, config.num_layers, dtype, device,
        "quantized " + "/".join(formats) + x8 if formats else f"{dtype} (not quantized)",
        "oneDNN packed weights" if packed else "F.linear",
        "; layers: native (2 calls each)" if native_layers else "",
    )  # fmt: skip
    return model, config


def _pack_quantized(model: LlamaForCausalLM, gguf: Path) -> None:
    """Make every quantized projection's native form now (packing its K-quant parts into
    tiles), a slice at a time, and drop the file pages of each packed slice: the packed
    copies replace them in memory, so peak RSS stays about the file's size, not twice it."""
    for module in model.modules():
        if isinstance(module, QuantLinear | QuantExperts):
            module.native_arg(release=lambda blocks: release_pages(gguf, blocks))


def _plain(weights: dict[str, Weight]) -> dict[str, torch.Tensor]:
    """Only the tensors: the caller guarantees there is no QuantWeight (tp > 1 never reads a
    GGUF natively)."""
    assert all(isinstance(w, torch.Tensor) for w in weights.values()), "quantized TP shards"
    return {k: w for k, w in weights.items() if isinstance(w, torch.Tensor)}


def _warn_dequantized(
    gguf: Path, kinds: dict[str, int], weights: dict[str, Weight], dtype: torch.dtype
) -> None:
    plain = sum(w.numel() for w in weights.values() if isinstance(w, torch.Tensor))
    logger.warning(
        "%s: %s tensors have no native kernels and were dequantized to %s (%.2f GB with the "
        "other plain tensors, several times their size in the file)",
        gguf.name, ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())), dtype,
        plain * dtype.itemsize / 1e9,
    )  # fmt: skip


def _int8(name: str, w: Weight) -> Weight:
    """Projections and an untied head as Q8_0; embeddings, norms and biases unchanged."""
    is_linear = name.endswith("_proj.weight") or name == "lm_head.weight"
    if not is_linear:
        return w
    parts = w if isinstance(w, tuple) else (w,)
    if all(isinstance(p, QuantWeight) and p.fmt == "q8_0" for p in parts):
        return w
    plain = torch.cat([_dequantized(p) for p in parts])
    return QuantWeight(quantize(plain, "q8_0"), "q8_0", plain.shape[1])


def _dequantized(w: Weight) -> torch.Tensor:
    assert not isinstance(w, QuantStack), "stacked experts are not one projection"
    if isinstance(w, tuple):
        return torch.cat([_dequantized(p) for p in w])
    return dequantize(w.blocks, w.fmt, w.in_features) if isinstance(w, QuantWeight) else w


def _install_quantized(
    model: LlamaForCausalLM, state: dict[str, Weight], activations: str
) -> dict[str, torch.Tensor]:
    """Replace the module of every quantized weight with a QuantLinear holding it (a tied
    embedding becomes one too: token lookups dequantize rows); return the plain tensors."""
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    for prefix in sorted(
        {n.rpartition(".")[0] for n, w in state.items() if isinstance(w, QuantStack)}
    ):
        stacks = [state[f"{prefix}.{part}"] for part in ("gate_proj", "up_proj", "down_proj")]
        gate, up, down = stacks
        assert isinstance(gate, QuantStack) and isinstance(up, QuantStack), prefix
        assert isinstance(down, QuantStack), prefix  # all three or none (fuse_experts)
        biases = [tensors.pop(f"{prefix}.{p}_proj_bias", None) for p in ("gate_up", "down")]
        pair = None if biases[0] is None or biases[1] is None else (biases[0], biases[1])
        c = model.config
        swiglu = (c.swiglu_alpha, c.swiglu_limit) if c.swiglu_alpha else None
        experts = QuantExperts(gate, up, down, activations, pair, swiglu)
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent), child, experts)
        tensors.update({f"{prefix}.{k}": v for k, v in experts.state_dict().items()})
    for name, w in state.items():
        if isinstance(w, torch.Tensor | QuantStack):
            continue
        parts = w if isinstance(w, tuple) else (w,)
        prefix = name.removesuffix(".weight")
        parent, _, child = prefix.rpartition(".")
        bias = tensors.pop(prefix + ".bias", None)
        module = QuantLinear(parts, bias, activations)
        setattr(model.get_submodule(parent) if parent else model, child, module)
        for i, part in enumerate(parts):
            tensors[f"{prefix}.blocks{i}"] = part.blocks
        if bias is not None:
            tensors[prefix + ".bias"] = bias
    return tensors


def _use_packed_linear(
    requested: bool | None, dtype: torch.dtype, device: torch.device | str
) -> bool:
    supported = packed_linear_supported(dtype, device)
    if requested is None:
        return supported
    if requested and not supported:
        raise ValueError(f"packed linear needs bf16 on a oneDNN CPU, got {dtype} on {device}")
    return requested


def import_tokenizer_modules() -> None:
    """Import the transformers modules `load_tokenizer` runs (~1.5 s; the config classes'
    shared imports come in with LlamaConfig), so that a process can do it while it waits."""
    from transformers import AutoTokenizer, LlamaConfig  # noqa: F401


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's fast tokenizer (transformers AutoTokenizer, use_fast=True)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), use_fast=True)


def _weight_files(path: Path) -> dict[str, Path]:
    """HF tensor name -> the safetensors file holding it (sharded index or single files)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path} (.bin checkpoints are not supported)")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            out.update({name: file for name in f.keys()})  # noqa: SIM118 (safe_open API)
    return out


def _read_safetensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for name, file in _weight_files(path).items():
        if not name.endswith(IGNORED_SUFFIXES):
            by_file.setdefault(file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                out[name] = f.get_tensor(name).to(dtype)
    return out


def hf_weight_names(config: ModelConfig) -> set[str]:
    """Every HF tensor name a checkpoint of `config` must contain (lm_head optional if tied)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    norms = ["input_layernorm", "post_attention_layernorm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] * config.sandwich_norms
    norms += ["self_attn.q_norm", "self_attn.k_norm"] * config.qk_norm
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names |= {f"{p}{norm}.weight" for norm in norms}
        for proj, bias in [("q", config.qkv_bias), ("k", config.qkv_bias), ("v", config.qkv_bias),
                           ("o", config.o_bias)]:  # fmt: skip
            names |= _linear(p + f"self_attn.{proj}_proj", bias)
        if config.attn_sinks:
            names.add(p + "self_attn.sinks")
        if config.is_moe(i):
            names |= expert_names(i, config)
            continue
        for proj in ("gate", "up", "down"):
            names |= _linear(p + f"mlp.{proj}_proj", config.mlp_bias)
    return names


def _linear(prefix: str, bias: bool) -> set[str]:
    return {prefix + ".weight", prefix + ".bias"} if bias else {prefix + ".weight"}


def _check_names(found: set[str], expected: set[str], path: Path) -> None:
    # Tied checkpoints sometimes store lm_head anyway (a copy of the embedding): accept it.
    if "lm_head.weight" not in expected:
        found = found - {"lm_head.weight"}
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config: missing {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}"
        )


# The projections the model holds fused: (fused name, its HF parts in row order, the config
# field giving each part's rows). Checkpoints that store them fused already (Phi-3's) are
# split into the parts first (`split_fused`), so sharding and fusing treat every family alike.
FUSED = (
    ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj"), ("q_size", "kv_size", "kv_size")),
    ("mlp.gate_up_proj", ("gate_proj", "up_proj"), ("intermediate_size", "intermediate_size")),
)


def fuse_weights(
    hf: dict[str, Weight], config: ModelConfig, dtype: torch.dtype
) -> dict[str, Weight]:
    """HF names -> our names: q/k/v -> qkv_proj, gate/up -> gate_up_proj (concat on dim 0),
    stacked experts' gate/up -> experts.gate_up_proj (radixserve/models/moe_weights.py).

    Quantized parts stay as they are, a tuple (QuantLinear runs them part by part: no copy
    of a memory-mapped file, and parts may differ in format); a mix of quantized and plain
    parts is dequantized to `dtype` and concatenated."""
    out = {k: v for k, v in hf.items() if k != "lm_head.weight" or not config.tie_word_embeddings}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for fused, parts, _ in FUSED:
            module = fused.split(".")[0]
            for kind in ("weight", "bias"):
                names = [f"{p}{module}.{x}.{kind}" for x in parts]
                if names[0] in out:
                    out[f"{p}{fused}.{kind}"] = _concat_rows([out.pop(n) for n in names], dtype)
    return fuse_experts(out, config, dtype)


def split_fused(hf: dict[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """`hf` with every checkpoint-fused projection split row-wise into its parts (quantized
    blocks split by rows too: rows are independent in every block format)."""
    out = dict(hf)
    for i in range(config.num_layers):
        for fused, parts, sizes in FUSED:
            w = out.pop(f"model.layers.{i}.{fused}.weight", None)
            if w is None:
                continue
            module = fused.rpartition(".")[0]
            rows = [getattr(config, size) for size in sizes]
            for part, piece in zip(parts, _split_rows(w, rows), strict=True):
                out[f"model.layers.{i}.{module}.{part}.weight"] = piece
    return out


def _split_rows(w: Weight, rows: list[int]) -> list[Weight]:
    if isinstance(w, torch.Tensor):
        return list(w.split(rows))
    assert isinstance(w, QuantWeight), f"a fused checkpoint tensor of parts: {type(w)}"
    return [QuantWeight(b, w.fmt, w.in_features) for b in w.blocks.split(rows)]


def _concat_rows(parts: list[Weight], dtype: torch.dtype) -> Weight:
    quantized = [w for w in parts if isinstance(w, QuantWeight)]
    if len(quantized) == len(parts):
        return tuple(quantized)
    return torch.cat([_dequantized(w).to(dtype) for w in parts], dim=0)
