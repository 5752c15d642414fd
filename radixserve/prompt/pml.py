"""PML, the prompt markup of prompt modules, and the same trees built from Python.

A schema declares modules; a prompt imports some of them and adds its own text:

    <schema name="travel">
      <system>You are a travel agent.</system>
      <module name="city-paris">Paris is ...</module>
      <union>                                   members share their start position;
        <module name="en">Answer in English.</module>    a prompt imports at most one
        <module name="fr">Réponds en français.</module>
      </union>
      <module name="trip">Plan a trip of <param name="days" len="4"/> days.
        <module name="budget">Keep it cheap.</module>   nested: import "trip" too
      </module>
    </schema>

    <prompt schema="travel"><city-paris/><fr/><trip days="3"/><user>Go!</user><assistant/></prompt>

Tags: `<system>`, `<user>`, `<assistant>` wrap text in the model's chat-template markup (an
empty one is only its opening markup: `<assistant/>` is the generation prompt); `<param
name len>` reserves `len` token positions that a prompt's argument fills. Text that is only
whitespace between tags is ignored; other text is kept verbatim (escape `<` and `&` as XML
does). In a prompt every other tag imports the module of that name, its attributes being
arguments. `parse_schema` / `parse_prompt` raise ValueError naming what is wrong; the
Python API (`schema`, `module`, `param`, `union`, `role`, `prompt`, `use`) builds the same
trees, and `to_pml` writes them back.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

ROLE_TAGS = ("system", "user", "assistant")
RESERVED = frozenset({"schema", "prompt", "module", "param", "union", *ROLE_TAGS})
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*\Z")  # an XML tag name: module names are tags


@dataclass(frozen=True)
class Param:
    name: str
    len: int


@dataclass(frozen=True)
class Role:
    role: str
    children: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Module:
    name: str
    children: tuple[Node, ...] = ()


@dataclass(frozen=True)
class Union:
    members: tuple[Module, ...]


@dataclass(frozen=True)
class Schema:
    name: str
    children: tuple[Node, ...]


@dataclass(frozen=True)
class Use:
    """An import of module `name` in a prompt, with arguments for its parameters."""

    name: str
    args: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Prompt:
    schema: str
    children: tuple[Use | Role | str, ...]


Node = str | Role | Param | Module | Union


# ---------------------------------------------------------------- Python API


def schema(name: str, *children: Node) -> Schema:
    _check_name("schema", name)
    return Schema(name, tuple(children))


def module(name: str, *children: Node) -> Module:
    _check_name("module", name)
    return Module(name, tuple(children))


def param(name: str, len: int) -> Param:  # noqa: A002 - PML's attribute name
    if not isinstance(len, int) or isinstance(len, bool) or len < 1:
        raise ValueError(f"param {name!r}: len must be an integer >= 1, got {len!r}")
    return Param(name, len)


def union(*members: Module) -> Union:
    if not members or not all(isinstance(m, Module) for m in members):
        raise ValueError("union: its members must be one or more modules")
    return Union(tuple(members))


def role(name: str, *children: Node) -> Role:
    if name not in ROLE_TAGS:
        raise ValueError(f"role {name!r}: roles are {', '.join(ROLE_TAGS)}")
    return Role(name, tuple(children))


def use(name: str, **args: str) -> Use:
    return Use(name, dict(args))


def prompt(schema_name: str, *children: Use | Role | str) -> Prompt:
    return Prompt(schema_name, tuple(children))


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name) or name in RESERVED:
        raise ValueError(
            f"{kind} name {name!r}: must be an XML name (letters, digits, _ . -) and not one "
            f"of {', '.join(sorted(RESERVED))}"
        )


# ---------------------------------------------------------------- markup -> trees


def parse_schema(text: str) -> Schema:
    root = _parse(text, "schema")
    _attrs(root, {"name"}, {"name"})
    return schema(root.attrib["name"], *_schema_children(root))


def parse_prompt(text: str) -> Prompt:
    root = _parse(text, "prompt")
    _attrs(root, {"schema"}, {"schema"})
    return prompt(root.attrib["schema"], *_prompt_children(root))


def _parse(text: str, tag: str) -> ET.Element:
    if not isinstance(text, str):
        raise ValueError(f"PML: expected a <{tag}> document as a string")
    if re.search(r"<!(DOCTYPE|ENTITY)", text, re.IGNORECASE):
        raise ValueError("PML: DOCTYPE and ENTITY declarations are not allowed")
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise ValueError(f"PML: malformed markup: {e}") from e
    if root.tag != tag:
        raise ValueError(f"PML: expected a <{tag}> document, got <{root.tag}>")
    return root


def _attrs(el: ET.Element, allowed: set[str], required: set[str]) -> None:
    extra, missing = set(el.attrib) - allowed, required - set(el.attrib)
    if extra or missing:
        raise ValueError(
            f"PML: <{el.tag}> takes attributes {sorted(allowed) or 'none'}"
            + (f"; unknown {sorted(extra)}" if extra else "")
            + (f"; missing {sorted(missing)}" if missing else "")
        )


def _texts_and_children(el: ET.Element) -> list[str | ET.Element]:
    """el's content in order; whitespace-only text between tags dropped."""
    out: list[str | ET.Element] = []
    for part in [el.text, *[x for child in el for x in (child, child.tail)]]:
        if isinstance(part, ET.Element):
            out.append(part)
        elif part and part.strip():
            out.append(part)
    return out


