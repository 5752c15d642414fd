"""Regex / JSON-schema constraints compiled into token automata (outlines-core), and the state
of one sample walking such an automaton.

    GrammarCompiler            one per tokenizer; builds the outlines Vocabulary on first use
      .compile(params)         -> CompiledGrammar | None; LRU cache per (field, pattern);
                                  InvalidRequest (a ValueError) naming `regex`/`json_schema`
      .compile_async(params)   -> Future of the same, built on a daemon thread
      .new_state(params)       -> GrammarState | None, one per sample (n > 1: one each)
    CompiledGrammar            outlines Index (DFA over token ids) + packed mask per state
    GrammarState               the sample's DFA state: allowed_tokens() / advance() / terminated

A JSON schema becomes a regex (outlines' build_regex_from_schema, whitespace `[ ]?` between
tokens), so both fields share one path. The automaton allows eos exactly in accepting states.
A sample is *terminated* once it has taken eos, or reached a state where eos is the only
allowed token: the pattern is complete and nothing may follow, so it finishes without
spending a step on eos. Every automaton state allows at least one token (checked when its
mask is built), so a constrained row never runs out of candidates.

Bounds (a pattern comes from a client): before compiling, the pattern is parsed with Python's
own regex parser and its size with every repetition multiplied out (`(a{30}){30}` = 900
literals, a character class costs _CLASS_COST) must stay within MAX_PATTERN_SIZE, each bound
within MAX_REPEAT; measured here, the largest allowed patterns compile in ~3 s. outlines
releases the GIL while it builds, so `compile_async` keeps the scheduler stepping; the
scheduler gives up on a compile after COMPILE_TIMEOUT_S (a pattern Python cannot parse is
bounded only by that).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

import torch

from radixserve.constrained.mask import pack_token_mask
from radixserve.constrained.vocab import build_vocabulary
from radixserve.core.params import InvalidRequest, SamplingParams

try:  # Python's regex parser, used only to measure a pattern before it is compiled
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_constants as _sre
    import sre_parse as _sre_parse

logger = logging.getLogger("radixserve.constrained")

DEFAULT_CACHE_SIZE = 64  # compiled patterns kept (LRU); each holds its index and masks
MAX_REPEAT = 1000  # largest {n,m} bound accepted: DFA size (and build time) grow with it
MAX_PATTERN_SIZE = 2000  # pattern size with repetitions multiplied out (module docstring)
COMPILE_TIMEOUT_S = 10.0  # the scheduler refuses a request whose pattern compiles longer
_CLASS_COST = 4  # size of one character class / any-char: they fan out over many tokens
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # {n}, {n,}, {n,m}
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT))


class GrammarError(RuntimeError):
    """A sample's walk through its automaton broke (a token the mask should have forbidden).
    The scheduler fails that request alone (HTTP 500)."""


class CompiledGrammar:
    """One pattern over one vocabulary. Immutable except its per-state mask cache."""

    def __init__(self, index: Any, vocab_size: int, end_id: int, eos_ids: frozenset[int]) -> None:
        self.index = index  # outlines_core.Index; never mutated
        self.vocab_size = vocab_size
        self.end_id = end_id  # the Vocabulary's eos token
        self.eos_ids = eos_ids | {end_id}  # all allowed wherever end_id is
        self.initial: int = index.get_initial_state()
        self._masks: dict[int, tuple[torch.Tensor, bool]] = {}  # state -> (mask, only eos)

    def mask(self, state: int) -> torch.Tensor:
        """Packed allowed-token mask of `state` (radixserve.constrained.mask format)."""
        return self._state_info(state)[0]

    def only_eos(self, state: int) -> bool:
        """True when eos is the one token `state` allows: the pattern is complete."""
        return self._state_info(state)[1]

    def next_state(self, state: int, token: int) -> int:
        nxt = self.index.get_next_state(state, token)
        if nxt is None:  # the mask forbade it: a bug, which fails this request alone
            raise GrammarError(f"token {token} is not allowed in state {state}")
        return int(nxt)

    def _state_info(self, state: int) -> tuple[torch.Tensor, bool]:
        info = self._masks.get(state)
        if info is None:  # at most one build per state: a grammar has finitely many
            allowed = self.index.get_allowed_tokens(state)  # list, up to the whole vocab
            if not allowed:
                raise GrammarError(f"automaton state {state} allows no token")
            only_eos = len(allowed) == 1 and allowed[0] == self.end_id
            if self.end_id in allowed:  # duplicates are harmless to pack_token_mask
                allowed = allowed + sorted(self.eos_ids)
            info = self._masks[state] = (pack_token_mask(allowed, self.vocab_size), only_eos)
        return info


class GrammarState:
    """Where ONE sample is in its automaton. Only `advance` mutates it (once per token)."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self.state = grammar.initial
        self.terminated = False  # eos taken, or only eos may follow

    def allowed_tokens(self) -> torch.Tensor:
        """Packed mask (ceil(V / 8),) uint8 of the tokens allowed next (see mask.py)."""
        if self.terminated:
            raise GrammarError("a terminated grammar allows no further token")
        return self.grammar.mask(self.state)

    def advance(self, token: int) -> None:
        """Consume the sample's newest token. GrammarError if the mask forbade it."""
        if self.terminated:
            raise GrammarError(f"token {token} after the grammar terminated")
        if token in self.grammar.eos_ids:
            accepting = self.grammar.index.is_final_state(self.state)
            if not accepting:
                raise GrammarError(f"eos {token} in non-accepting state {self.state}")
            self.terminated = True
            return
        self.state = self.grammar.next_state(self.state, token)
        self.terminated = self.grammar.only_eos(self.state)


