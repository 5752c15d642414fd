"""A mixture-of-experts layer's checkpoint tensors, as the loader handles them.

Checkpoints store the experts four ways; each becomes the same stacked names (per layer
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
    gpt-oss: experts.gate_up_proj (E, hidden, 2I)   gate / up: its even / odd columns,
        with gate and up columns interleaved,           transposed; their biases alike
        gate_up_proj_bias (E, 2I) alike,                (experts.gate_proj_bias,
        experts.down_proj (E, I, hidden),               experts.up_proj_bias (E, I));
        down_proj_bias (E, hidden), the router          down transposed, its bias as it is
        mlp.router.weight / .bias                       (experts.down_proj_bias); the router
                                                        is `mlp.gate`
    GGUF ffn_gate_exps / ffn_up_exps / ffn_down_exps  the same (gguf_weights.LAYER_NAMES;
        (+ .bias: gpt-oss)                              gpt-oss's biases `*_proj_bias`)

and the router `mlp.gate.weight` (E, hidden) (+ `mlp.gate.bias` (E,)). The model holds
`experts.gate_up_proj` (E, 2I, hidden) = cat(gate, up) per expert, and `experts.down_proj`
(`fuse_experts`), with biases `experts.gate_up_proj_bias` (E, 2I) and
`experts.down_proj_bias` (E, hidden); a GGUF's experts in a NATIVE block format stay three
`QuantStack`s (`moe.QuantExperts`), their biases fused alike.
"""

from __future__ import annotations

import torch

from radixserve.models.config import ModelConfig
from radixserve.models.gguf_weights import Weight
from radixserve.models.quant import QuantStack, dequantize

PARTS = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
GPT_OSS = "GptOssForCausalLM"


def expert_names(layer: int, config: ModelConfig) -> set[str]:
    """The stacked names of layer `layer`'s router and experts."""
    p = f"model.layers.{layer}.mlp."
    names = {p + "gate.weight"} | {f"{p}experts.{part}" for part in PARTS}
    if config.router_bias:
        names.add(p + "gate.bias")
    if config.expert_bias:
        names |= {f"{p}experts.{part}_bias" for part in PARTS}
    return names


def stack_experts(hf: dict[str, Weight], config: ModelConfig) -> dict[str, Weight]:
    """`hf` with every MoE layer's experts under their stacked names (module docstring).
    A layer missing some expert's tensor keeps the ones it has under their own names (the
    loader's name check then reports both)."""
    out = {_renamed(name): w for name, w in hf.items()}
    for i in range(config.num_layers):
        if not config.is_moe(i):
            continue
        p = f"model.layers.{i}.mlp.experts."
        if config.architecture == GPT_OSS:
            _interleaved(out, p)
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


def _interleaved(out: dict[str, Weight], p: str) -> None:
    """gpt-oss's experts under prefix `p` (module docstring) -> stacked names, in place. Only
    a checkpoint of transformers' layout (it has `gate_up_proj`) has them so; a GGUF's
    experts come stacked already, under the same `down_proj` name."""
    gate_up, down = out.pop(p + "gate_up_proj", None), out.get(p + "down_proj")
    if not isinstance(gate_up, torch.Tensor):
        return
    # (E, hidden, 2I): column 2j is gate row j, column 2j + 1 up row j
    out[p + "gate_proj"] = gate_up[..., ::2].transpose(1, 2).contiguous()  # (E, I, hidden)
    out[p + "up_proj"] = gate_up[..., 1::2].transpose(1, 2).contiguous()
    bias = out.pop(p + "gate_up_proj_bias", None)
    if isinstance(bias, torch.Tensor):  # (E, 2I) interleaved alike
        out[p + "gate_proj_bias"], out[p + "up_proj_bias"] = bias[:, ::2], bias[:, 1::2]
    if isinstance(down, torch.Tensor):  # (E, I, hidden)
        out[p + "down_proj"] = down.transpose(1, 2).contiguous()  # (E, hidden, I)


def fuse_experts(
    state: dict[str, Weight], config: ModelConfig, dtype: torch.dtype
) -> dict[str, Weight]:
    """Each MoE layer's stacked experts as the model holds them, in `state`; returns it.
    Float gate / up -> `experts.gate_up_proj` (E, 2I, hidden), their biases ->
    `experts.gate_up_proj_bias` (E, 2I). Three QuantStacks (a GGUF's experts in their
    blocks) stay as they are, for `moe.QuantExperts` (their biases fused); other stacks
    are dequantized to `dtype` first."""
    for i in range(config.num_layers):
        p = f"model.layers.{i}.mlp.experts."
        names = [p + part for part in PARTS]
        if not (config.is_moe(i) and names[0] in state):
            continue
        quantized = all(isinstance(state[n], QuantStack) for n in names)
        for n in names:
            w = state[n]
            if isinstance(w, QuantStack) and not quantized:
                e, rows, k = len(w), w.blocks.shape[1], w.in_features
                flat = w.blocks.reshape(e * rows, -1)
                state[n] = dequantize(flat, w.fmt, k).reshape(e, rows, k).to(dtype)
        for kind in ("_bias",) if quantized else ("", "_bias"):
            if p + "gate_proj" + kind in state:
                gate, up = state.pop(p + "gate_proj" + kind), state.pop(p + "up_proj" + kind)
                assert isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor), p
                state[p + "gate_up_proj" + kind] = torch.cat([gate, up], dim=1)
    return state


def _renamed(name: str) -> str:
    """Mixtral's `block_sparse_moe.*` names under the stacked names' prefix and parts, and
    gpt-oss's router `mlp.router` as `mlp.gate`."""
    if ".mlp.router." in name:
        return name.replace(".mlp.router.", ".mlp.gate.")
    if ".block_sparse_moe." not in name:
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    stem, part, kind = name.rsplit(".", 2)
    return f"{stem}.{MIXTRAL_PARTS.get(part, part)}.{kind}"
