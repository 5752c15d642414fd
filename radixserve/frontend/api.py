"""The public DSL, with SGLang's names and defaults (an SGLang program ports by changing its
import): `function`, `gen`, `gen_int`, `gen_string`, `select`, `system`/`user`/`assistant`,
`set_default_backend`, `flush_cache`; prompt modules: `register_schema`, `imports`."""

from __future__ import annotations

import inspect
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from radixserve.frontend.backend import Backend
from radixserve.frontend.choices import ChoicesMethod, token_length_normalized
from radixserve.frontend.interpreter import ProgramState, run_program, run_program_batch
from radixserve.frontend.ir import (
    RUN_DEFAULTS,
    Expr,
    ExprLike,
    ExprList,
    Gen,
    Imports,
    RoleBegin,
    RoleEnd,
    SamplingOptions,
    Select,
    dtype_name,
    normalize_schema,
    normalize_stop,
    to_expr,
)
from radixserve.prompt.pml import Schema, Use, use

# run()/run_batch() keywords that set sampling defaults (everything else goes to the
# program function). regex/json_schema are per-gen only, and so is seed: one seed for every
# gen would make all fork children sample the same text.
PER_GEN_ONLY = {"regex", "json_schema", "seed"}
RUN_SAMPLING_KEYS = frozenset(f.name for f in fields(SamplingOptions)) - PER_GEN_ONLY

_default_backend: Backend | None = None
# One EngineBackend per Engine (keyed by id; the backend keeps its engine alive): an engine
# passed as backend= to many runs must keep one dispatcher thread, not start one per run.
_engine_backends: dict[int, Backend] = {}
_engine_backends_lock = threading.Lock()


def set_default_backend(backend: Any) -> None:
    """The backend `run` uses when none is given: a Backend, or a radixserve.Engine (wrapped
    in an EngineBackend)."""
    global _default_backend
    _default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default_backend


def as_backend(backend: Any) -> Backend:
    if isinstance(backend, Backend):
        return backend
    from radixserve.engine.engine import Engine  # lazy: torch only when an Engine is used

    if isinstance(backend, Engine):
        from radixserve.frontend.engine_backend import EngineBackend

        with _engine_backends_lock:
            if id(backend) not in _engine_backends:
                _engine_backends[id(backend)] = EngineBackend(backend)
            return _engine_backends[id(backend)]
    raise TypeError(
        f"a backend must be a radixserve.frontend Backend (RuntimeEndpoint, EngineBackend) "
        f"or a radixserve.Engine, got {type(backend).__name__}"
    )


