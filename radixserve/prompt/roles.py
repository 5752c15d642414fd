"""Role markup (the DSL's `user(...)`, PML's `<user>`) derived from the model's chat template.

A program appends text incrementally, while an HF chat template renders a whole message
list. We recover each role's prefix and suffix by rendering probe conversations and
cutting around probe contents (templates are assumed prefix-stable: rendering one more
message only appends text, which holds for the Llama/Qwen/Mistral/ChatML templates):

    render([system S])                       = sys_pre  S sys_suf
    render([system S, user P]) - render([system S])        = user_pre P user_suf
    render([system S, user U, assistant P]) - render([system S, user U]) = asst_pre P asst_suf
    render([user P])                         = first_user_pre P ...   (default system text!)

The role that opens a conversation gets the `first` prefix: templates such as SmolLM2's and
Qwen2's insert a default system message when the first message is not a system one. The
assistant prefix is the template's generation prompt when it has one (what `gen` after
`assistant` must see). A tokenizer without a chat template gets SGLang's plain "default"
template ("USER: ...\n").
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("radixserve.frontend")

ROLES = ("system", "user", "assistant")
Messages = list[dict[str, str]]
# (messages, add_generation_prompt) -> rendered text
Renderer = Callable[[Messages, bool], str]

# Probe contents: no whitespace (some templates strip content), unlikely in any template.
_PROBE = "PROBExq7CONTENT"
_FILL = {"system": "SYSxq7", "user": "USRxq7", "assistant": "ASTxq7"}


@dataclass(frozen=True)
class RoleTemplate:
    first_prefix: dict[str, str]  # prefix of a role that opens the conversation
    prefix: dict[str, str]  # prefix of a role anywhere else
    suffix: dict[str, str]

    def begin(self, role: str, first: bool) -> str:
        assert role in ROLES, f"unknown role {role!r}; roles are {ROLES}"
        return (self.first_prefix if first else self.prefix)[role]

    def end(self, role: str) -> str:
        assert role in ROLES, f"unknown role {role!r}; roles are {ROLES}"
        return self.suffix[role]

    @classmethod
    def plain(cls) -> RoleTemplate:
        """SGLang's "default" template, for models without a chat template."""
        prefix = {"system": "SYSTEM: ", "user": "USER: ", "assistant": "ASSISTANT: "}
        suffix = dict.fromkeys(ROLES, "\n")
        return cls(dict(prefix), prefix, suffix)

    @classmethod
    def from_renderer(cls, render: Renderer) -> RoleTemplate:
        """Derive the markup from a chat-template renderer (see the module docstring).

        A role the template refuses (raises, or is not prefix-stable for) falls back to the
        plain template for that role, with a warning.
        """
        plain = cls.plain()
        first, prefix, suffix = {}, {}, {}
        for role in ROLES:
            history = _history(role)
            try:
                prefix[role], suffix[role] = _cut(render, history, role)
            except Exception as e:  # templates raise anything (jinja TemplateError, ...)
                logger.warning("chat template: no %s markup (%s); using plain markup", role, e)
                prefix[role], suffix[role] = plain.prefix[role], plain.suffix[role]
            try:
                first[role] = _cut(render, [], role)[0]
            except Exception:
                first[role] = prefix[role]  # e.g. templates refusing a leading assistant
        generation = _generation_prompt(render)
        if generation:
            prefix["assistant"] = generation
        return cls(first, prefix, suffix)


def _history(role: str) -> Messages:
    """A well-formed conversation that `role` may follow."""
    order = {"system": [], "user": ["system"], "assistant": ["system", "user"]}[role]
    return [{"role": r, "content": _FILL[r]} for r in order]


def _cut(render: Renderer, history: Messages, role: str) -> tuple[str, str]:
    """(prefix, suffix) of `role` when it follows `history`."""
    before = render(history, False) if history else ""
    after = render([*history, {"role": role, "content": _PROBE}], False)
    assert after.startswith(before), "template is not prefix-stable"
    delta = after[len(before) :]
    assert delta.count(_PROBE) == 1, "probe content not rendered verbatim"
    pre, suf = delta.split(_PROBE)
    return pre, suf


def _generation_prompt(render: Renderer) -> str:
    history = _history("assistant")
    try:
        with_prompt, without = render(history, True), render(history, False)
    except Exception:  # a template that cannot render the probe: no generation prompt
        return ""
    if not with_prompt.startswith(without):
        return ""
    return with_prompt[len(without) :]


def hf_renderer(tokenizer: object) -> Renderer | None:
    """A renderer over an HF tokenizer's chat template, or None if it has none."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages: Messages, add_generation_prompt: bool) -> str:
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert isinstance(text, str), type(text)
        return text

    return render


def template_for(tokenizer: object) -> RoleTemplate:
    render = hf_renderer(tokenizer)
    if render is None:
        logger.warning("the tokenizer has no chat template: roles use plain markup")
        return RoleTemplate.plain()
    return RoleTemplate.from_renderer(render)