class GrammarCompiler:
    """Compiles the regex / json_schema of sampling params for ONE tokenizer.

    `eos_token_ids` are the model's eos ids; the tokenizer's own eos (else the smallest) is
    the automaton's end token. `vocab_size` is the model's logits width (masks cover it; ids
    past the tokenizer are never allowed). Thread-safe: the cache and the vocabulary are
    guarded by a lock, compilations run outside it.
    """

    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: Iterable[int],
        vocab_size: int,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        eos = frozenset(eos_token_ids)
        self.end_id = _end_token(tokenizer, eos)
        self.eos_ids = eos | {self.end_id}
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._vocabulary: Any = None  # built on the first compile (~0.3 s for 49k tokens)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._building: dict[tuple[str, str], Future[CompiledGrammar | None]] = {}

    def compile(self, params: SamplingParams) -> CompiledGrammar | None:
        """The compiled constraint of `params` (None when it has none).

        Raises InvalidRequest whose message starts with the field name and says what is wrong.
        """
        key = _constraint(params)
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
        """`compile(params)` on a daemon thread; already done when there is nothing to build
        (no constraint, or a cached one). Requests with a pattern being built share its one
        future. The future raises what `compile` raised; a thread past its deadline is
        abandoned (it cannot be stopped) and ends on its own."""
        future: Future[CompiledGrammar | None] = Future()
        key = _constraint(params)
        if key is None:
            future.set_result(None)
            return future
        with self._lock:
            if key in self._building:
                return self._building[key]
            cached = key in self._cache
            if not cached:
                self._building[key] = future
        if cached:
            future.set_result(self.compile(params))
            return future

        def run() -> None:
            try:
                future.set_result(self.compile(params))
            except BaseException as e:  # outlines panics are BaseExceptions: report them too
                future.set_exception(e)
            with self._lock:
                del self._building[key]

        threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        return future

    def new_state(self, params: SamplingParams) -> GrammarState | None:
        """A fresh state at the pattern's start for one sample; None if unconstrained."""
        grammar = self.compile(params)
        return None if grammar is None else GrammarState(grammar)

    def _build(self, field: str, text: str) -> CompiledGrammar:
        regex = text if field == "regex" else schema_to_regex(text)
        _check_size(field, regex)
        grammar = CompiledGrammar(
            self._index(field, regex), self.vocab_size, self.end_id, self.eos_ids
        )
        if grammar.only_eos(grammar.initial):
            raise InvalidRequest(f"{field}: the pattern matches only the empty string")
        return grammar

    def _index(self, field: str, regex: str) -> Any:
        from outlines_core import Index  # optional dependency: imported on first use

        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = build_vocabulary(
                    self.tokenizer, self.end_id, self.vocab_size, self.eos_ids - {self.end_id}
                )
        try:
            return Index(regex, self._vocabulary)
        except ValueError as e:
            raise InvalidRequest(f"{field}: {_explain(regex, e)}") from e


