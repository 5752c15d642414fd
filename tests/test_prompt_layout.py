"""PML parsing, the Python API and the position layout (pure Python: one token per character,
plain role markup), with every error a schema or prompt can raise."""

from __future__ import annotations

import pytest

from radixserve.prompt import pml
from radixserve.prompt.layout import Layout, compile_prompt, compile_schema
from radixserve.prompt.roles import RoleTemplate

ROLES = RoleTemplate.plain()  # "USER: " ... "\n"

SCHEMA = """<schema name="s">
  <system>S</system>
  <module name="a">AAA<param name="p" len="3"/>aa
    <module name="a2">NN</module>
  </module>
  <union>
    <module name="b">BB</module>
    <module name="c">CCCC</module>
  </union>
</schema>"""


def tok(text: str) -> list[int]:
    return [ord(c) for c in text]


def layout(text: str = SCHEMA) -> Layout:
    return compile_schema(pml.parse_schema(text), tok, ROLES)


def test_schema_layout_positions() -> None:
    lay = layout()
    mods = {m.name: m for m in lay.compiled.modules}
    # "" = "SYSTEM: S\n" at 0..9; a: "AAA" 10..12, param 13..15, "aa\n    " 16..22; a2 in a
    assert mods[""].positions == list(range(10))
    assert mods["a"].token_ids == tok("AAA") + tok("aa\n    ")
    assert mods["a"].positions == [10, 11, 12] + list(range(16, 23))
    assert lay.spans["a"].params == {"p": (13, 3)}
    assert mods["a2"].positions == [23, 24] and lay.spans["a2"].parent == "a"
    assert (lay.spans["a"].start, lay.spans["a"].end) == (10, 25)
    # union members share their start; the union ends after its longest member
    assert mods["b"].positions == [25, 26] and mods["c"].positions == [25, 26, 27, 28]
    assert lay.spans["b"].union == lay.spans["c"].union == 0
    assert lay.compiled.num_positions == 29
    assert [m.name for m in lay.compiled.modules] == ["", "a", "a2", "b", "c"]


def test_prompt_imports_any_order_with_argument() -> None:
    lay = layout()
    tree = pml.parse_prompt('<prompt schema="s"><c/><a p="xy"/>Q<user>u</user></prompt>')
    out = compile_prompt(tree, lay, tok, ROLES)
    assert out.use.schema == "s" and out.use.modules == ["", "a", "c"]  # schema order
    own = tok("xy") + tok("QUSER: u\n")
    assert out.input_ids == tok("SYSTEM: S\n") + tok("AAAaa\n    ") + tok("CCCC") + own
    # the argument at its param's first positions, the text after c (the last import)
    assert out.use.positions == [13, 14] + list(range(29, 29 + 9))
    expanded = tok("SYSTEM: S\n") + tok("AAA") + tok("xy") + tok("aa\n    ") + tok("CCCC")
    assert out.expanded == expanded + tok("QUSER: u\n")


def test_text_starts_after_the_last_imported_module() -> None:
    # the schema's own trailing "x" ends after e: a prompt importing d only starts at 5
    lay = layout(
        '<schema name="s"><module name="d">DOC</module><module name="e">E</module>x</schema>'
    )
    out = compile_prompt(pml.prompt("s", pml.use("e"), "y"), lay, tok, ROLES)
    assert out.use.positions == [5]
    lay = layout(
        '<schema name="s"><module name="d">DOC</module><module name="e">E</module></schema>'
    )
    out = compile_prompt(pml.prompt("s", pml.use("d"), "x"), lay, tok, ROLES)
    assert out.use.positions == [3] and out.input_ids == tok("DOCx") == out.expanded


