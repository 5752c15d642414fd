"""Attention backends, selected in ONE place (`make_backend`) and logged.

- "tree": TreeBackend, shared radix segments attended once for all their requests.
- "flat": FlatBackend, each request attends its whole path (the baseline).
- "none": NoAttentionBackend, writes K/V and returns zeros: a no-attention speed ceiling for
  benchmarks only (its model output is meaningless).
"""

from __future__ import annotations

import logging

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.attention.flat import FlatBackend
from radixserve.attention.tree import TreeBackend
from radixserve.core.batch import ForwardBatch

logger = logging.getLogger(__name__)


class NoAttentionBackend(AttentionBackend):
    """Writes the new K/V (so pool traffic matches the real backends), attends nothing."""

    name = "none"

    def plan(self, batch: ForwardBatch) -> None:
        batch.attn_plan = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch.kv_pool.write(layer, batch.out_cache_loc, k, v)
        return torch.zeros_like(q)  # (T, Hq, D)


BACKEND_CLASSES: dict[str, type[AttentionBackend]] = {  # keys: config.ATTENTION_BACKENDS
    "tree": TreeBackend,
    "flat": FlatBackend,
    "none": NoAttentionBackend,
}


def make_backend(name: str) -> AttentionBackend:
    """Build the attention backend `name` with its default settings; logs the choice.

    Raises ValueError for an unknown name.
    """
    if name not in BACKEND_CLASSES:
        choices = list(BACKEND_CLASSES)
        raise ValueError(f"unknown attention backend {name!r}; choose one of {choices}")
    backend = BACKEND_CLASSES[name]()
    logger.info("attention backend: %s (%s %s)", name, type(backend).__name__, vars(backend))
    if name == "none":
        logger.warning("attention backend 'none' computes no attention: benchmarks only")
    return backend


__all__ = [
    "AttentionBackend",
    "FlatBackend",
    "NoAttentionBackend",
    "TreeBackend",
    "make_backend",
]