def _end_token(tokenizer: Any, eos: frozenset[int]) -> int:
    """The automaton's end token: the tokenizer's eos if the model lists it (or lists no eos
    at all), else the model's smallest eos id."""
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int) and (tok_eos in eos or not eos):
        return tok_eos
    assert eos, "constrained decoding needs an eos token; model and tokenizer define none"
    return min(eos)


def schema_to_regex(schema: str) -> str:
    """JSON schema text -> regex of its JSON documents. InvalidRequest naming json_schema."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        json.loads(schema)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"json_schema: not valid JSON ({e})") from e
    except RecursionError as e:
        raise InvalidRequest("json_schema: the schema is nested too deeply") from e
    try:
        return build_regex_from_schema(schema)
    except (ValueError, TypeError, RecursionError) as e:
        raise InvalidRequest(f"json_schema: unsupported schema: {str(e).splitlines()[0]}") from e


def _constraint(params: SamplingParams) -> tuple[str, str] | None:
    # SamplingParams already rejects regex and json_schema together.
    if params.regex is not None:
        return ("regex", params.regex)
    if params.json_schema is not None:
        return ("json_schema", params.json_schema)
    return None


def _check_size(field: str, regex: str) -> None:
    """Reject patterns whose automaton would be too big to build in reasonable time: a bound
    above MAX_REPEAT (a{100000} takes minutes), or a size above MAX_PATTERN_SIZE with the
    repetitions multiplied out ((a{1000}){1000})."""
    try:
        parsed = _sre_parse.parse(regex)
        size = _expanded_size(field, parsed)
    except RecursionError as e:
        raise InvalidRequest(f"{field}: the pattern is nested too deeply") from e
    except (re.error, OverflowError):  # not Python syntax (outlines accepts more), or a bound
        # past what Python accepts: check the bounds in the text
        for m in _REPEAT.finditer(regex):
            _check_bound(field, int(m.group(1)), int(m.group(2) or 0), m.group(0))
        return
    if size > MAX_PATTERN_SIZE:
        raise InvalidRequest(
            f"{field}: the pattern is too large to compile: {size} units with its repetitions "
            f"multiplied out, the limit is {MAX_PATTERN_SIZE}"
        )


def _expanded_size(field: str, items: Any) -> int:
    """Size of a parsed pattern (sre items) with every repetition multiplied out."""
    total = 0
    for op, av in items:
        if op in _REPEATS:
            lo, hi, sub = av
            bound = lo if hi == _sre.MAXREPEAT else hi  # unbounded: lo copies and a loop
            shown = f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi == _sre.MAXREPEAT else hi}}}"
            _check_bound(field, lo, 0 if hi == _sre.MAXREPEAT else hi, shown)
            total += max(bound, 1) * _expanded_size(field, sub)
        elif op is _sre.SUBPATTERN:
            total += _expanded_size(field, av[-1])
        elif op is _sre.BRANCH:
            total += sum(_expanded_size(field, branch) for branch in av[1])
        elif op in (_sre.ASSERT, _sre.ASSERT_NOT):
            total += _expanded_size(field, av[1])
        else:
            total += 1 if op is _sre.LITERAL else _CLASS_COST
    return total


def _check_bound(field: str, lo: int, hi: int, shown: str) -> None:
    if max(lo, hi) > MAX_REPEAT:
        raise InvalidRequest(f"{field}: repetition {shown!r} exceeds the limit of {MAX_REPEAT}")


def _explain(regex: str, error: ValueError) -> str:
    """A readable reason why outlines could not compile `regex`."""
    try:
        re.compile(regex)
    except re.error as e:  # a syntax error Python can locate ("missing ), ... at position 1")
        return f"invalid regular expression {_shorten(regex)}: {e}"
    return f"cannot compile {_shorten(regex)} for constrained decoding: {error}"


def _shorten(text: str, limit: int = 80) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
