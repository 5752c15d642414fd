"""Bounds on a client's regex, checked before any backend compiles it.

A pattern is parsed with Python's own regex parser and its size with every repetition
multiplied out (`(a{30}){30}` = 900 literals, a character class costs _CLASS_COST) must stay
within MAX_PATTERN_SIZE, each bound within MAX_REPEAT: an automaton (outlines) grows with
them, and measured here the largest allowed patterns compile in ~3 s. A pattern Python cannot
parse is bounded by its textual {n,m} bounds and by the compile timeout.
"""

from __future__ import annotations

import re
from typing import Any

from radixserve.core.params import InvalidRequest

try:  # Python's regex parser, used only to measure a pattern before it is compiled
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _sre_parse  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_constants as _sre
    import sre_parse as _sre_parse

MAX_REPEAT = 1000  # largest {n,m} bound accepted: DFA size (and build time) grow with it
MAX_PATTERN_SIZE = 2000  # pattern size with repetitions multiplied out (module docstring)
_CLASS_COST = 4  # size of one character class / any-char: they fan out over many tokens
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # {n}, {n,}, {n,m}
_REPEATS = (_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT))


def check_pattern_size(field: str, regex: str) -> None:
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


def explain(regex: str, error: object) -> str:
    """A readable reason why a backend could not compile `regex`."""
    try:
        re.compile(regex)
    except re.error as e:  # a syntax error Python can locate ("missing ), ... at position 1")
        return f"invalid regular expression {shorten(regex)}: {e}"
    return f"cannot compile {shorten(regex)} for constrained decoding: {error}"


def shorten(text: str, limit: int = 80) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."
