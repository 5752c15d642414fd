"""The mixture-of-experts MLP (Qwen3-MoE, OLMoE, Mixtral, gpt-oss): a router picks `top_k` of
`E` SwiGLU experts for each token and the token's output is their outputs' weighted sum.

    router    logits = x @ gate.T (+ bias)           (T, E) in the model dtype
              probs  = softmax(logits) in float32    (T, E)
              w, ids = topk(probs, k)                (T, k): torch.topk, so ties between equal
                                                     scores resolve exactly as transformers'
              w      = w / w.sum(-1) if renormalised (Mixtral's softmax over the top-k logits
                                                     is the same numbers)
              gpt-oss (`topk_softmax`): w, ids = topk(logits, k), then w = softmax(w): ties
                                                     resolve on the logits, as transformers
    experts   one (token, slot) row per selected expert, T * k rows, sorted by expert id (the
              grouping llama.cpp's mul_mat_id does): expert e's rows are one contiguous run,
              multiplied by its weights once per step

                  rows sorted by expert:  [ e=0: n0 rows | e=2: n2 rows | e=5: n5 rows | ... ]
                  out[run] = down[e] @ act(gate[e] @ x, up[e] @ x)

              act(g, u) = silu(g) * u (SwiGLU), or gpt-oss's clamped SwiGLU (`clamped_swiglu`);
              with expert biases each product adds its expert's bias row

              then each row times its routing weight, put back in (token, slot) order and
              summed over the k slots of its token (transformers' grouped path, op for op).

Weights are stored stacked: `experts.gate_up_proj` (E, 2 * I, hidden) = cat(gate, up) per
expert, `experts.down_proj` (E, hidden, I), and with biases `experts.gate_up_proj_bias`
(E, 2 * I) and `experts.down_proj_bias` (E, hidden); a GGUF's experts in a block format stay
in their blocks, three stacks read in place by one native call a step (`QuantExperts`, its
biases and activation alike).
Under tensor parallelism each rank holds the slice [r * I / N, (r + 1) * I / N) of every
expert's I (as the dense MLP's; its biases alike, the down bias on rank 0 only), the router
is replicated, and the partial sums are all-reduced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from radixserve.distributed.parallel import all_reduce
from radixserve.models.config import ModelConfig
from radixserve.models.quant import (
    NativeParts,
    QuantStack,
    Release,
    dequantize,
    native_parts,
    unread,
)
from radixserve.models.quant import ops as quant_ops

Activation = Callable[[Tensor, Tensor], Tensor]  # (gate, up) (n, I) each -> (n, I)
# A layer's quantized experts as the native `experts` call takes them: gate/up and down
# stacks, their float32 biases (E, 2I) and (E, hidden) or None, the clamped SwiGLU's alpha
# and limit (alpha 0: SwiGLU).
NativeExperts = tuple[NativeParts, NativeParts, Tensor | None, Tensor | None, float, float]


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def clamped_swiglu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's experts: (u + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
    u = clamp(up, -limit, limit) (transformers' op order)."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def route(
    logits: Tensor, top_k: int, renormalise: bool, topk_softmax: bool = False
) -> tuple[Tensor, Tensor]:
    """Router logits (T, E) -> (weights (T, k) float32, expert ids (T, k) int64), each row's
    experts in descending score."""
    if topk_softmax:
        top, ids = torch.topk(logits, top_k, dim=-1)  # (T, k)
        return torch.softmax(top, dim=-1, dtype=torch.float32), ids
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
    init (biases 0), left empty on the meta device (the loader assigns them). Called as
    (e, rows): down[e] @ act(g, u) (+ the biases) with g, u the halves of gate_up[e] @ rows."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, bias: bool,
        act: Activation = swiglu,
    ) -> None:  # fmt: skip
        super().__init__()
        self.act = act
        gate_up = torch.empty(num_experts, 2 * intermediate, hidden)
        down = torch.empty(num_experts, hidden, intermediate)
        if not gate_up.is_meta:
            gate_up.normal_(std=0.02)
            down.normal_(std=0.02)
        self.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        self.down_proj = nn.Parameter(down, requires_grad=False)
        self.gate_up_proj_bias: nn.Parameter | None = None
        self.down_proj_bias: nn.Parameter | None = None
        if bias:
            gate_up_bias = torch.zeros(num_experts, 2 * intermediate)
            down_bias = torch.zeros(num_experts, hidden)
            self.gate_up_proj_bias = nn.Parameter(gate_up_bias, requires_grad=False)
            self.down_proj_bias = nn.Parameter(down_bias, requires_grad=False)

    def mix(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """grouped_experts over these experts -> (T, hidden) in x's dtype."""
        return grouped_experts(x, ids, weights, self, x.shape[-1])

    def forward(self, e: int, rows: Tensor) -> Tensor:
        h = F.linear(rows, self.gate_up_proj[e])  # (n, 2I)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[e]
        gate, up = h.chunk(2, dim=-1)  # (n, I) each
        out = F.linear(self.act(gate, up), self.down_proj[e])  # (n, hidden)
        return out if self.down_proj_bias is None else out + self.down_proj_bias[e]


