"""Tensor-parallel weight sharding (Megatron-style, over heads / intermediate size).

Ranks 0..N-1 each hold 1/N of every attention and MLP projection; everything else
(embeddings, norms, LM head, RoPE cache) is replicated:

    qkv_proj     column-parallel: rank r keeps q heads [r*Hq/N, (r+1)*Hq/N) and KV heads
                 [r*Hkv/N, (r+1)*Hkv/N) (a KV head's q group never straddles ranks, so GQA
                 needs no communication)
    o_proj       row-parallel: rank r keeps the input columns of its q heads; the partial
                 outputs are summed with all_reduce
    gate_up_proj column-parallel over the intermediate dimension
    down_proj    row-parallel over the intermediate dimension, then all_reduce
    experts      every expert as the MLP: its gate / up (E, I, hidden) split over I (dim 1),
                 its down (E, hidden, I) over I (dim 2); the router is replicated and the
                 experts' partial sums are all-reduced
    sinks        one per q head (gpt-oss): rank r keeps its q heads'

A row-parallel bias (o_proj's, down_proj's, the experts' down bias) is added once: rank 0
keeps it, the other ranks get zeros.
"""

from __future__ import annotations

import dataclasses

import torch

from radixserve.models.config import ModelConfig


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """ValueError unless `tp_size` divides the q heads, KV heads and intermediate size (and
    the experts'), or when q/k norms span the whole projection (OLMoE's: every rank would
    need every head's sum of squares)."""
    if tp_size > 1 and config.qk_norm_full:
        raise ValueError(f"--tp-size {tp_size}: {config.architecture}'s q/k norms span all "
                         "heads; it runs on one rank (--tp-size 1)")  # fmt: skip
    parts = {
        "attention heads": config.num_heads,
        "KV heads": config.num_kv_heads,
        "intermediate size": config.intermediate_size,
        "expert intermediate size": config.moe_intermediate_size,
    }
    bad = {name: n for name, n in parts.items() if tp_size and n % tp_size}
    if tp_size < 1 or bad:
        raise ValueError(
            f"--tp-size {tp_size} must divide the model's attention heads "
            f"({config.num_heads}), KV heads ({config.num_kv_heads}) and intermediate size "
            f"({config.intermediate_size}); it does not divide {', '.join(bad) or 'anything'}"
        )


def local_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The config of one rank's shard: heads and intermediate size divided by `tp_size`.

    Everything else (hidden size, head_dim, vocab, RoPE) is unchanged, so a model built from
    it has exactly the shapes of one rank's weights. Raises ValueError (see check_tp_size).
    """
    check_tp_size(config, tp_size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp_size,
        num_kv_heads=config.num_kv_heads // tp_size,
        intermediate_size=config.intermediate_size // tp_size,
        moe_intermediate_size=config.moe_intermediate_size // tp_size,
    )


def shard_hf_weights(
    hf: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard of an HF state dict (unfused names), as contiguous copies.

    Does not modify `hf`. Tensors not named here (embeddings, norms, lm_head) are shared
    as they are. Raises ValueError (see check_tp_size).
    """
    check_tp_size(config, size)
    d = config.head_dim
    q_rows = _part(config.num_heads * d, rank, size)
    kv_rows = _part(config.num_kv_heads * d, rank, size)
    inter = _part(config.intermediate_size, rank, size)
    # name suffix -> (dim to split, [start, end)); dim 0 = output rows, dim 1 = input columns
    column = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
              "gate_proj": inter, "up_proj": inter}  # fmt: skip
    row = {"o_proj": q_rows, "down_proj": inter}
    moe = _part(config.moe_intermediate_size, rank, size)
    heads = _part(config.num_heads, rank, size)
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        proj, kind = name.split(".")[-2:]
        if kind == "down_proj_bias":  # the experts' (E, hidden): row-parallel
            out[name] = t if rank == 0 else torch.zeros_like(t)
        elif proj == "experts":  # stacked: (E, I, hidden), (E, I) biases, down's (E, hidden, I)
            a, b = moe
            out[name] = (t[:, :, a:b] if kind == "down_proj" else t[:, a:b]).contiguous()
        elif kind == "sinks":
            out[name] = t[heads[0] : heads[1]].contiguous()
        elif proj in column:
            a, b = column[proj]
            out[name] = t[a:b].contiguous()  # weight (out, in) and bias (out,) alike
        elif proj in row and kind == "weight":
            a, b = row[proj]
            out[name] = t[:, a:b].contiguous()  # (hidden, in / N)
        elif proj in row:  # a row-parallel bias: added once, after the sum
            out[name] = t if rank == 0 else torch.zeros_like(t)
        else:
            out[name] = t
    return out


def _part(n: int, rank: int, size: int) -> tuple[int, int]:
    step = n // size
    return rank * step, (rank + 1) * step
