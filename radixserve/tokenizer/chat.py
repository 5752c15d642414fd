"""Chat prompts: OpenAI-style messages -> token ids through the tokenizer's own template."""

from __future__ import annotations

from typing import Any


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template rejected them)."""


def render_chat(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of `messages` followed by the assistant's generation prompt.

    Messages were validated by the api server (role: str, content: str). The template adds
    the special tokens itself, so the rendered text is encoded without adding more.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("messages: this model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja raises its own types for template-level rejections
        raise ChatTemplateError(f"messages: the chat template rejected them: {e}") from e
    return list(tokenizer.encode(text, add_special_tokens=False))
