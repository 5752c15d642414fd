"""Position layout of a schema, and a prompt against it -> token ids and positions.

Schema layout: one walk in document order with a position counter. Text (role markup
included) takes one position per token; `<param len=L>` reserves L positions; a nested
module lies inside its parent's range; the members of a union all start where the union
starts and the union ends where its longest member ends. Text outside every module is the
schema's own module "" that every prompt imports.

    schema:  | "" text | module a [ text | param p: L | text ] | union{ b | c } | "" text |
    pos:     0 ........................................................ num_positions

Prompt: its imports pick modules; its own tokens are every argument (at the first positions
of its param, in position order) and then its text, whose positions start right after the
last position of any imported module (gaps of unused modules and params stay unused).
Each run of text between two structural elements is tokenized on its own (tokens never
straddle a module or param boundary), so a module's tokens are the same in every prompt.

`module_reuse: false` prefills `expanded` instead: the same tokens sorted by position, at
positions 0 .. n-1 (what an ordinary prompt of that text would be).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from radixserve.core.modules import CompiledSchema, ModuleTokens, ModuleUse
from radixserve.prompt.pml import Module, Node, Param, Prompt, Role, Schema, Union, Use
from radixserve.prompt.roles import RoleTemplate

Tokenize = Callable[[str], list[int]]  # text -> token ids, no special tokens added


@dataclass(frozen=True)
class ModuleSpan:
    """Where a module lies: [start, end) holds its text, params and nested modules."""

    name: str
    parent: str | None  # the enclosing module (None at the top level)
    union: int | None  # index of its union in the schema, if it is a member of one
    start: int
    end: int
    params: dict[str, tuple[int, int]]  # name -> (first position, len)


@dataclass(frozen=True)
class Layout:
    compiled: CompiledSchema
    spans: dict[str, ModuleSpan]


@dataclass
class _Open:
    """A module being laid out: its tokens so far and the text not yet tokenized."""

    name: str
    parent: str | None
    union: int | None
    start: int
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    params: dict[str, tuple[int, int]] = field(default_factory=dict)
    pending: str = ""


class _SchemaWalk:
    def __init__(self, tokenize: Tokenize, roles: RoleTemplate) -> None:
        self.tokenize, self.roles = tokenize, roles
        self.pos = 0
        self.unions = 0
        self.names: set[str] = set()
        self.done: dict[str, tuple[ModuleTokens, ModuleSpan]] = {}

    def flush(self, m: _Open) -> None:
        if m.pending:
            ids = self.tokenize(m.pending)
            m.ids += ids
            m.positions += range(self.pos, self.pos + len(ids))
            self.pos += len(ids)
            m.pending = ""

    def walk(self, node: Node, m: _Open) -> None:
        if isinstance(node, str):
            m.pending += node
        elif isinstance(node, Role):
            m.pending += self.roles.begin(node.role, first=self.pos == 0 and not m.pending)
            for child in node.children:
                self.walk(child, m)
            if node.children:
                m.pending += self.roles.end(node.role)
        elif isinstance(node, Param):
            if node.name in m.params:
                raise ValueError(f"module {m.name!r}: two params named {node.name!r}")
            self.flush(m)
            m.params[node.name] = (self.pos, node.len)
            self.pos += node.len
        elif isinstance(node, Module):
            self.flush(m)
            self.module(node, m.name or None, None)
        else:
            self.flush(m)
            self.union(node, m.name or None)

    def union(self, node: Union, parent: str | None) -> None:
        start, end, index = self.pos, self.pos, self.unions
        self.unions += 1
        for member in node.members:
            self.pos = start
            self.module(member, parent, index)
            end = max(end, self.pos)
        self.pos = end

    def module(self, node: Module, parent: str | None, union: int | None) -> None:
        if node.name in self.names:
            raise ValueError(f"schema: two modules named {node.name!r}")
        self.names.add(node.name)
        self.done[node.name] = self.close(_Open(node.name, parent, union, self.pos), node.children)

    def close(self, m: _Open, children: tuple[Node, ...]) -> tuple[ModuleTokens, ModuleSpan]:
        for child in children:
            self.walk(child, m)
        self.flush(m)
        span = ModuleSpan(m.name, m.parent, m.union, m.start, self.pos, m.params)
        return ModuleTokens(m.name, m.ids, m.positions), span


def compile_schema(tree: Schema, tokenize: Tokenize, roles: RoleTemplate) -> Layout:
    """Lay `tree` out (see the module docstring). ValueError: duplicate module or param."""
    w = _SchemaWalk(tokenize, roles)
    tokens, _ = w.close(_Open("", None, None, 0), tree.children)
    # The schema's own text is scattered between modules: it "ends" after its last token.
    top = (
        tokens,
        ModuleSpan("", None, None, 0, tokens.positions[-1] + 1 if tokens.positions else 0, {}),
    )
    order = sorted([top, *w.done.values()], key=lambda ms: ms[1].start)  # schema order
    compiled = CompiledSchema(tree.name, [t for t, _ in order], w.pos)
    return Layout(compiled, {s.name: s for _, s in order})


@dataclass(frozen=True)
class CompiledPrompt:
    input_ids: list[int]  # imported modules' tokens (schema order), then the own tokens
    use: ModuleUse
    expanded: list[int]  # the same tokens in position order: the exact fallback's prompt


def compile_prompt(
    tree: Prompt, layout: Layout, tokenize: Tokenize, roles: RoleTemplate
) -> CompiledPrompt:
    """Token ids and positions of `tree` against `layout`; ValueError names the problem."""
    spans = layout.spans
    imported = _imports(tree, layout)
    order = [s for s in spans if s in imported]  # "" first, then schema order
    args = sorted(a for u in imported.values() for a in _argument(u, spans[u.name], tokenize))
    start = max(spans[name].end for name in order)
    text_ids = tokenize(_text(tree, roles, first=start == 0 and not args))
    own = [(p, t) for p, t in args] + list(zip(range(start, start + len(text_ids)), text_ids))
    if not own:
        raise ValueError("prompt: it has no text or arguments of its own")
    modules = [layout.compiled.module(name) for name in order]
    modules = [m for m in modules if m.token_ids]
    input_ids = [t for m in modules for t in m.token_ids] + [t for _, t in own]
    placed = [(p, t) for m in modules for p, t in zip(m.positions, m.token_ids)] + own
    use = ModuleUse(tree.schema, [m.name for m in modules], [p for p, _ in own])
    return CompiledPrompt(input_ids, use, [t for _, t in sorted(placed)])


def _imports(tree: Prompt, layout: Layout) -> dict[str, Use]:
    """The imported modules by name ("" included); checks names, unions and nesting."""
    spans, name = layout.spans, layout.compiled.name
    imported: dict[str, Use] = {"": Use("")}
    for u in (c for c in tree.children if isinstance(c, Use)):
        if u.name not in spans or not u.name:
            raise ValueError(f"prompt: schema {name!r} has no module {u.name!r}")
        if u.name in imported:
            raise ValueError(f"prompt: module {u.name!r} is imported twice")
        imported[u.name] = u
    for u in imported.values():
        span = spans[u.name]
        if span.parent is not None and span.parent not in imported:
            raise ValueError(
                f"prompt: module {u.name!r} is nested in {span.parent!r}; "
                f"import {span.parent!r} too"
            )
        rivals = [n for n in imported if n != u.name and spans[n].union == span.union]
        if span.union is not None and rivals:
            raise ValueError(
                f"prompt: modules {u.name!r} and {rivals[0]!r} are members of one union; "
                "import at most one"
            )
    return imported


def _argument(u: Use, span: ModuleSpan, tokenize: Tokenize) -> list[tuple[int, int]]:
    """(position, token) of every argument token of import `u`."""
    out: list[tuple[int, int]] = []
    for pname, value in u.args.items():
        if pname not in span.params:
            raise ValueError(f"prompt: module {u.name!r} has no parameter {pname!r}")
        first, n = span.params[pname]
        ids = tokenize(value)
        if len(ids) > n:
            raise ValueError(
                f"prompt: argument {pname!r} of module {u.name!r} is {len(ids)} tokens; "
                f"its param holds {n}"
            )
        out += zip(range(first, first + len(ids)), ids)
    return out


def _text(tree: Prompt, roles: RoleTemplate, first: bool) -> str:
    parts: list[str] = []
    for c in tree.children:
        if isinstance(c, str):
            parts.append(c)
        elif isinstance(c, Role):
            parts.append(roles.begin(c.role, first=first and not parts))
            if c.children:
                parts += [*(x for x in c.children if isinstance(x, str)), roles.end(c.role)]
    return "".join(parts)
