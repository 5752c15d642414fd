"""The radixserve frontend: SGLang's language for LLM programs (`import radixserve as rs`).

    @rs.function
    def qa(s, question):
        s += rs.user(question)
        s += rs.assistant(rs.gen("answer", max_tokens=64))

    rs.set_default_backend(rs.RuntimeEndpoint("http://127.0.0.1:30000"))  # or EngineBackend()
    print(qa.run(question="What is 2 + 2?")["answer"])

Modules: ir (expressions, sampling options), api (the DSL names), interpreter/executor
(program states, fork/join, running), choices (select scoring), backend (the runtime
interface), runtime_endpoint (HTTP), engine_backend (in-process Engine), tracing (no model).
Role markup and prompt modules (`schema`, `module`, ...) come from `radixserve.prompt`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from radixserve.frontend.api import (
    SglFunction,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_default_backend,
    imports,
    register_schema,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixserve.frontend.backend import Backend, BackendError
from radixserve.frontend.choices import greedy_token_selection, token_length_normalized
from radixserve.frontend.interpreter import ProgramState, ProgramStateGroup
from radixserve.frontend.runtime_endpoint import RuntimeEndpoint
from radixserve.frontend.tracing import Trace, TracingBackend
from radixserve.prompt.pml import module, param, role, schema, union, use

if TYPE_CHECKING:
    from radixserve.frontend.engine_backend import EngineBackend

__all__ = [
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
    "imports",
    "module",
    "param",
    "register_schema",
    "role",
    "schema",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "union",
    "use",
    "user",
    "user_begin",
    "user_end",
]


def __getattr__(name: str) -> Any:
    # Lazy: the Engine backend imports torch and the model code; HTTP-only users skip that.
    if name == "EngineBackend":
        from radixserve.frontend.engine_backend import EngineBackend

        return EngineBackend
    raise AttributeError(f"module 'radixserve.frontend' has no attribute {name!r}")
