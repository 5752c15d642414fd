"""Each family's own chat template, as its GGUF files carry it (`tokenizer.chat_template`;
the templates in tests/data/chat_templates), on a tiny random model of the family written
the way llama.cpp's converter writes it, with the family's special tokens as control tokens:
- the prompt rendered from the file is the format the family documents, its special tokens
  one id each, and `chat_template_kwargs` reach the template (Qwen3's and SmolLM3's
  `enable_thinking`);
- generation ends at the family's end of turn even where the file's eos is another token
  (Gemma's and Phi-4's files);
- a real server (slow tier) serves /v1/chat/completions with it (the `openai` client): the
  prompt's token count, a reply ended by the end-of-turn token (forced by logit_bias) with finish
  reason "stop" and nothing of it in the text, and the template's own refusals as 400s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import openai
import pytest
from conftest import launch_server
from test_gguf_families import BOS, EOS, FAMILIES, TOKENS, UNK, write_gguf

from radixserve.models import resolve_model_path
from radixserve.models.loader import load_config, load_tokenizer
from radixserve.tokenizer.chat import render_chat

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "And now?"},
]
TODAY = time.strftime("%d %B %Y")  # SmolLM3's template dates its system block


# Gemma's files carry a sentencepiece vocabulary: its specials, the 256 byte tokens every
# character falls back to, and the word boundary.
SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
SPM_TOKENS = [*SPM_SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), "\u2581"]


class Family:
    def __init__(self, arch: str, template: str, specials: list[str], end: str,
                 eos_is_end: bool, kwargs: dict[str, Any], expected: str) -> None:  # fmt: skip
        self.arch, self.template, self.specials, self.end = arch, template, specials, end
        self.eos_is_end, self.kwargs, self.expected = eos_is_end, kwargs, expected
        self.spm = arch == "gemma3"
        self.tokens = [*(SPM_TOKENS if self.spm else TOKENS), *self.specials]
        self.eos = self.tokens.index("<eos>") if self.spm else EOS

    def token_id(self, text: str) -> int:
        return self.tokens.index(text)

    def write_tokenizer(self, w: gguf.GGUFWriter) -> None:
        """The tiny tokenizer (Gemma's: a sentencepiece one) plus the family's special
        tokens; eos the end of turn where the family's own files say so."""
        n, kinds = len(self.specials), gguf.TokenType
        if self.spm:
            w.add_tokenizer_model("llama")
            types = [kinds.CONTROL] * 4 + [kinds.BYTE] * 256 + [kinds.NORMAL]
            w.add_token_scores([0.0] * len(self.tokens))
            unk, bos = self.token_id("<unk>"), self.token_id("<bos>")
        else:
            w.add_tokenizer_model("gpt2")
            types = [kinds.NORMAL] * UNK + [kinds.CONTROL] * 3
            w.add_token_merges(["Ġ t", "h e"])
            unk, bos = UNK, BOS
        w.add_token_list(self.tokens)
        w.add_token_types(types + [kinds.CONTROL] * n)
        w.add_unk_token_id(unk)
        w.add_bos_token_id(bos)
        w.add_eos_token_id(self.token_id(self.end) if self.eos_is_end else self.eos)
        w.add_chat_template((TEMPLATES / self.template).read_text())


CHATML = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]
SMOLLM3_HEADER = (
    "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\n"
    f"Today Date: {TODAY}\nReasoning Mode: /no_think\n\n## Custom Instructions\n\nBe brief.\n\n"
)
FAMILY = {
    "qwen3": Family(
        "qwen3", "qwen3.jinja", CHATML, "<|im_end|>", True, {"enable_thinking": False},
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ),
    "gemma3": Family(
        "gemma3", "gemma3.jinja", ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>",
        False, {},
        "<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n<start_of_turn>user\nAnd now?<end_of_turn>\n"
        "<start_of_turn>model\n",
    ),
    "phi3": Family(
        "phi3", "phi4_mini.jinja",
        ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>", "<|/tool|>"],
        "<|end|>", False, {},
        "<|system|>Be brief.<|end|><|user|>Hi there<|end|><|assistant|>Hello!<|end|>"
        "<|user|>And now?<|end|><|assistant|>",
    ),
    "smollm3": Family(
        "smollm3", "smollm3.jinja", CHATML, "<|im_end|>", True, {"enable_thinking": False},
        SMOLLM3_HEADER + "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\nHello!<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n",
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """family -> its converted folder (the GGUF file beside it), made once per module."""
    root = tmp_path_factory.mktemp("chat-templates")
    mp = pytest.MonkeyPatch()
    mp.setenv("RADIXSERVE_CACHE", str(root / "cache"))
    made: dict[str, Path] = {}

    def folder(name: str) -> Path:
        if name not in made:
            f = FAMILY[name]
            model = FAMILIES[f.arch](len(f.tokens))
            made[name] = write_gguf(model, root / f"{name}.gguf", tokenizer=f.write_tokenizer)
        return made[name]

    yield folder
    mp.undo()


@pytest.mark.parametrize("name", list(FAMILY))
def test_the_files_template_renders_the_familys_format(
    files: Callable[[str], Path], name: str
) -> None:
    f = FAMILY[name]
    folder = resolve_model_path(str(files(name)))
    tok = load_tokenizer(folder)
    ids = render_chat(tok, CONVERSATION, None, f.kwargs)
    assert tok.decode(ids) == f.expected
    special_ids = {f.token_id(t) for t in f.specials}
    spelled = tok.decode([i for i in ids if i not in special_ids])
    assert not any(t in spelled for t in f.specials)  # one id each, never spelled out
    assert f.token_id(f.end) in ids
    eos = load_config(folder).eos_token_ids
    assert f.token_id(f.end) in eos and (f.eos_is_end or f.eos in eos)


def test_template_kwargs_reach_the_template(files: Callable[[str], Path]) -> None:
    tok = load_tokenizer(resolve_model_path(str(files("qwen3"))))
    thinking = tok.decode(render_chat(tok, CONVERSATION[:2]))
    plain = tok.decode(render_chat(tok, CONVERSATION[:2], None, {"enable_thinking": False}))
    assert plain == thinking + "<think>\n\n</think>\n\n"


@pytest.mark.slow  # a server per family: ~6 s each
@pytest.mark.parametrize("name", list(FAMILY))
def test_a_server_serves_chat_with_the_familys_template(
    files: Callable[[str], Path], name: str, tmp_path: Path
) -> None:
    f = FAMILY[name]
    path = files(name)
    tok = load_tokenizer(resolve_model_path(str(path)))
    h = launch_server(path, tmp_path, "--max-total-tokens", "1024")
    try:
        client = openai.OpenAI(base_url=h.url + "/v1", api_key="none", max_retries=0)
        extra = {"chat_template_kwargs": f.kwargs} if f.kwargs else None
        out = client.chat.completions.create(
            model="m", messages=CONVERSATION, max_tokens=8, temperature=0,  # type: ignore[arg-type]
            logit_bias={str(f.token_id(f.end)): 100}, extra_body=extra,
        )  # fmt: skip
        assert out.usage is not None
        assert out.usage.prompt_tokens == len(tok.encode(f.expected, add_special_tokens=False))
        assert out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == 1 and out.choices[0].message.content == ""
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
            client.chat.completions.create(
                model="m", messages=CONVERSATION, max_tokens=1,  # type: ignore[arg-type]
                extra_body={"chat_template_kwargs": {"add_generation_prompt": False}},
            )  # fmt: skip
        if name == "gemma3":  # its template refuses turns that do not alternate
            with pytest.raises(openai.BadRequestError, match="alternate"):
                client.chat.completions.create(
                    model="m", max_tokens=1,
                    messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                )  # fmt: skip
    finally:
        assert h.stop() == 0, h.log_text()[-4000:]
