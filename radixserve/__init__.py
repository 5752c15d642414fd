"""radixserve: LLM serving with a radix-tree KV cache and tree-structured attention.

`import radixserve as rs` gives the Engine and the frontend DSL (`rs.function`, `rs.gen`,
`rs.select`, `rs.user`, `rs.RuntimeEndpoint`, ...), all loaded lazily so that importing the
package (the CLI, HTTP clients) pulls in neither torch nor transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.config import EngineConfig
    from radixserve.engine.engine import Engine

_FRONTEND_NAMES = frozenset(
    {
        "Backend",
        "BackendError",
        "EngineBackend",
        "ProgramState",
        "ProgramStateGroup",
        "RuntimeEndpoint",
        "SglFunction",
        "Trace",
        "TracingBackend",
        "assistant",
        "assistant_begin",
        "assistant_end",
        "flush_cache",
        "function",
        "gen",
        "gen_int",
        "gen_string",
        "get_default_backend",
        "greedy_token_selection",
        "select",
        "set_default_backend",
        "system",
        "system_begin",
        "system_end",
        "token_length_normalized",
        "user",
        "user_begin",
        "user_end",
    }
)  # == radixserve.frontend.__all__ (tests/test_package.py checks)

__all__ = ["Engine", "EngineConfig", *sorted(_FRONTEND_NAMES)]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    if name == "EngineConfig":
        from radixserve.config import EngineConfig

        return EngineConfig
    if name in _FRONTEND_NAMES:
        from radixserve import frontend

        return getattr(frontend, name)
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
