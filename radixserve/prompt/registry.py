"""The schemas a front end knows, and prompts compiled against them.

The tokenizer process and the offline Engine each keep one `SchemaRegistry`, next to the
scheduler's ModuleStore that holds the encoded K/V: a schema is `compile`d here, marked as
being encoded (`begin`) while the scheduler encodes it, and `add`ed once the scheduler has
it (or `cancel`led if it refused or dropped it).
"""

from __future__ import annotations

from typing import Any

from radixserve.core.modules import ModuleUse
from radixserve.prompt.layout import CompiledPrompt, Layout, compile_prompt, compile_schema
from radixserve.prompt.pml import Prompt, Schema, parse_prompt, parse_schema
from radixserve.prompt.roles import template_for


class SchemaRegistry:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.roles = template_for(tokenizer)
        self.layouts: dict[str, Layout] = {}
        self.encoding: dict[str, Layout] = {}  # sent to the scheduler, not encoded yet

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def compile(self, schema: str | Schema) -> Layout:
        """A schema (PML or a `pml.schema(...)` tree) laid out; ValueError names the problem."""
        try:
            tree = parse_schema(schema) if isinstance(schema, str) else schema
            if not isinstance(tree, Schema):
                raise ValueError("schema: expected PML text or a radixserve.prompt schema")
            return compile_schema(tree, self.tokenize, self.roles)
        except RecursionError:
            raise ValueError("schema: modules are nested too deeply") from None

    def begin(self, layout: Layout) -> None:
        self.encoding.setdefault(layout.compiled.name, layout)

    def cancel(self, layout: Layout) -> None:
        """Forget `layout` as being encoded (only that one: a schema of the same name that
        is registered or being encoded stays)."""
        if self.encoding.get(layout.compiled.name) is layout:
            del self.encoding[layout.compiled.name]

    def add(self, layout: Layout) -> None:
        self.cancel(layout)
        self.layouts[layout.compiled.name] = layout

    def remove(self, name: str) -> None:
        self.layouts.pop(name, None)

    def prompt(self, prompt: str | Prompt) -> CompiledPrompt:
        """A prompt (PML or a `pml.prompt(...)` tree) against a known schema; ValueError
        names the problem (unknown schema or module, union clash, argument too long)."""
        tree = parse_prompt(prompt) if isinstance(prompt, str) else prompt
        if not isinstance(tree, Prompt):
            raise ValueError("pml: expected PML text or a radixserve.prompt prompt")
        layout = self.layouts.get(tree.schema)
        if layout is None and tree.schema in self.encoding:
            raise ValueError(
                f"pml: schema {tree.schema!r} is still being encoded; retry once its "
                "registration has returned"
            )
        if layout is None:
            raise ValueError(f"pml: no schema {tree.schema!r} is registered")
        return compile_prompt(tree, layout, self.tokenize, self.roles)

    def token_ids(
        self, prompt: str | Prompt, module_reuse: bool
    ) -> tuple[list[int], ModuleUse | None]:
        """(input_ids, imports) of a request: with module reuse, the modules' tokens then the
        prompt's own; without, the expanded prompt and no imports."""
        compiled = self.prompt(prompt)
        if module_reuse:
            return compiled.input_ids, compiled.use
        return compiled.expanded, None
