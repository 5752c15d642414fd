"""The frontend's expressions: what `s += ...` accepts, and the sampling options of a gen.

Expressions are plain immutable data; the interpreter (interpreter.py) gives them meaning.
`"text" + gen("x")` and `gen("x") + "text"` build an `ExprList`, so a whole turn can be
appended at once, exactly as in SGLang.

Sampling options are resolved in three layers, later layers winning, None meaning "not set":

    defaults of run()/run_batch()  <  options of gen(...)  <  what dtype= implies

The result is the SGLang `sampling_params` dict a backend sends (None values dropped).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from radixserve.frontend.choices import ChoicesMethod
from radixserve.prompt.pml import Use

# Regexes of the typed gens (SGLang's). A runtime without constrained decoding ignores
# them; the value is still converted (and a text that does not parse is an error).
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""

DTYPE_NAMES = {int: "int", float: "float", str: "str", bool: "bool"}
DTYPE_REGEX = {"int": REGEX_INT, "float": REGEX_FLOAT, "str": REGEX_STR, "bool": REGEX_BOOL}
# Numbers end at whitespace: "42 apples" stops after "42".
DTYPE_STOP = {"int": [" ", "\n"], "float": [" ", "\n"]}


class Expr:
    """Base of every expression; `+` with a str or another Expr concatenates."""

    def __add__(self, other: ExprLike) -> ExprList:
        return ExprList([*_flatten(self), *_flatten(to_expr(other))])

    def __radd__(self, other: ExprLike) -> ExprList:
        return ExprList([*_flatten(to_expr(other)), *_flatten(self)])


@dataclass(frozen=True, eq=False)
class ExprList(Expr):
    items: list[Expr]


@dataclass(frozen=True, eq=False)
class Text(Expr):
    value: str


@dataclass(frozen=True, eq=False)
class Imports(Expr):
    """Prompt modules of a registered schema that a program starts from (`imports(...)`);
    the program's text after it is the prompt's own text."""

    schema: str
    uses: tuple[Use, ...]


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True)
class SamplingOptions:
    """Per-gen sampling options in SGLang's names; None: inherit from the layer below."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    # Request-level options (not part of sampling_params on the wire).
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None

    def over(self, base: SamplingOptions) -> SamplingOptions:
        """These options on top of `base`: every field set here wins."""
        mine = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(base, **{k: v for k, v in mine.items() if v is not None})


# Fields that travel inside `sampling_params`; the rest are request-level.
REQUEST_FIELDS = (
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)

# run()'s defaults, SGLang's: 128 new tokens, temperature 1.0.
RUN_DEFAULTS = SamplingOptions(
    max_new_tokens=128,
    stop=[],
    stop_token_ids=[],
    temperature=1.0,
    top_p=1.0,
    top_k=-1,
    min_p=0.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    ignore_eos=False,
)


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    name: str | None
    options: SamplingOptions = field(default_factory=SamplingOptions)
    dtype: str | None = None  # "int" | "float" | "str" | "bool" | None (text)

    def resolve(self, defaults: SamplingOptions) -> SamplingOptions:
        """Final options: defaults < this gen's options < the dtype's regex and stops."""
        opts = self.options.over(defaults)
        if self.dtype is None:
            return opts
        stop = [*(opts.stop or []), *DTYPE_STOP.get(self.dtype, [])]
        if opts.regex is not None or opts.json_schema is not None:
            return replace(opts, stop=stop)  # an explicit constraint wins over the dtype's
        return replace(opts, regex=DTYPE_REGEX[self.dtype], stop=stop)


@dataclass(frozen=True, eq=False)
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float
    method: ChoicesMethod  # how the option is picked from its token logprobs (choices.py)


ExprLike = Expr | str


def to_expr(x: ExprLike) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    raise TypeError(
        f"cannot append {type(x).__name__} to a program state: use a str or an expression "
        "(gen, select, a role, or a concatenation of those)"
    )


def _flatten(e: Expr) -> list[Expr]:
    return list(e.items) if isinstance(e, ExprList) else [e]


def sampling_dict(opts: SamplingOptions) -> dict[str, Any]:
    """The `sampling_params` a backend sends: SGLang names, unset (None) fields left out."""
    out = {
        f.name: getattr(opts, f.name)
        for f in fields(opts)
        if f.name not in REQUEST_FIELDS and getattr(opts, f.name) is not None
    }
    for key in ("stop", "stop_token_ids"):
        if key in out:
            out[key] = list(out[key])
    return out


def dtype_name(dtype: type | str | None) -> str | None:
    """Normalise gen's dtype= (int, float, str, bool or their names) to a name."""
    if dtype is None:
        return None
    name = DTYPE_NAMES.get(dtype) if isinstance(dtype, type) else dtype
    if name not in DTYPE_REGEX:
        raise ValueError(f"dtype must be int, float, str or bool (or their names), got {dtype!r}")
    return name


def convert_value(text: str, dtype: str | None, name: str | None) -> Any:
    """A typed gen's value from its text; ValueError naming the gen if it does not parse.

    str values are the quoted strings of REGEX_STR, returned without the quotes.
    """
    if dtype is None:
        return text
    raw = text.strip()
    try:
        if dtype == "int":
            return int(raw)
        if dtype == "float":
            return float(raw)
        if dtype == "bool":
            return {"True": True, "False": False}[raw]
        assert dtype == "str", dtype
        return json.loads(raw) if len(raw) >= 2 and raw[0] == raw[-1] == '"' else raw
    except (ValueError, KeyError) as e:
        raise ValueError(
            f"gen {name!r} with dtype={dtype}: the model produced {text!r}, which is not a "
            f"{dtype} (the runtime did not enforce the regex {DTYPE_REGEX[dtype]!r})"
        ) from e


def normalize_stop(stop: str | Sequence[str] | None) -> list[str] | None:
    if stop is None:
        return None
    return [stop] if isinstance(stop, str) else list(stop)


def normalize_schema(schema: str | dict[str, Any] | None) -> str | None:
    """json_schema as the JSON string the runtime takes (a dict is serialized)."""
    if schema is None or isinstance(schema, str):
        return schema
    if isinstance(schema, dict):
        return json.dumps(schema)
    raise TypeError(f"json_schema must be a JSON string or a dict, got {type(schema).__name__}")