def test_python_api_equals_markup() -> None:
    tree = pml.schema(
        "s",
        pml.role("system", "S"),
        pml.module("a", "AAA", pml.param("p", 3), "aa\n    ", pml.module("a2", "NN")),
        pml.union(pml.module("b", "BB"), pml.module("c", "CCCC")),
    )
    assert compile_schema(tree, tok, ROLES) == layout()
    assert pml.parse_schema(pml.to_pml(tree)) == tree
    p = pml.prompt("s", pml.use("a", p="x<&"), "t")
    assert pml.parse_prompt(pml.to_pml(p)) == p


def test_empty_role_is_its_opening_only() -> None:
    lay = layout('<schema name="s"><module name="d">D</module></schema>')
    out = compile_prompt(
        pml.parse_prompt('<prompt schema="s"><d/><assistant/></prompt>'), lay, tok, ROLES
    )
    assert out.input_ids == tok("D") + tok("ASSISTANT: ")


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ('<prompt schema="s"><zz/>x</prompt>', "schema 's' has no module 'zz'"),
        ('<prompt schema="s"><b/><c/>x</prompt>', "members of one union"),
        ('<prompt schema="s"><a2/>x</prompt>', "nested in 'a'; import 'a' too"),
        ('<prompt schema="s"><a p="long"/>x</prompt>', "argument 'p' of module 'a' is 4 tokens"),
        ('<prompt schema="s"><a q="x"/>x</prompt>', "module 'a' has no parameter 'q'"),
        ('<prompt schema="s"><a/><a/>x</prompt>', "imported twice"),
        ('<prompt schema="s"><b/></prompt>', "no text or arguments of its own"),
        ('<prompt schema="s"><user><b/></user></prompt>', "holds only text"),
        ('<prompt schema="s"><module name="x"/></prompt>', "<module> is not allowed"),
        ('<prompt schema="s"><b>t</b></prompt>', "must be empty"),
        ('<prompt schema="s"><b/>x', "malformed markup"),
        ("<prompt><b/>x</prompt>", "missing ['schema']"),
        ('<schema name="s"/>', "expected a <prompt> document"),
    ],
)
def test_prompt_errors(prompt: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        compile_prompt(pml.parse_prompt(prompt), layout(), tok, ROLES)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ('<schema name="s"><module name="a"/><module name="a"/></schema>', "two modules named"),
        (
            '<schema name="s"><module name="a"><param name="p" len="1"/>'
            '<param name="p" len="2"/></module></schema>',
            "two params named",
        ),
        ('<schema name="s"><param name="p" len="x"/></schema>', "len must be an integer"),
        ('<schema name="s"><param name="p" len="0"/></schema>', "len must be an integer >= 1"),
        ('<schema name="s"><union>t</union></schema>', "holds only <module>"),
        ('<schema name="s"><bogus/></schema>', "unknown tag <bogus>"),
        ('<schema name="s"><module name="user"/></schema>', "module name 'user'"),
        ('<schema name="s"><module/></schema>', "missing ['name']"),
        ('<schema name="s" x="1"></schema>', "unknown ['x']"),
        ('<!DOCTYPE x [<!ENTITY a "b">]><schema name="s"/>', "DOCTYPE and ENTITY"),
        ("<schema name='s'><module name='a'>", "malformed markup"),
    ],
)
def test_schema_errors(schema: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        layout(schema)


def test_python_api_errors() -> None:
    with pytest.raises(ValueError, match="len must be an integer >= 1"):
        pml.param("p", 0)
    with pytest.raises(ValueError, match="members must be one or more modules"):
        pml.union()
    with pytest.raises(ValueError, match="roles are system, user, assistant"):
        pml.role("tool", "x")
    with pytest.raises(ValueError, match="module name 'a b'"):
        pml.module("a b")


def test_deep_nesting_is_a_value_error() -> None:
    from radixserve.prompt.registry import SchemaRegistry

    class CharTokenizer:
        chat_template = None

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return tok(text)

    deep = '<schema name="s">' + "".join(f'<module name="m{i}">x' for i in range(5000))
    deep += "</module>" * 5000 + "</schema>"
    with pytest.raises(ValueError, match="nested too deeply"):
        SchemaRegistry(CharTokenizer()).compile(deep)
