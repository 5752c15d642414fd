"""Requests whose regex / json_schema / ebnf is being compiled off the scheduler thread.

A request with a pattern not in the compiler's cache waits here, holding nothing, until its
future is done (then it is queued, or refused with 400 if the pattern failed) or its
deadline passes (refused with 400): a slow pattern never stalls the requests being served.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from radixserve.constrained.backend import CompiledGrammar
from radixserve.constrained.grammar import COMPILE_TIMEOUT_S
from radixserve.core.request import TokenizedRequest

Built = tuple[TokenizedRequest, CompiledGrammar | None]  # ready to queue
Failed = tuple[TokenizedRequest, str]  # refused (400), with the reason


@dataclass
class _Compile:
    request: TokenizedRequest
    future: Future[CompiledGrammar | None]
    deadline: float  # time.monotonic()


class PendingCompiles:
    def __init__(self, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._items: list[_Compile] = []

    def __len__(self) -> int:
        return len(self._items)

    @property
    def requests(self) -> list[TokenizedRequest]:
        return [c.request for c in self._items]

    def has(self, rid: str) -> bool:
        return any(c.request.rid == rid for c in self._items)

    def add(self, request: TokenizedRequest, future: Future[CompiledGrammar | None]) -> None:
        self._items.append(_Compile(request, future, time.monotonic() + self.timeout_s))

    def remove(self, rid: str) -> list[TokenizedRequest]:
        """Forget `rid` (aborted); returns its request if it was here."""
        gone = [c.request for c in self._items if c.request.rid == rid]
        self._items = [c for c in self._items if c.request.rid != rid]
        return gone

    def poll(self) -> tuple[list[Built], list[Failed]]:
        """Take the finished compiles: (built: request and grammar, failed: request and why)."""
        built: list[Built] = []
        failed: list[Failed] = []
        keep: list[_Compile] = []
        now = time.monotonic()
        for c in self._items:
            field = (c.request.sampling.constraint or ("pattern", ""))[0]
            if c.future.done():
                error = c.future.exception()
                if error is None:
                    built.append((c.request, c.future.result()))
                elif isinstance(error, ValueError):  # InvalidRequest: names the field
                    failed.append((c.request, str(error)))
                else:  # the backend itself failed (a Rust panic arrives as a BaseException)
                    failed.append((c.request, f"{field}: cannot compile: {error!r}"))
            elif now > c.deadline:
                failed.append((c.request, f"{field}: did not compile in {self.timeout_s:.0f} s"))
            else:
                keep.append(c)
        self._items = keep
        return built, failed

    def wait(self, timeout_s: float) -> None:
        """Block until some compile is done or `timeout_s` passed (an otherwise idle step)."""
        if self._items:
            wait([c.future for c in self._items], timeout_s, return_when=FIRST_COMPLETED)
