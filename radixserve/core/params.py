"""Sampling parameters of one request: SGLang's field names and defaults, validated once.

`SamplingParams.from_dict` is the ONE parser of user-supplied sampling parameters (Engine and
HTTP server alike). Every error it raises is an `InvalidRequest` (a ValueError, mapped to
HTTP 400) whose message names the offending field and what is allowed, e.g.

    SamplingParams.from_dict({"top_p": 0})
    -> InvalidRequest("top_p must be in (0, 1], got 0")

Constructing `SamplingParams(...)` directly runs the same type and range checks, so an
instance that exists is always valid except for the vocabulary-dependent check
`validate(vocab_size)`, which the scheduler runs once it knows the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.limits import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PATTERN_CHARS,
    MAX_STOP_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STOP_TOTAL_BYTES,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    REPETITION_PENALTY_RANGE,
)

PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's range for frequency/presence penalties
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range: -100 bans a token, 100 all but forces it
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf")  # output constraints, at most one


class InvalidRequest(ValueError):
    """A request the server can never run as asked (bad parameter): HTTP 400."""


@dataclass
class SamplingParams:
    max_new_tokens: int = 128  # 0: prefill only (e.g. prompt logprobs)
    min_new_tokens: int = 0  # eos and stop_token_ids are masked until this many tokens
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE): greedy (exact argmax, no randomness)
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)  # a single str is accepted and wrapped
    stop_token_ids: list[int] = field(default_factory=list)
    # SGLang's frontend always sends this key (null or [] unless the program sets it);
    # accepted so its RuntimeEndpoint works unchanged, refused when non-empty (not built yet).
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # eos does not stop (min_new_tokens masking still applies)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    seed: int | None = None  # None: draw from the process-level generator
    regex: str | None = None  # constrained decoding (at most one of the three), compiled
    json_schema: str | None = None  # by the grammar backend, which validates the pattern
    ebnf: str | None = None  # a context-free grammar (GBNF: `root ::= ...`)
    # token id -> bias added to its logit before sampling (OpenAI: [-100, 100]; JSON object
    # keys arrive as strings of digits and are read as ids)
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.stop_regex, str):
            self.stop_regex = [self.stop_regex]
        if isinstance(self.logit_bias, Mapping):
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        for f in dataclasses.fields(self):
            _check_type(f.name, getattr(self, f.name))
        self.stop = list(self.stop)
        self.stop_regex = list(self.stop_regex)
        self.stop_token_ids = list(self.stop_token_ids)
        for name in _FLOATS:
            setattr(self, name, float(getattr(self, name)))
        self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._check_ranges()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Parse user-supplied parameters; raise InvalidRequest naming the field on any error.

        A value of None means "the default" for every field (OpenAI clients send nulls).
        """
        if not isinstance(d, Mapping):
            raise InvalidRequest(f"sampling parameters must be an object, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in d:
            if key not in known:
                raise InvalidRequest(f"unknown sampling parameter {key!r}")
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; `from_dict(p.to_dict()) == p`."""
        return dataclasses.asdict(self)

    def validate(self, vocab_size: int) -> None:
        """Check what depends on the model: token ids must lie in [0, vocab_size)."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            for t in ids:
                _require(0 <= t < vocab_size, f"{name}: ids must be in [0, {vocab_size}), got {t}")

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(field name, pattern) of the output constraint, None when unconstrained."""
        for name in CONSTRAINT_FIELDS:
            text = getattr(self, name)
            if text is not None:
                return name, text
        return None

    @property
    def is_greedy(self) -> bool:
        """Greedy rows take the exact argmax of the (penalised) logits. A temperature below
        MIN_TEMPERATURE counts as 0: dividing float32 logits by it would overflow them."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    @property
    def has_filters(self) -> bool:
        """True when top_k, top_p or min_p removes tokens before the draw."""
        return self.top_k > 1 or self.top_p < 1.0 or self.min_p > 0.0

    def _check_ranges(self) -> None:
        _require(
            0.0 <= self.temperature <= MAX_TEMPERATURE,
            f"temperature must be in [0, {MAX_TEMPERATURE}], got {self.temperature}",
        )
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= -1, f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        lo, hi = PENALTY_RANGE
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            _require(lo <= v <= hi, f"{name} must be in [{lo}, {hi}], got {v}")
        lo, hi = REPETITION_PENALTY_RANGE
        _require(
            lo <= self.repetition_penalty <= hi,
            f"repetition_penalty must be in [{lo}, {hi}], got {self.repetition_penalty}",
        )
        _require(
            self.max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {self.max_new_tokens}"
        )
        _require(
            0 <= self.min_new_tokens <= self.max_new_tokens,
            f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
            f"got {self.min_new_tokens}",
        )
        _require(1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}")
        _require(
            len(self.stop) <= MAX_STOP_STRINGS,
            f"stop has {len(self.stop)} strings, at most {MAX_STOP_STRINGS} are allowed",
        )
        sizes = [len(s.encode("utf-8", "surrogatepass")) for s in self.stop]
        for size in sizes:
            _require(
                0 < size <= MAX_STOP_BYTES,
                f"stop strings must be non-empty and <= {MAX_STOP_BYTES} UTF-8 bytes, got {size}",
            )
        _require(
            sum(sizes) <= MAX_STOP_TOTAL_BYTES,
            f"stop strings total {sum(sizes)} UTF-8 bytes, at most {MAX_STOP_TOTAL_BYTES}",
        )
        _require(
            not self.stop_regex,
            "stop_regex is not supported yet: use stop (strings) or regex (constrained output)",
        )
        _require(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            f"stop_token_ids has {len(self.stop_token_ids)} entries, "
            f"at most {MAX_STOP_TOKEN_IDS} are allowed",
        )
        for t in self.stop_token_ids:
            _require(t >= 0, f"stop_token_ids entries must be >= 0, got {t}")
        for name in CONSTRAINT_FIELDS:
            text = getattr(self, name)
            _require(
                text is None or len(text) <= MAX_PATTERN_CHARS,
                f"{name} must be at most {MAX_PATTERN_CHARS} characters",
            )
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        _require(len(given) <= 1, f"{' and '.join(given)} are exclusive: set at most one of them")
        _require(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            f"logit_bias has {len(self.logit_bias)} entries, at most {MAX_LOGIT_BIAS} are allowed",
        )
        lo, hi = LOGIT_BIAS_RANGE
        for t, b in self.logit_bias.items():
            _require(t >= 0, f"logit_bias: token ids must be >= 0, got {t}")
            _require(lo <= b <= hi, f"logit_bias: biases must be in [{lo}, {hi}], got {b} for {t}")


def _is_int(v: object) -> bool:
    # 64-bit: what msgspec, torch and the seed hash carry.
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _is_float(v: object) -> bool:
    # int is accepted where a float is expected; bool is not a number here. NaN and inf are
    # rejected as a type error because no range below admits them.
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(float(v))  # type: ignore[arg-type]


def _is_list_of(v: object, pred: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(pred(x) for x in v)


_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
_INTS = ("max_new_tokens", "min_new_tokens", "top_k", "n")
_BOOLS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens")

# Expected type of each field, as (check, description for the error message).
_TYPES: dict[str, tuple[Any, str]] = {
    **{name: (_is_float, "a finite number") for name in _FLOATS},
    **{name: (_is_int, "a 64-bit integer") for name in _INTS},
    **{name: (lambda v: isinstance(v, bool), "a boolean") for name in _BOOLS},
    "stop": (lambda v: _is_list_of(v, lambda x: isinstance(x, str)), "a string or list of strings"),
    "stop_token_ids": (lambda v: _is_list_of(v, _is_int), "a list of 64-bit integers"),
    "stop_regex": (
        lambda v: _is_list_of(v, lambda x: isinstance(x, str)),
        "a string or list of strings",
    ),
    "seed": (lambda v: v is None or _is_int(v), "a 64-bit integer or null"),
    "regex": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "json_schema": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "ebnf": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "logit_bias": (
        lambda v: isinstance(v, Mapping) and all(_is_int(k) and _is_float(b) for k, b in v.items()),
        "an object mapping token ids to numbers",
    ),
}


def _token_key(key: Any) -> Any:
    """A logit_bias key: JSON spells ids as strings of digits; anything else is left for the
    type check to refuse."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit() and len(key) <= 20:
        return int(key)
    return key


def _check_type(name: str, value: object) -> None:
    check, expected = _TYPES[name]
    if not check(value):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise InvalidRequest(f"{name} must be {expected}, got {shown} ({type(value).__name__})")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise InvalidRequest(msg)
