"""The mixture-of-experts MLP (Qwen3-MoE, OLMoE, Mixtral): a router picks `top_k` of `E`
SwiGLU experts for each token and the token's output is their outputs' weighted sum.

    router    logits = x @ gate.T                    (T, E) in the model dtype
              probs  = softmax(logits) in float32    (T, E)
              w, ids = topk(probs, k)                (T, k): torch.topk, so ties between equal
                                                     scores resolve exactly as transformers'
              w      = w / w.sum(-1) if renormalised (Mixtral's softmax over the top-k logits
                                                     is the same numbers)
    experts   one (token, slot) row per selected expert, T * k rows, sorted by expert id (the
              grouping llama.cpp's mul_mat_id does): expert e's rows are one contiguous run,
              multiplied by its weights once per step

                  rows sorted by expert:  [ e=0: n0 rows | e=2: n2 rows | e=5: n5 rows | ... ]
                  out[run] = down[e] @ (silu(gate[e] @ x) * (up[e] @ x))

              then each row times its routing weight, put back in (token, slot) order and
              summed over the k slots of its token (transformers' grouped path, op for op).

Weights are stored stacked: `experts.gate_up_proj` (E, 2 * I, hidden) = cat(gate, up) per
expert, `experts.down_proj` (E, hidden, I); a GGUF's experts in a block format stay in their
blocks, one QuantLinear per expert and projection (`QuantExperts`). Under tensor
parallelism each rank holds the slice [r * I / N, (r + 1) * I / N) of every expert's I (as
the dense MLP's), the router is replicated, and the partial sums are all-reduced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from radixserve.distributed.parallel import all_reduce
from radixserve.models.config import ModelConfig
from radixserve.models.quant import QuantLinear, QuantStack


def route(logits: Tensor, top_k: int, renormalise: bool) -> tuple[Tensor, Tensor]:
    """Router logits (T, E) -> (weights (T, k) float32, expert ids (T, k) int64), each row's
    experts in descending score."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, k)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


Expert = Callable[[int, Tensor], Tensor]  # (expert e, its rows (n, hidden)) -> (n, hidden)


def grouped_experts(x: Tensor, ids: Tensor, weights: Tensor, expert: Expert, hidden: int) -> Tensor:
    """Sum over each token's k experts of weight * expert(e, x) -> (T, hidden) in x's dtype.
    x (T, hidden); ids, weights (T, k). The weights multiply in their own dtype (pass them
    rounded to x's to multiply there)."""
    t, k = ids.shape
    flat = ids.reshape(-1)  # (T*k,) expert of each (token, slot) row
    order = torch.argsort(flat, stable=True)  # rows grouped by expert, in expert order
    counts = torch.bincount(flat).tolist()  # rows per expert, up to the largest id
    rows = x[order // k]  # (T*k, hidden): the token of each sorted row
    out = torch.empty(t * k, hidden, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            out[start : start + n] = expert(e, rows[start : start + n])
            start += n
    weighted = out * weights.reshape(-1)[order].unsqueeze(-1)  # (T*k, hidden)
    by_slot = torch.empty_like(weighted)
    by_slot[order] = weighted  # back in (token, slot) order
    return by_slot.view(t, k, -1).sum(dim=1).to(x.dtype)  # (T, hidden)


class Experts(nn.Module):
    """The stacked expert weights (module docstring); fresh ones are N(0, 0.02) like HF's
    init, left empty on the meta device (the loader assigns them). Called as (e, rows)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        gate_up = torch.empty(num_experts, 2 * intermediate, hidden)
        down = torch.empty(num_experts, hidden, intermediate)
        if not gate_up.is_meta:
            gate_up.normal_(std=0.02)
            down.normal_(std=0.02)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)

    def forward(self, e: int, rows: Tensor) -> Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)  # (n, I) each
        return F.linear(F.silu(gate) * up, self.down_proj[e])  # (n, hidden)


class QuantExperts(nn.Module):
    """A GGUF's experts in their blocks: expert e's gate and up one QuantLinear of two parts
    (`gate_up[e]`), its down another (`down[e]`), each over a view of the file's map, so
    a step reads only its selected experts' rows, in the dense projections' kernels."""

    def __init__(
        self, gate: QuantStack, up: QuantStack, down: QuantStack, activations: str
    ) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(
            QuantLinear([gate[e], up[e]], None, activations) for e in range(len(gate))
        )
        self.down = nn.ModuleList(
            QuantLinear([down[e]], None, activations) for e in range(len(down))
        )

    def forward(self, e: int, rows: Tensor) -> Tensor:
        gate, up = self.gate_up[e](rows).chunk(2, dim=-1)  # (n, I) each
        return self.down[e](F.silu(gate) * up)  # (n, hidden)


class MoE(nn.Module):
    """A layer's mixture-of-experts MLP: x (T, hidden) -> (T, hidden). `router` is the
    (E, hidden) projection the decoder builds (a GGUF's quantized router becomes a
    QuantLinear like any other projection); `config` is one rank's shard under TP."""

    def __init__(self, config: ModelConfig, router: nn.Module, tp_size: int = 1) -> None:
        super().__init__()
        self.top_k, self.renormalise = config.num_experts_per_tok, config.norm_topk_prob
        self.weights_f32 = config.routing_weights_f32
        self.tp_size = tp_size
        self.gate = router
        size = config.moe_intermediate_size
        self.experts = Experts(config.num_experts, config.hidden_size, size)

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalise)  # (T, k) each
        if not self.weights_f32:  # Qwen3-MoE / OLMoE round them to the model dtype first
            weights = weights.to(x.dtype)
        out = grouped_experts(x, ids, weights, self.experts, x.shape[-1])
        return out if self.tp_size == 1 else all_reduce(out)
