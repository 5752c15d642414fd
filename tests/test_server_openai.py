"""OpenAI-compatible routes of the real server, driven by the official `openai` client.
Greedy outputs are checked against the native /generate on the same token ids."""

from __future__ import annotations

import openai
import pytest
from conftest import API_KEY, launch_server


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def native(server):
    with server.client() as c:
        yield c


def native_greedy(native, input_ids: list[int], max_new_tokens: int, **extra) -> dict:
    r = native.post(
        "/generate",
        json={
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, **extra},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_models(oai, tiny_model_dir):
    models = oai.models.list().data
    assert [m.id for m in models] == [str(tiny_model_dir)]  # --model as passed
    assert models[0].owned_by == "radixserve"


def test_completion_matches_native(oai, native, tokenizer):
    prompt = "The quick brown fox"
    expected = native_greedy(native, tokenizer.encode(prompt), 5)
    c = oai.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0)
    assert c.object == "text_completion" and c.model == "m"
    assert len(c.choices) == 1
    assert c.choices[0].text == expected["text"]
    assert c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert c.usage.completion_tokens == 5
    assert c.usage.total_tokens == c.usage.prompt_tokens + 5


def test_completion_batch_n_indices_and_token_prompt(oai, native, tokenizer):
    ids = tokenizer.encode("token prompt")
    c = oai.completions.create(model="m", prompt=["one", "two"], n=2, max_tokens=3, temperature=0)
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    by_index = {ch.index: ch.text for ch in c.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy samples agree
    assert c.usage.prompt_tokens == len(tokenizer.encode("one")) + len(tokenizer.encode("two"))
    assert c.usage.completion_tokens == 12
    t = oai.completions.create(model="m", prompt=ids, max_tokens=4, temperature=0)
    assert t.choices[0].text == native_greedy(native, ids, 4)["text"]


def test_completion_stream_n_indices(oai):
    kw = {"model": "m", "prompt": "stream me", "max_tokens": 5, "temperature": 0, "n": 2}
    full = oai.completions.create(**kw)
    chunks = list(oai.completions.create(**kw, stream=True))
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str | None] = {}
    for c in chunks:
        assert c.object == "text_completion" and len(c.choices) == 1
        ch = c.choices[0]
        assert ch.index not in finish, "chunk after the choice finished"
        texts[ch.index] += ch.text
        if ch.finish_reason is not None:
            finish[ch.index] = ch.finish_reason
    assert finish == {0: "length", 1: "length"}
    assert texts == {ch.index: ch.text for ch in full.choices}


def test_completion_logprobs(oai):
    c = oai.completions.create(
        model="m", prompt="logprobs", max_tokens=4, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 2
        # Greedy picks the top-1: the chosen token is in the top list with the same logprob.
        assert top[tok] == pytest.approx(value, abs=1e-5) == max(top.values())


def test_chat_matches_native_on_template_ids(oai, native, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = native_greedy(native, chat_ids(tokenizer, messages), 6)
    r = oai.chat.completions.create(model="m", messages=messages, max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == expected["text"]
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, messages))
    assert r.usage.completion_tokens == 6


def test_chat_stream_with_usage(oai):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Say something."}]},
    ]
    full = oai.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
    stream = oai.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_return_token_ids(oai, native, tokenizer):
    """vLLM's `return_token_ids`: each choice's output ids, a stream chunk's its own since the
    choice's last chunk (ids whose text is held back come with a later chunk)."""
    kw = {"model": "m", "prompt": "ids please", "max_tokens": 6, "temperature": 0, "n": 2}
    full = oai.completions.create(**kw, extra_body={"return_token_ids": True})
    want = native_greedy(native, tokenizer.encode("ids please"), 6)["output_ids"]
    assert [ch.token_ids for ch in full.choices] == [want, want]
    chunks = list(oai.completions.create(**kw, stream=True, extra_body={"return_token_ids": True}))
    for index in (0, 1):
        own = [c.choices[0] for c in chunks if c.choices[0].index == index]
        assert [i for ch in own for i in ch.token_ids] == want
    messages = [{"role": "user", "content": "ids"}]
    chat = {"model": "m", "messages": messages, "max_tokens": 5, "temperature": 0}
    ids = native_greedy(native, chat_ids(tokenizer, messages), 5)["output_ids"]
    r = oai.chat.completions.create(**chat, extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == ids
    stream = oai.chat.completions.create(**chat, stream=True, extra_body={"return_token_ids": True})
    assert [i for c in stream for i in c.choices[0].token_ids] == ids
    plain = oai.chat.completions.create(**chat)
    assert getattr(plain.choices[0], "token_ids", None) is None  # not asked: not sent
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt="x", extra_body={"return_token_ids": "yes"})
    assert "return_token_ids" in str(e.value)


def test_chat_logprobs_and_stop(oai):
    messages = [{"role": "user", "content": "hi"}]
    r = oai.chat.completions.create(
        model="m", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode() == c.token
    text = r.choices[0].message.content
    stop = text[2:5]
    s = oai.chat.completions.create(
        model="m", messages=messages, max_tokens=5, temperature=0, stop=[stop]
    )
    assert s.choices[0].finish_reason == "stop"
    assert s.choices[0].message.content == text[: text.index(stop)]


def test_seed_reproducible(oai):
    def sample(seed: int) -> str:
        r = oai.completions.create(
            model="m", prompt="random", max_tokens=8, temperature=1.0, seed=seed
        )
        return r.choices[0].text

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c


def test_errors_are_openai_errors(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt="x", max_tokens=4, temperature=-1)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="m", messages=[], max_tokens=4)
    assert "messages" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="m", prompt="x", max_tokens=-1)
    assert "max_tokens" in str(e.value)
    bad_key = openai.OpenAI(base_url=oai.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


@pytest.mark.slow
def test_embedded_model_answers_paris(tmp_path):
    """The default model (embedded SmolLM2-135M-Instruct, converted on first use)."""
    h = launch_server(None, tmp_path, "--max-total-tokens", "2048")
    try:
        client = openai.OpenAI(base_url=h.url + "/v1", api_key="unused", max_retries=0)
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        r = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    finally:
        assert h.stop() == 0
