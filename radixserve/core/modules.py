"""Prompt modules as the scheduler takes them: a compiled schema and a request's imports.

A schema (written in PML or with `radixserve.prompt`'s Python API, compiled by
`radixserve.prompt.layout`) is a set of modules, each a run of token ids at fixed positions.
The scheduler encodes each module's K/V once, at those positions, and keeps it pinned; a
request importing modules starts with their K/V and computes only its own tokens:

    input_ids:  | module a tokens | module c tokens | own tokens (arguments, then text) |
    positions:  | a's positions   | c's positions   | ModuleUse.positions              |
                |<----- module_tokens: slots shared, never computed --->|<- computed ->|

The own tokens' positions continue after them for the output tokens (`Sample.positions`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModuleTokens:
    """One module's own tokens (not its nested modules' nor its parameters') and the
    position of each. Positions ascend; modules of a schema never share a position unless
    they are members of one union."""

    name: str
    token_ids: list[int]
    positions: list[int]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.positions):
            raise ValueError(
                f"module {self.name!r}: {len(self.token_ids)} tokens, "
                f"{len(self.positions)} positions"
            )


@dataclass
class CompiledSchema:
    name: str
    modules: list[ModuleTokens]  # in schema order; "" is the schema's own text (always used)
    num_positions: int  # positions 0 .. num_positions - 1 belong to the schema

    def module(self, name: str) -> ModuleTokens:
        for m in self.modules:
            if m.name == name:
                return m
        raise ValueError(f"schema {self.name!r} has no module {name!r}")


@dataclass
class ModuleUse:
    """A request's imports: `modules` in schema order (their tokens open `input_ids`), then
    the request's own tokens at `positions` (one per own token, at least one)."""

    schema: str
    modules: list[str]
    positions: list[int]
