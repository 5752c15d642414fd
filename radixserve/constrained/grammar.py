"""The grammar compiler: a request's constraint (regex / json_schema / ebnf) compiled once per
tokenizer by the chosen backend (backend.py: llguidance, xgrammar, outlines), kept in an LRU
cache.

    GrammarCompiler            one per tokenizer and backend
      .compile(params)         -> CompiledGrammar | None; LRU cache per (field, pattern);
                                  InvalidRequest (a ValueError) naming the field
      .compile_async(params)   -> Future of the same, built on one of COMPILE_THREADS
                                  daemon threads
      .new_state(params)       -> GrammarState | None, one per sample (n > 1: one each)

Backends release the GIL while they build, so `compile_async` keeps the scheduler stepping;
the scheduler gives up on a compile after COMPILE_TIMEOUT_S. A compile cannot be stopped, so
at most COMPILE_THREADS run at once, whatever patterns keep arriving: the others wait their
turn in order, and one still waiting COMPILE_TIMEOUT_S after it was asked for is dropped
unbuilt (its future raises TimeoutError). The backend itself (its view of the vocabulary:
~0.3-1 s for 49k tokens) is built on the first compile.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from radixserve.constrained.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    GrammarState,
    make_grammar_backend,
)
from radixserve.core.params import SamplingParams

logger = logging.getLogger("radixserve.constrained")

DEFAULT_BACKEND = "llguidance"  # fastest measured (docs/benchmarks.md, bench_grammar.py)
DEFAULT_CACHE_SIZE = 64  # compiled patterns kept (LRU)
COMPILE_TIMEOUT_S = 10.0  # the scheduler refuses a request whose pattern compiles longer
COMPILE_THREADS = 2  # patterns compiled at once (each thread stays, for the next ones)

__all__ = ["COMPILE_TIMEOUT_S", "GrammarCompiler", "GrammarError"]


Job = tuple[SamplingParams, Future[CompiledGrammar | None], float]


class GrammarCompiler:
    """Compiles the constraint of sampling params for ONE tokenizer with backend `backend`.

    `eos_token_ids` are the model's eos ids; the tokenizer's own eos (else the smallest) is
    the automaton's end token. `vocab_size` is the model's logits width (masks cover it; ids
    past the tokenizer are never allowed). Thread-safe: the cache and the backend are
    guarded by a lock, compilations run outside it.
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Iterable[int],
        vocab_size: int,
        cache_size: int = DEFAULT_CACHE_SIZE,
        backend: str = DEFAULT_BACKEND,
    ) -> None:
        eos = frozenset(eos_token_ids)
        self.end_id = _end_token(tokenizer, eos)
        self.eos_ids = eos | {self.end_id}
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.backend_name = backend
        self._backend: GrammarBackend | None = None  # built on the first compile
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[tuple[str, str], Future[CompiledGrammar | None]] = {}
        # (params, their future, when it is no longer worth building), oldest first
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._threads = 0  # compile threads started (at most COMPILE_THREADS)

    def compile(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled constraint of `params` (None when it has none).

        Raises InvalidRequest whose message starts with the field name and says what is wrong.
        """
        key = params.constraint
        if key is None:
            return None
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        start = time.perf_counter()
        grammar = self._build(*key)
        logger.info("compiled %s in %.3f s", key[0], time.perf_counter() - start)
        with self._lock:
            self._cache[key] = grammar
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar

    def compile_async(self, params: SamplingParams) -> Future[CompiledGrammar | None]:
        """`compile(params)` on a compile thread (module docstring); already done when there
        is nothing to build (no constraint, or a cached one). Requests with a pattern being
        built or waiting share its one future. The future raises what `compile` raised."""
        future: Future[CompiledGrammar | None] = Future()
        key = params.constraint
        if key is None:
            future.set_result(None)
            return future
        with self._lock:
            if key in self._building:
                return self._building[key]
            cached = key in self._cache
            if not cached:
                self._building[key] = future
                start_thread = self._threads < COMPILE_THREADS
                self._threads += start_thread
        if cached:
            future.set_result(self.compile(params))
            return future
        self._jobs.put((params, future, time.monotonic() + COMPILE_TIMEOUT_S))
        if start_thread:  # daemon: a compile that never ends must not hold the process
            threading.Thread(target=self._work, name="grammar-compile", daemon=True).start()
        return future

    def _work(self) -> None:
        """A compile thread: build the waiting patterns, oldest first, forever."""
        while True:
            params, future, deadline = self._jobs.get()
            key = params.constraint
            assert key is not None, "only params with a pattern are queued"
            try:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not started within {COMPILE_TIMEOUT_S:.0f} s")
                future.set_result(self.compile(params))
            except BaseException as e:  # Rust panics are BaseExceptions: report them too
                future.set_exception(e)
            with self._lock:
                del self._building[key]

    def new_state(self, params: SamplingParams) -> GrammarState | None:
        """A fresh state at the pattern's start for one sample; None if unconstrained."""
        grammar = self.compile(params)
        return None if grammar is None else grammar.new_state()

    def _build(self, field: str, text: str) -> CompiledGrammar:
        with self._lock:
            if self._backend is None:
                self._backend = make_grammar_backend(
                    self.backend_name, self.tokenizer, self.end_id, self.eos_ids, self.vocab_size
                )
        return self._backend.compile(field, text)


def _end_token(tokenizer: Any, eos: frozenset[int]) -> int:
    """The automaton's end token: the tokenizer's eos if the model lists it (or lists no eos
    at all), else the model's smallest eos id."""
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int) and (tok_eos in eos or not eos):
        return tok_eos
    assert eos, "constrained decoding needs an eos token; model and tokenizer define none"
    return min(eos)