def _schema_children(el: ET.Element) -> list[Node]:
    return [x if isinstance(x, str) else _schema_node(x) for x in _texts_and_children(el)]


def _schema_node(el: ET.Element) -> Node:
    if el.tag == "module":
        _attrs(el, {"name"}, {"name"})
        return module(el.attrib["name"], *_schema_children(el))
    if el.tag == "param":
        _attrs(el, {"name", "len"}, {"name", "len"})
        if list(el) or (el.text or "").strip():
            raise ValueError(f"PML: <param name={el.attrib['name']!r}> must be empty")
        try:
            n = int(el.attrib["len"])
        except ValueError:
            raise ValueError(
                f"PML: <param> len must be an integer, got {el.attrib['len']!r}"
            ) from None
        return param(el.attrib["name"], n)
    if el.tag == "union":
        _attrs(el, set(), set())
        members = [
            _schema_node(x) if isinstance(x, ET.Element) else x for x in _texts_and_children(el)
        ]
        if not all(isinstance(m, Module) for m in members):
            raise ValueError("PML: a <union> holds only <module> elements")
        return union(*[m for m in members if isinstance(m, Module)])
    if el.tag in ROLE_TAGS:
        _attrs(el, set(), set())
        return Role(el.tag, tuple(_schema_children(el)))
    raise ValueError(
        f"PML: unknown tag <{el.tag}> in a schema (module, param, union, {', '.join(ROLE_TAGS)})"
    )


def _prompt_children(el: ET.Element) -> list[Use | Role | str]:
    out: list[Use | Role | str] = []
    for x in _texts_and_children(el):
        if isinstance(x, str):
            out.append(x)
        elif x.tag in ROLE_TAGS:
            _attrs(x, set(), set())
            if len(x):  # child elements
                raise ValueError(f"PML: <{x.tag}> in a prompt holds only text")
            out.append(Role(x.tag, tuple(c for c in _texts_and_children(x) if isinstance(c, str))))
        elif x.tag in RESERVED:
            raise ValueError(f"PML: <{x.tag}> is not allowed in a prompt")
        else:
            if list(x) or (x.text or "").strip():
                raise ValueError(f"PML: the import <{x.tag}/> must be empty")
            out.append(Use(x.tag, dict(x.attrib)))
    return out


# ---------------------------------------------------------------- trees -> markup


def to_pml(tree: Schema | Prompt) -> str:
    if isinstance(tree, Schema):
        return f"<schema name={quoteattr(tree.name)}>{_pml_nodes(tree.children)}</schema>"
    return f"<prompt schema={quoteattr(tree.schema)}>{_pml_nodes(tree.children)}</prompt>"


def _pml_nodes(nodes: tuple[Node | Use, ...]) -> str:
    return "".join(_pml_node(n) for n in nodes)


def _pml_node(n: Node | Use) -> str:
    if isinstance(n, str):
        return escape(n)
    if isinstance(n, Param):
        return f'<param name={quoteattr(n.name)} len="{n.len}"/>'
    if isinstance(n, Module):
        return f"<module name={quoteattr(n.name)}>{_pml_nodes(n.children)}</module>"
    if isinstance(n, Union):
        return f"<union>{_pml_nodes(n.members)}</union>"
    if isinstance(n, Use):
        args = "".join(f" {k}={quoteattr(v)}" for k, v in n.args.items())
        return f"<{n.name}{args}/>"
    return f"<{n.role}>{_pml_nodes(n.children)}</{n.role}>"