class QuantExperts(nn.Module):
    """A GGUF's experts in their blocks: the stacks `gate`, `up` (E, I, row bytes) and
    `down` (E, hidden, row bytes), views of the file's map, held as buffers and used in
    place; with `bias` (gpt-oss) the float32 rows `gate_up_proj_bias` (E, 2I) and
    `down_proj_bias` (E, hidden) added to each expert's products, and with `swiglu`
    (alpha, limit) the clamped SwiGLU instead of SwiGLU. `mix` runs the selected experts in
    the native `experts` call (quant_cpu.cpp: one parallel loop over all selected experts'
    gate/up rows, one over their down rows), a step reading only the experts its tokens
    picked; activations are float32 throughout, as a QuantLinear's. Without the native
    build each selected expert is dequantized."""

    def __init__(
        self, gate: QuantStack, up: QuantStack, down: QuantStack, activations: str,
        bias: tuple[Tensor, Tensor] | None = None, swiglu: tuple[float, float] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        assert gate.in_features == up.in_features and len({len(gate), len(up), len(down)}) == 1
        self.activations = activations
        self.formats = [gate.fmt, up.fmt, down.fmt]
        self.hidden, self.intermediate = gate.in_features, down.in_features
        for name, stack in zip(("gate", "up", "down"), (gate, up, down)):
            self.register_buffer(name, stack.blocks)
        gate_up_bias, down_bias = bias if bias is not None else (None, None)
        if bias is not None:
            e, inter = len(gate), gate.blocks.shape[1] + up.blocks.shape[1]
            assert gate_up_bias is not None and tuple(gate_up_bias.shape) == (e, inter), inter
            assert down_bias is not None and tuple(down_bias.shape) == (e, down.blocks.shape[1])
        self.gate_up_proj_bias: Tensor | None
        self.down_proj_bias: Tensor | None
        self.register_buffer("gate_up_proj_bias", _f32(gate_up_bias))
        self.register_buffer("down_proj_bias", _f32(down_bias))
        self.swiglu = swiglu or (0.0, 0.0)  # (alpha, limit); alpha 0: SwiGLU
        self._native_arg: NativeExperts | None = None

    def stacks(self) -> list[QuantStack]:
        """gate, up, down as stacks of the buffers."""
        k = [self.hidden, self.hidden, self.intermediate]
        return [QuantStack(b, f, i) for b, f, i in zip(self._blocks(), self.formats, k)]

    def _blocks(self) -> list[Tensor]:
        blocks = [self._buffers[n] for n in ("gate", "up", "down")]
        return [b for b in blocks if b is not None]  # (all set: registered in __init__)

    def native_arg(self, release: Release = None) -> NativeExperts:
        """These experts as the native `experts` call takes them, made once (int8-x parts
        packed into tiles, `release` told of each packed slice: QuantLinear.native_arg)."""
        if self._native_arg is None:
            gate, up, down = self.stacks()
            self._native_arg = (
                native_parts([gate, up], self.activations, release),
                native_parts([down], self.activations, release),
                self.gate_up_proj_bias, self.down_proj_bias, *self.swiglu,
            )  # fmt: skip
        return self._native_arg

    def unread_blocks(self) -> list[Tensor]:
        """The stacks whose packed copies the native call reads instead."""
        if self._native_arg is None:
            return []
        gate, up, down = self._blocks()
        (_, gate_up_codes, _), (_, down_codes, _) = self._native_arg[:2]
        return unread([gate, up], gate_up_codes) + unread([down], down_codes)

    def mix(self, x: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
        """grouped_experts over these experts, float32 inside -> (T, hidden) in x's dtype."""
        x32, w32 = x.float().contiguous(), weights.float()
        native = quant_ops()
        if native is None:
            out = grouped_experts(x32, ids, w32, self._dequantized_expert, self.hidden)
        else:
            out = native.experts(x32, ids, w32, self.native_arg())
        return out.to(x.dtype)

    def _dequantized_expert(self, e: int, rows: Tensor) -> Tensor:
        gate, up, down = (dequantize(s.blocks[e], s.fmt, s.in_features) for s in self.stacks())
        h = rows @ torch.cat([gate, up]).T  # (n, 2I)
        if self.gate_up_proj_bias is not None:
            h = h + self.gate_up_proj_bias[e]
        g, u = h.chunk(2, dim=-1)
        alpha, limit = self.swiglu
        act = clamped_swiglu(g, u, alpha, limit) if alpha else F.silu(g) * u
        out = act @ down.T  # (n, hidden)
        return out if self.down_proj_bias is None else out + self.down_proj_bias[e]

    def _apply(self, fn: Any, recurse: bool = True) -> QuantExperts:
        self._native_arg = None
        return super()._apply(fn, recurse)


def _f32(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.float().contiguous()


class MoE(nn.Module):
    """A layer's mixture-of-experts MLP: x (T, hidden) -> (T, hidden). `router` is the
    (E, hidden) projection the decoder builds (a GGUF's quantized router becomes a
    QuantLinear like any other projection); `config` is one rank's shard under TP."""

    def __init__(self, config: ModelConfig, router: nn.Module, tp_size: int = 1) -> None:
        super().__init__()
        self.top_k, self.renormalise = config.num_experts_per_tok, config.norm_topk_prob
        self.topk_softmax = config.topk_softmax
        self.weights_f32 = config.routing_weights_f32
        self.tp_size = tp_size
        self.gate = router
        size = config.moe_intermediate_size
        act: Activation = swiglu
        if config.swiglu_alpha:
            alpha, limit = config.swiglu_alpha, config.swiglu_limit
            act = functools.partial(clamped_swiglu, alpha=alpha, limit=limit)
        self.experts: Experts | QuantExperts = Experts(
            config.num_experts, config.hidden_size, size, config.expert_bias, act
        )

    def forward(self, x: Tensor) -> Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalise, self.topk_softmax)
        if not self.weights_f32:  # all but Mixtral round them to the model dtype first
            weights = weights.to(x.dtype)
        out = self.experts.mix(x, ids, weights)
        return out if self.tp_size == 1 else all_reduce(out)
