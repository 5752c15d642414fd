"""A mixture-of-experts layer's checkpoint tensors, as the loader handles them.

Checkpoints store the experts three ways; each becomes the same stacked names (per layer
prefix `model.layers.{i}.mlp.`), which the loader checks, shards and then fuses:

    checkpoint                                      stacked (checked, sharded)
    experts.{e}.gate_proj / up_proj / down_proj     experts.gate_proj  (E, I, hidden)
        .weight (I, hidden) / (hidden, I) each          experts.up_proj    (E, I, hidden)
        (Qwen3-MoE, OLMoE, as transformers saves)       experts.down_proj  (E, hidden, I)
    block_sparse_moe.experts.{e}.w1 / w3 / w2       the same (w1 = gate, w3 = up, w2 = down;
        .weight, block_sparse_moe.gate (Mixtral)        the router `block_sparse_moe.gate`
                                                        is `mlp.gate`)
    experts.gate_up_proj (E, 2I, hidden),           gate / up: its two halves of rows
        experts.down_proj (E, hidden, I) (the
        layout transformers 5 holds in memory)
    GGUF ffn_gate_exps / ffn_up_exps / ffn_down_exps  the same (gguf_weights.LAYER_NAMES)

and the router `mlp.gate.weight` (E, hidden). The model holds `experts.gate_up_proj`
(E, 2I, hidden) = cat(gate, up) per expert, and `experts.down_proj` (`fuse_experts`); a
GGUF's experts in a NATIVE block format stay three `QuantStack`s (`moe.QuantExperts`).
"""

from __future__ import annotations

import torch

from radixserve.models.config import ModelConfig
from radixserve.models.gguf_weights import Weight
from radixserve.models.quant import QuantStack, dequantize

PARTS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def expert_names(layer: int) -> set[str]:
    """The stacked names of layer `layer`'s router and experts."""
    p = f"model.layers.{layer}.mlp."
    return {p + "gate.weight"} | {f"{p}experts.{part}" for part in PARTS}


def stack_experts(hf: dict[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """`hf` with every MoE layer's experts under their stacked names (module docstring).
    A layer missing some expert's tensor keeps the ones it has under their own names (the
    loader's name check then reports both)."""
    out = {_renamed(name): w for name, w in hf.items()}
    for i in range(config.num_layers):
        if not config.is_moe(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        fused = out.pop(p + "gate_up_proj", None)
        if isinstance(fused, torch.Tensor):  # (E, 2I, hidden): gate rows, then up rows
            gate, up = fused.chunk(2, dim=1)
            out[p + "gate_proj"], out[p + "up_proj"] = gate, up
        for part in PARTS:
            names = [f"{p}{e}.{part}.weight" for e in range(config.num_experts)]
            parts = [w for n in names if isinstance(w := out.get(n), torch.Tensor)]
            if len(parts) == len(names):
                out[p + part] = torch.stack(parts)
                for n in names:
                    del out[n]
    return out


def fuse_experts(
    state: dict[str, Weight], config: ModelConfig, dtype: torch.dtype
) -> dict[str, Weight]:
    """Each MoE layer's stacked experts as the model holds them, in `state`; returns it.
    Float gate / up -> `experts.gate_up_proj` (E, 2I, hidden). Three QuantStacks (a GGUF's
    experts in their blocks) stay as they are, for `moe.QuantExperts`; a layer with both
    kinds has its stacks dequantized to `dtype` first."""
    for i in range(config.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        names = [p + part for part in PARTS]
        if not (config.is_moe(i) and names[0] in state):
            continue
        if all(isinstance(state[n], QuantStack) for n in names):
            continue
        for n in names:
            w = state[n]
            if isinstance(w, QuantStack):
                e, rows, k = len(w), w.blocks.shape[1], w.in_features
                flat = w.blocks.reshape(e * rows, -1)
                state[n] = dequantize(flat, w.fmt, k).reshape(e, rows, k).to(dtype)
        gate, up = state.pop(names[0]), state.pop(names[1])
        assert isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor), p
        state[p + "gate_up_proj"] = torch.cat([gate, up], dim=1)
    return state


def _renamed(name: str) -> str:
    """Mixtral's `block_sparse_moe.*` names under the stacked names' prefix and parts."""
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    stem, part, kind = name.rsplit(".", 2)
    return f"{stem}.{MIXTRAL_PARTS.get(part, part)}.{kind}"
