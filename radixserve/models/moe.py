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
expert, `experts.down_proj` (E, hidden, I). Under tensor parallelism each rank holds the
slice [r * I / N, (r + 1) * I / N) of every expert's I (as the dense MLP's), the router is
replicated, and the partial sums are all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from radixserve.distributed.parallel import all_reduce
from radixserve.models.config import ModelConfig


def route(logits: Tensor, top_k: int, renormalise: bool) -> tuple[Tensor, Tensor]:
    """Router logits (T, E) -> (weights (T, k) float32, expert ids (T, k) int64), each row's
    experts in descending score."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, k)
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: Tensor, ids: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor
) -> Tensor:
    """Sum over each token's k experts of weight * down[e] @ (silu(g) * u) -> (T, hidden) in
    x's dtype. x (T, hidden); ids, weights (T, k); gate_up (E, 2I, hidden); down (E, hidden, I).
    The weights multiply in their own dtype (pass them rounded to x's to multiply there)."""
    t, k = ids.shape
    flat = ids.reshape(-1)  # (T*k,) expert of each (token, slot) row
    order = torch.argsort(flat, stable=True)  # rows grouped by expert, in expert order
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # rows per expert
    rows = x[order // k]  # (T*k, hidden): the token of each sorted row
    out = torch.empty(t * k, down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        run = slice(start, start + n)
        gate, up = F.linear(rows[run], gate_up[e]).chunk(2, dim=-1)  # (n, I) each
        out[run] = F.linear(F.silu(gate) * up, down[e])  # (n, hidden)
        start += n
    weighted = out * weights.reshape(-1)[order].unsqueeze(-1)  # (T*k, hidden)
    by_slot = torch.empty_like(weighted)
    by_slot[order] = weighted  # back in (token, slot) order
    return by_slot.view(t, k, -1).sum(dim=1).to(x.dtype)  # (T, hidden)


class Experts(nn.Module):
    """The stacked expert weights (module docstring); fresh ones are N(0, 0.02) like HF's
    init, left empty on the meta device (the loader assigns them)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        gate_up = torch.empty(num_experts, 2 * intermediate, hidden)
        down = torch.empty(num_experts, hidden, intermediate)
        if not gate_up.is_meta:
            gate_up.normal_(std=0.02)
            down.normal_(std=0.02)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)


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
        e = self.experts
        out = grouped_experts(x, ids, weights, e.gate_up_proj, e.down_proj)
        return out if self.tp_size == 1 else all_reduce(out)