def _backend(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise RuntimeError(
            "no backend: pass backend=... or call set_default_backend(RuntimeEndpoint(url)) "
            "or set_default_backend(EngineBackend())"
        )
    return _default_backend


def flush_cache(backend: Any = None) -> bool:
    return _backend(backend).flush_cache()


def register_schema(schema: Schema, backend: Any = None) -> list[str]:
    """Register a prompt-module schema (`schema(...)`) on the backend; its module names."""
    return _backend(backend).register_schema(schema)


def imports(schema_name: str, *uses: Use | str) -> Imports:
    """Start a program from prompt modules of a registered schema: `s += imports("docs",
    "intro", use("ask", topic="x"))` (a name imports a module without arguments). It must
    come first; every later gen sends the imports plus the program's text."""
    return Imports(schema_name, tuple(use(u) if isinstance(u, str) else u for u in uses))


class SglFunction:
    """A program: a Python function whose first parameter is the state `s`."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None):
        params = list(inspect.signature(func).parameters)
        if not params or params[0] != "s":
            raise TypeError(f"the first parameter of {func.__name__} must be 's', got {params}")
        self.func = func
        self.arg_names = params[1:]
        self.bind_arguments = dict(bind_arguments or {})

    def bind(self, **kwargs: Any) -> SglFunction:
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.func.__name__} has no parameters {sorted(unknown)}")
        return SglFunction(self.func, {**self.bind_arguments, **kwargs})

    def _split(self, kwargs: dict[str, Any]) -> tuple[SamplingOptions, dict[str, Any]]:
        """(sampling defaults, function keyword arguments) from run()'s keywords."""
        sampling = {k: kwargs.pop(k) for k in list(kwargs) if k in RUN_SAMPLING_KEYS}
        if "stop" in sampling:
            sampling["stop"] = normalize_stop(sampling["stop"])
        return SamplingOptions(**sampling).over(RUN_DEFAULTS), {**self.bind_arguments, **kwargs}

    def run(
        self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any
    ) -> ProgramState:
        """Run the program once. Keywords named like sampling parameters (max_new_tokens,
        temperature, stop, top_p, ..., return_logprob) set the defaults of every gen
        (SGLang's: 128 tokens, temperature 1.0); the others are the function's arguments.
        With stream=True it returns at once: iterate `state.text_iter()`."""
        defaults, fkwargs = self._split(dict(kwargs))
        return run_program(self.func, _backend(backend), args, fkwargs, defaults, stream)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any] | Sequence[Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **kwargs: Any,
    ) -> list[ProgramState]:
        """Run the program once per entry (a kwargs dict, or a tuple of positional
        arguments), concurrently; `kwargs` are sampling defaults as in `run`."""
        defaults, extra = self._split(dict(kwargs))
        if extra:
            raise TypeError(f"run_batch: unknown keywords {sorted(extra)}")
        batch = [self._as_kwargs(entry) for entry in batch_kwargs]
        return run_program_batch(
            self.func, _backend(backend), batch, defaults, num_threads, progress_bar
        )

    def _as_kwargs(self, entry: dict[str, Any] | Sequence[Any]) -> dict[str, Any]:
        if isinstance(entry, dict):
            return {**self.bind_arguments, **entry}
        if len(entry) > len(self.arg_names):
            raise TypeError(f"{len(entry)} arguments for parameters {self.arg_names}")
        return {**self.bind_arguments, **dict(zip(self.arg_names, entry))}

    def trace(self, *args: Any, backend: Any = None, **kwargs: Any) -> Any:
        """Run the program with no model, on a TracingBackend (pass one to choose its role
        template), and return a `Trace`: the finished state and every gen/select/commit
        the program made, with its exact prompt and parameters."""
        from radixserve.frontend.tracing import Trace, TracingBackend

        tracer = backend if backend is not None else TracingBackend()
        assert isinstance(tracer, TracingBackend), f"trace needs a TracingBackend, got {tracer!r}"
        state = self.run(*args, backend=tracer, **kwargs)
        return Trace(state, list(tracer.events))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`f(s, ...)` with a program state runs the body on that state (a subroutine);
        otherwise `f(...)` is `f.run(...)`."""
        if args and isinstance(args[0], ProgramState):
            return self.func(*args, **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)


def function(func: Callable[..., Any] | None = None, **_: Any) -> Any:
    """Decorator: `@function` or `@function()` (SGLang's options are accepted, unused)."""
    if func is not None:
        return SglFunction(func)
    return SglFunction


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: Sequence[str] | None = None,
    choices_method: ChoicesMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict[str, Any] | None = None,
    seed: int | None = None,
    repetition_penalty: float | None = None,
) -> Expr:
    """Generate into variable `name` (None: append only). Unset options inherit run()'s.

    `choices=` makes it a `select`; `dtype` (int, float, str, bool) adds SGLang's regex for
    that type and stores the parsed value; `regex`/`json_schema` pass through to the
    runtime as sampling parameters (a dict schema is serialized to JSON).
    """
    if choices:
        method = choices_method or token_length_normalized
        return Select(name, list(choices), temperature or 0.0, method)
    if regex is not None:
        re.compile(regex)  # fail at the call site, as SGLang does
    options = SamplingOptions(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        stop=normalize_stop(stop),
        stop_token_ids=None if stop_token_ids is None else list(stop_token_ids),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        ignore_eos=ignore_eos,
        seed=seed,
        regex=regex,
        json_schema=normalize_schema(json_schema),
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )
    return Gen(name, options, dtype_name(dtype))


def gen_int(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=int, **kwargs)


def gen_string(name: str | None = None, **kwargs: Any) -> Expr:
    return gen(name, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: Sequence[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesMethod = token_length_normalized,
) -> Expr:
    """Append the option the model finds most likely (by `choices_method`) and store it in
    `name`. temperature > 0 draws from softmax(mean token logprob / temperature)."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    return Select(name, list(choices), temperature, choices_method)


def _role(role: str, expr: ExprLike | None) -> Expr:
    inner = [] if expr is None else [to_expr(expr)]
    return ExprList([RoleBegin(role), *inner, RoleEnd(role)])


def system(expr: ExprLike | None = None) -> Expr:
    return _role("system", expr)


def user(expr: ExprLike | None = None) -> Expr:
    return _role("user", expr)


def assistant(expr: ExprLike | None = None) -> Expr:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")
