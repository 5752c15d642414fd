"""What a program sees as `s` (ProgramState), fork groups, and running programs.

`run_program` executes the function body on the calling thread (or, with stream=True, on a
background thread so the caller can iterate `text_iter()` at once), then waits for every
state of the run (fork descendants included) and re-raises the first failure.
`run_program_batch` runs many programs on a thread pool; their concurrent requests are what
lets the runtime batch them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.frontend.backend import Backend
from radixserve.frontend.executor import Executor
from radixserve.frontend.ir import ExprLike, ExprList, RoleBegin, RoleEnd, SamplingOptions, to_expr


class ProgramState:
    """The `s` of a program: append with `s += ...`, read with `s["name"]`, `s.text()`."""

    def __init__(self, executor: Executor) -> None:
        self._ex = executor
        self.ret_value: Any = None  # the program function's return value
        self._body_error: BaseException | None = None
        self._body_thread: threading.Thread | None = None  # stream=True: runs the body

    # ---- building
    def __iadd__(self, other: ExprLike) -> ProgramState:
        self._ex.submit(to_expr(other))
        return self

    def _role(self, role: str, expr: ExprLike | None) -> Any:
        if expr is not None:
            self._ex.submit(ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)]))
            return None
        return self._role_scope(role)

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self._ex.submit(RoleBegin(role))
        yield
        self._ex.submit(RoleEnd(role))

    def system(self, expr: ExprLike | None = None) -> Any:
        """`s.system("...")` appends a system message; `with s.system():` opens one."""
        return self._role("system", expr)

    def user(self, expr: ExprLike | None = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: ExprLike | None = None) -> Any:
        return self._role("assistant", expr)

    def fork(self, size: int = 1) -> ProgramStateGroup:
        """`size` copies of this state; the text so far is committed to the runtime's prefix
        cache once, so the children's requests share it."""
        return ProgramStateGroup([ProgramState(e) for e in self._ex.fork(size)], self)

    # ---- reading (each waits for the queued expressions)
    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._ex.variables

    def get_var(self, name: str) -> Any:
        self.sync()
        if name not in self._ex.variables:
            known = sorted(self._ex.variables)
            raise KeyError(f"no variable {name!r} in this program state (defined: {known})")
        return self._ex.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self._ex.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The runtime's meta_info of gen/select `name` (token counts, cached_tokens,
        finish_reason, logprobs when asked; lists after a gather join)."""
        self.sync()
        return self._ex.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self._ex.text

    def messages(self) -> list[dict[str, str]]:
        """The completed role blocks as chat messages ({"role", "content"})."""
        self.sync()
        return [dict(m) for m in self._ex.messages]

    def sync(self) -> None:
        """Wait for the queued expressions (and, from outside a streamed program's body,
        for the body to return, so everything it will append is there)."""
        body = self._body_thread
        if body is not None and body is not threading.current_thread():
            body.join()
        self._ex.sync()

    def error(self) -> BaseException | None:
        """The failure of this program (its body, or one of its expressions), if any."""
        return self._body_error or self._ex.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Pieces of the text as they are produced (of one variable with `var_name`); ends
        when the program has finished; re-raises the program's failure at the end."""
        seen = 0
        while True:
            pieces, done = self._ex.pieces_after(seen)
            seen += len(pieces)
            for var, piece in pieces:
                if var_name is None or var == var_name:
                    yield piece
            if done:
                break
        err = self.error()
        if err is not None:
            raise err

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The children of `s.fork(n)`: index, iterate, `+=` (one expr to all, or a list with
    one per child), then `join()`."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # `forks[i] += x` assigns the (same) state back; anything else is a mistake.
        if value is not self.states[i]:
            raise TypeError("fork children cannot be replaced; use forks[i] += ...")

    def __iadd__(self, other: ExprLike | list[ExprLike]) -> ProgramStateGroup:
        if isinstance(other, list):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} fork children")
            for s, e in zip(self.states, other):
                s += e
        else:
            for s in self.states:
                s += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for the children and merge them into the parent, then close them.

        gather_variable: every variable a child set after the fork becomes, in the parent,
        the list of the children's values (None where a child did not set it); same for
        meta_info. concate_and_append: the children's new text is appended to the parent's.
        """
        self.parent._ex.join([s._ex for s in self.states], mode)


ProgramFn = Callable[..., Any]


def run_program(
    func: ProgramFn,
    backend: Backend,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    defaults: SamplingOptions,
    stream: bool,
) -> ProgramState:
    """Run one program. Non-stream: returns when everything ran; raises its failure."""
    state = ProgramState(Executor(backend, defaults, stream=stream))
    if stream:
        thread = threading.Thread(
            target=_run_body, args=(state, func, args, kwargs, False), daemon=True
        )
        state._body_thread = thread
        thread.start()
        return state
    _run_body(state, func, args, kwargs, True)
    return state


def _run_body(
    state: ProgramState,
    func: ProgramFn,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    raise_errors: bool,
) -> None:
    """Execute the body, then wait for every state of the run; close the root state."""
    root = state._ex
    try:
        state.ret_value = func(state, *args, **kwargs)
        for ex in list(root.family):
            ex.sync()
    except BaseException as e:
        state._body_error = e
        if raise_errors:
            raise
    finally:
        root.close()


def run_program_batch(
    func: ProgramFn,
    backend: Backend,
    batch: list[dict[str, Any]],
    defaults: SamplingOptions,
    num_threads: int | str,
    progress_bar: bool,
) -> list[ProgramState]:
    """Run one program per kwargs dict, up to `num_threads` at once; failures do not stop
    the others: each shows in its state's `error()` (and re-raises on reading it)."""
    if not batch:
        return []
    if num_threads == "auto":
        num_threads = max(64, (os.cpu_count() or 1) * 16)
    assert isinstance(num_threads, int) and num_threads >= 1, f"num_threads: {num_threads!r}"

    def one(kw: dict[str, Any]) -> ProgramState:
        state = ProgramState(Executor(backend, defaults))
        _run_body(state, func, (), kw, False)
        return state

    with ThreadPoolExecutor(min(num_threads, len(batch))) as pool:
        results = pool.map(one, batch)
        if progress_bar:
            from tqdm import tqdm

            results = tqdm(results, total=len(batch))
        return list(results)
