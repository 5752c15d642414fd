"""radixserve: LLM serving with a radix-tree KV cache and tree-structured attention.

`import radixserve as rs` gives the Engine and the frontend DSL (`rs.function`, `rs.gen`,
`rs.select`, `rs.user`, `rs.RuntimeEndpoint`, ...), all loaded lazily so that importing the
package (the CLI, HTTP clients) pulls in neither torch nor transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.config import EngineConfig
    from radixserve.engine.engine import Engine

__all__ = ["Engine", "EngineConfig"]  # plus every name of radixserve.frontend.__all__


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from radixserve.config import EngineConfig

        return EngineConfig
    if not name.startswith("_"):
        frontend = importlib.import_module("radixserve.frontend")  # no torch imported
        if name in frontend.__all__:
            return getattr(frontend, name)
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
