"""radixserve: LLM serving with a radix-tree KV cache and tree-structured attention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "EngineConfig"]

if TYPE_CHECKING:
    from radixserve.config import EngineConfig
    from radixserve.engine.engine import Engine


def __getattr__(name: str) -> Any:
    # Lazy: `import radixserve` stays cheap (no torch/transformers) for the CLI and clients.
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from radixserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
