"""Attention backend interface: the only place the model touches the KV pool.

A backend is chosen once per engine (`attention_backend = "tree" | "flat"`) and logged.
Each step: `plan(batch)` once (host-side bookkeeping, stored in `batch.attn_plan`), then
`forward(...)` once per layer. `forward` writes the new tokens' K/V into the pool before it
attends, so the queries of a multi-token extend see each other (causally).

Attention sinks (gpt-oss: one learned logit per query head that joins the softmax's
denominator and carries no value) are applied once, to a row's final output, by `with_sinks`:
the keys' share of the softmax mass with the sink is sigmoid(lse - sink), lse being the
log-sum-exp over every key the row sees. Backends that merge partial results by log-sum-exp
(tree attention, sliding windows) apply it after the last merge, never per part.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from radixserve.core.batch import ForwardBatch


class AttentionBackend(ABC):
    name: str

    def keeps(self, num_requests: int, num_tokens: int, max_q_len: int) -> bool:
        """Whether a shared segment of `num_tokens` tokens under `num_requests` requests
        (longest query block `max_q_len` rows) is attended once for all of them: never, but
        in a backend that attends shared segments."""
        return False

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Precompute per-step metadata into `batch.attn_plan`; does not touch K/V."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (T, q_heads, head_dim)
        k: torch.Tensor,  # (T, kv_heads, head_dim) new tokens' keys (after RoPE), any strides
        v: torch.Tensor,  # (T, kv_heads, head_dim)
        layer: int,
        batch: ForwardBatch,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,  # (q_heads,) sink logits
    ) -> torch.Tensor:
        """Write k/v at `batch.out_cache_loc` of `layer`, attend, return (T, q_heads, head_dim).

        Query row t of request r at position p attends keys at positions 0..p of request r
        (with a `window` W > 0: positions max(0, p - W + 1)..p, attention/window.py), each
        score scaled by `scale` and, with `softcap` c > 0, capped at c * tanh(s / c); with
        `sinks`, head h's softmax also has the logit sinks[h] with no value (`with_sinks`).
        """


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The attention output with a sink logit per head in the softmax -> (T, Hq, D) in out's
    dtype: out (T, Hq, D) and lse (T, Hq) float32 are over all of each row's keys, sinks
    (Hq,). A row with no key (lse -inf) stays 0. Without sinks, `out` itself."""
    if sinks is None:
        return out
    keys_share = torch.sigmoid(lse - sinks.float())  # (T, Hq): exp(lse) / (exp(lse) + e^sink)
    return (out.float() * keys_share.unsqueeze(-1)).to(out.dtype)
