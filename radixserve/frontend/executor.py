"""The interpreter core: one `Executor` per program state runs its expressions in order.

Concurrency model (SGLang's): `s += expr` only queues `expr`; a drain thread of that state
executes its queue in submission order and exits when the queue is empty. Reading a
variable or the text waits for the queue to drain. So a loop over fork children

    for f in forks: f += gen("x")

returns at once, and the children's gens reach the backend together (one drain thread per
child), where the runtime batches them.

Invariants:
- At most one drain thread per executor at a time (`_draining`), so expressions of one
  state run sequentially; different states run concurrently.
- `text`, `variables`, `meta_info`, `messages` change only on the drain thread, or on the
  submitting thread while no drain runs (fork copy, join); readers `sync()` first.
- After a failure every later expression of that state is skipped; `sync()` raises it.
"""

from __future__ import annotations

import copy
import random
import threading
from collections import deque
from typing import Any

from radixserve.frontend.backend import Backend, GenRequest
from radixserve.frontend.ir import (
    Expr,
    ExprList,
    Gen,
    Imports,
    RoleBegin,
    RoleEnd,
    SamplingOptions,
    Select,
    Text,
    convert_value,
    sampling_dict,
)
from radixserve.prompt.pml import Prompt


class Executor:
    def __init__(
        self,
        backend: Backend,
        defaults: SamplingOptions,
        stream: bool = False,
        rng: random.Random | None = None,
        family: list[Executor] | None = None,
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream  # gens deliver text piece by piece (for text_iter)
        self.rng = rng or random.Random()
        self.text = ""
        self.modules: Prompt | None = None  # imports(...) the program began with
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages: list[dict[str, str]] = []
        self.new_vars: list[str] = []  # names set since this state was created (join)
        self.fork_len = 0  # len(text) when this state was forked off its parent
        self.error: BaseException | None = None
        # The open role and where its content starts in `text`; whether any role was seen.
        self._role: tuple[str, int] | None = None
        self._roles_seen = False
        # text_iter's record: (variable being generated or None, piece of text), in order.
        self._pieces: list[tuple[str | None, str]] = []
        self._queue: deque[Expr] = deque()
        self._cond = threading.Condition()
        self._draining = False
        self._closed = False  # no more submissions (the program body returned)
        # Every executor of one program run (root and all fork descendants).
        self.family = family if family is not None else []
        self.family.append(self)

    # ---------------------------------------------------------------- submission side
    def submit(self, expr: Expr) -> None:
        """Queue `expr`; start a drain thread if none runs. Never blocks on the backend."""
        with self._cond:
            if self._closed:
                raise RuntimeError("this program state is closed (joined, or its program ended)")
            self._queue.append(expr)
            if self._draining:
                return
            self._draining = True
        threading.Thread(target=self._drain, name="radixserve-program", daemon=True).start()

    def sync(self) -> None:
        """Wait until every queued expression ran; raise the state's failure if any."""
        with self._cond:
            self._cond.wait_for(lambda: not self._draining)
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """No more submissions: lets text_iter finish once the queue drained."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def fork(self, n: int) -> list[Executor]:
        """n copies of this state after committing its text to the backend's prefix cache
        once, so the children's requests find the shared prefix cached."""
        assert n >= 1, f"fork size must be >= 1, got {n}"
        self.sync()
        if self.modules is None:  # prompts importing modules are not prefix-cached
            self.backend.commit(self.text)
        return [self._copy() for _ in range(n)]

    def _copy(self) -> Executor:
        child = Executor(
            self.backend,
            self.defaults,
            rng=random.Random(self.rng.random()),
            family=self.family,
        )
        child.text = self.text
        child.modules = self.modules
        child.fork_len = len(self.text)
        child.variables = dict(self.variables)
        child.meta_info = dict(self.meta_info)
        child.messages = copy.deepcopy(self.messages)
        child._role, child._roles_seen = self._role, self._roles_seen
        return child

    def join(self, children: list[Executor], mode: str) -> None:
        """Merge fork children back (see ProgramStateGroup.join). Children are closed."""
        for c in children:
            c.sync()
            c.close()
        self.sync()
        if mode == "gather_variable":
            names = list(dict.fromkeys(n for c in children for n in c.new_vars))
            for name in names:
                self._set(name, [c.variables.get(name) for c in children])
                self.meta_info[name] = [c.meta_info.get(name) for c in children]
        elif mode == "concate_and_append":
            added = "".join(c.text[c.fork_len :] for c in children)
            with self._cond:
                self._append_locked(added, None)
        else:
            raise ValueError(
                f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}"
            )

    # ---------------------------------------------------------------- drain side
    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._draining = False
                    self._cond.notify_all()
                    return
                expr = self._queue.popleft()
            if self.error is not None:
                continue  # a failed state skips the rest of its program
            try:
                self._execute(expr)
            except BaseException as e:  # surfaces in sync(): the program's thread raises it
                self.error = e

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Text):
            self._append(expr.value)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, Imports):
            if self.text or self.modules is not None:
                raise ValueError("imports(...) must come first in a program, and only once")
            self.modules = Prompt(expr.schema, expr.uses)
            self._roles_seen = True  # the modules open the conversation (as in PML prompts)
        else:
            raise TypeError(f"cannot execute {expr!r}")

    def _role_begin(self, role: str) -> None:
        if self._role is not None:
            raise ValueError(f"role {role!r} begins inside role {self._role[0]!r}: end it first")
        prefix = self.backend.role_template().begin(role, first=not self._roles_seen)
        self._roles_seen = True
        self._append(prefix)
        self._role = (role, len(self.text))

    def _role_end(self, role: str) -> None:
        if self._role is None or self._role[0] != role:
            raise ValueError(f"role {role!r} ends but the open role is {self._role}")
        content = self.text[self._role[1] :]
        self._role = None
        self._append(self.backend.role_template().end(role))
        self.messages.append({"role": role, "content": content})

    def _gen(self, expr: Gen) -> None:
        opts = expr.resolve(self.defaults)
        req = GenRequest(
            prompt=self.text,
            sampling=sampling_dict(opts),
            return_logprob=bool(opts.return_logprob),
            logprob_start_len=-1 if opts.logprob_start_len is None else opts.logprob_start_len,
            top_logprobs_num=opts.top_logprobs_num or 0,
            return_text_in_logprobs=bool(opts.return_text_in_logprobs),
            name=expr.name,
            dtype=expr.dtype,
            modules=self.modules,
        )
        if self.stream:
            result = self.backend.generate(req, lambda piece: self._append(piece, expr.name))
        else:
            result = self.backend.generate(req)
            self._append(result.text, expr.name)
        if expr.name is not None:
            self._set(expr.name, convert_value(result.text, expr.dtype, expr.name))
            self.meta_info[expr.name] = result.meta_info

    def _select(self, expr: Select) -> None:
        if self.modules is not None:
            raise ValueError("select after imports(...): choices are scored on a full prompt")
        res = self.backend.select(self.text, expr.choices, expr.method, expr.temperature, self.rng)
        choice = expr.choices[res.index]
        self._append(choice, expr.name)
        if expr.name is not None:
            self._set(expr.name, choice)
            self.meta_info[expr.name] = res.meta_info

    # ---------------------------------------------------------------- state updates
    def _set(self, name: str, value: Any) -> None:
        self.variables[name] = value
        if name not in self.new_vars:
            self.new_vars.append(name)

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._set(name, value)

    def _append(self, piece: str, var: str | None = None) -> None:
        with self._cond:
            self._append_locked(piece, var)

    def _append_locked(self, piece: str, var: str | None) -> None:
        if piece:
            self.text += piece
            self._pieces.append((var, piece))
            self._cond.notify_all()

    def pieces_after(self, start: int) -> tuple[list[tuple[str | None, str]], bool]:
        """(pieces from index `start` on, whether no more will come); waits for news."""
        with self._cond:
            self._cond.wait_for(
                lambda: len(self._pieces) > start or (self._closed and not self._draining)
            )
            return self._pieces[start:], self._closed and not self._draining
