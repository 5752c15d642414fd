"""Streams continued from what they sent (radixserve/ray/resume.py), on a real server: a
greedy `/generate`, `/v1/completions` or `/v1/chat/completions` stream cut after some events
and continued by the call `StreamResume` makes ends with the text, token ids and counts of
the stream that was never cut; events are relayed whole whatever the chunking; text a
replica held back is sent with the continuation; streams that cannot be continued are
named."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import API_KEY, ServerHandle, bearer

from radixserve.ray.resume import DONE, StreamResume
from radixserve.server.openai_protocol import parse_messages
from radixserve.tokenizer.chat import render_chat

PROMPT = [1, 504, 3121, 28, 260, 1345, 29, 2444]  # token ids of the tiny model's vocabulary
MAX_NEW = 24


def stream_bytes(server: ServerHandle, body: dict[str, Any], path: str = "/generate") -> bytes:
    with httpx.Client(base_url=server.url, timeout=120, headers=bearer(API_KEY)) as c:
        with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            return b"".join(r.iter_raw())


def events(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def last_event(relayed: list[bytes]) -> dict[str, Any]:
    data = [e for e in relayed if e.startswith(b"data: {")]
    return json.loads(data[-1][len(b"data: ") :])


def decoder(tokenizer: Any) -> Any:
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def no_decode(ids: list[int], skip: bool) -> str:
    raise AssertionError("not decoded")


def body_of(**sampling: Any) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True, **sampling}
    return {"input_ids": PROMPT, "sampling_params": params, "stream": True}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_cut_stream_continued_ends_as_the_uncut_one(
    server: ServerHandle, tokenizer: Any, where: str
) -> None:
    """Cut after the first event, half-way, or before the one with the finish reason."""
    body = body_of(min_new_tokens=20)
    whole = events(stream_bytes(server, body))
    want = last_event(whole)
    assert whole[-1] == DONE and len(want["output_ids"]) == MAX_NEW
    cut = {"first": 1, "middle": len(whole) // 2, "last": len(whole) - 2}[where]
    assert 1 <= cut < len(whole) - 1, (cut, len(whole))
    resume = StreamResume.of("/generate", body, PROMPT, decoder(tokenizer))
    assert resume is not None and json.loads(resume.request()) == body
    sent = b"".join(whole[:cut])
    relayed = []
    for i in range(0, len(sent), 7):  # chunks that split events
        relayed += resume.events(sent[i : i + 7])
    relayed += resume.events(b'data: {"text": "half an ev')  # the failed call's last bytes
    assert relayed == whole[:cut]  # whole events only, as the replica sent them
    more = resume.continuation()
    assert more is not None
    route, cont_body, ids = more
    cont = json.loads(cont_body)
    assert route == "/generate"
    got = last_event(whole[:cut])
    assert ids == PROMPT + got["output_ids"] == cont["input_ids"]
    assert cont["sampling_params"]["max_new_tokens"] == MAX_NEW - len(got["output_ids"])
    assert cont["sampling_params"]["min_new_tokens"] == max(20 - len(got["output_ids"]), 0)
    rest = stream_bytes(server, cont)
    for i in range(0, len(rest), 13):
        relayed += resume.events(rest[i : i + 13])
    end = last_event(relayed)
    assert relayed[-1] == DONE
    assert end["text"] == want["text"] and end["output_ids"] == want["output_ids"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert end["meta_info"][key] == want["meta_info"][key], key
    assert end["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    texts = [json.loads(e[6:])["text"] for e in relayed if e.startswith(b"data: {")]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "the text never goes back"


def test_a_finished_stream_needs_only_its_end(server: ServerHandle) -> None:
    body = body_of()
    whole = events(stream_bytes(server, body))
    resume = StreamResume.of("/generate", body, PROMPT, no_decode)
    assert resume is not None
    list(resume.events(b"".join(whole[:-1])))  # every event but [DONE]
    assert resume.continuation() is None and resume.finished


CHAT = [{"role": "user", "content": "Say something"}]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"text": "x"}),  # not streamed
        ("/generate", {"text": ["x", "y"], "stream": True}),  # a batch
        ("/generate", {"text": "x", "stream": True, "sampling_params": {"n": 2}}),
        ("/generate", {"text": "x", "stream": True, "return_logprob": True}),
        ("/generate", {"text": "x", "stream": True, "sampling_params": {"regex": "a+"}}),
        ("/generate", {"text": "x", "stream": True, "sampling_params": {"frequency_penalty": 1}}),
        ("/v1/completions", {"prompt": "x"}),
        ("/v1/completions", {"prompt": ["x", "y"], "stream": True}),
        ("/v1/completions", {"prompt": "x", "stream": True, "logprobs": 0}),
        ("/v1/completions", {"prompt": "x", "stream": True, "echo": True}),
        ("/v1/completions", {"prompt": "x", "stream": True, "n": 2}),
        ("/v1/completions", {"prompt": "x", "stream": True, "repetition_penalty": 1.2}),
        ("/v1/completions", {"prompt": "x", "stream": True, "regex": "a+"}),
        ("/v1/chat/completions", {"messages": CHAT, "stream": True, "tools": [{}]}),
        ("/v1/chat/completions", {"messages": CHAT, "stream": True, "logprobs": True}),
        ("/v1/chat/completions",
         {"messages": CHAT, "stream": True, "response_format": {"type": "json_object"}}),
        ("/v1/chat/completions", {"pml": "<prompt/>", "stream": True}),
        ("/v1/models", {"stream": True}),
    ],
)  # fmt: skip
def test_streams_that_are_not_continued(path: str, body: dict[str, Any]) -> None:
    assert StreamResume.of(path, body, [1, 2], no_decode) is None
    for path, plain in [("/generate", {"text": "x"}), ("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": CHAT})]:  # fmt: skip
        assert StreamResume.of(path, {**plain, "stream": True}, [1, 2], no_decode) is not None


def choices(relayed: list[bytes]) -> list[dict[str, Any]]:
    data = [json.loads(e[6:]) for e in relayed if e.startswith(b"data: {")]
    return [c for d in data for c in d["choices"]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("client_ids", [False, True])
def test_an_openai_stream_continued_reads_as_the_uncut_one(
    server: ServerHandle, tokenizer: Any, path: str, client_ids: bool
) -> None:
    """Cut half-way (the cut call sent with token ids, as the ingress sends it) and continued
    on /v1/completions: the client sees the uncut stream's chunks' text, head, shape and
    usage, and token ids only when it asked for them."""
    chat = path == "/v1/chat/completions"
    body: dict[str, Any] = {"max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    body.update({"messages": CHAT} if chat else {"prompt": PROMPT})
    if client_ids:
        body["return_token_ids"] = True
    ids = render_chat(tokenizer, parse_messages(body)) if chat else PROMPT
    uncut = events(stream_bytes(server, {**body, "return_token_ids": True}, path))
    want = choices(uncut)
    resume = StreamResume.of(path, body, ids, decoder(tokenizer))
    assert resume is not None
    first = json.loads(resume.request())
    assert first == {**body, "return_token_ids": True}
    whole = events(stream_bytes(server, first, path))
    cut = len(whole) // 2
    relayed = []
    sent = b"".join(whole[:cut])
    for i in range(0, len(sent), 7):
        relayed += resume.events(sent[i : i + 7])
    more = resume.continuation()
    assert more is not None
    route, cont_body, cont_ids = more
    cont = json.loads(cont_body)
    sent_ids = [i for c in choices(whole[:cut]) for i in c["token_ids"]]
    assert route == "/v1/completions" and cont_ids == cont["prompt"] == ids + sent_ids
    assert cont["max_tokens"] == MAX_NEW - len(sent_ids) and cont["return_token_ids"] is True
    assert "messages" not in cont and cont["stream_options"] == {"include_usage": True}
    rest = stream_bytes(server, cont, route)
    for i in range(0, len(rest), 13):
        relayed += resume.events(rest[i : i + 13])
    assert relayed[-1] == DONE
    heads = [json.loads(e[6:]) for e in relayed if e.startswith(b"data: {")]
    head = {k: heads[0][k] for k in ("id", "object", "created", "model")}
    assert [{k: h[k] for k in head} for h in heads] == [head] * len(heads)
    assert head["object"] == ("chat.completion.chunk" if chat else "text_completion")
    got = choices(relayed)
    key = "delta" if chat else "text"
    assert all(key in c for c in got)

    def text(cs: list[dict[str, Any]]) -> str:
        return "".join(c["delta"].get("content", "") if chat else c["text"] for c in cs)

    assert text(got) == text(want) and got[-1]["finish_reason"] == want[-1]["finish_reason"]
    assert all(("token_ids" in c) == client_ids for c in got)
    if client_ids:
        assert [i for c in got for i in c["token_ids"]] == [i for c in want for i in c["token_ids"]]
    usage = json.loads(relayed[-2][6:])["usage"]
    want_usage = json.loads(uncut[-2][6:])["usage"]
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[k] == want_usage[k], k
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]


def test_a_chat_without_a_limit_continues_to_the_end_of_the_context() -> None:
    body = {"messages": CHAT, "stream": True}
    resume = StreamResume.of("/v1/chat/completions", body, [1, 2, 3], lambda ids, skip: "ab")
    assert resume is not None and resume.needs_context_len
    head = '{"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", '
    event = head + '"choices": [{"index": 0, "delta": {"content": "ab"}, "token_ids": [7, 8]}]}'
    assert b"token_ids" not in b"".join(resume.events(b"data: " + event.encode() + b"\n\n"))
    with pytest.raises(ValueError, match="context length"):
        resume.continuation()
    more = resume.continuation(context_len=100)
    assert more is not None and json.loads(more[1])["max_tokens"] == 100 - 3 - 2
    assert (
        StreamResume.of(
            "/v1/chat/completions", {**body, "max_completion_tokens": 9}, [1], no_decode
        ).needs_context_len
        is False
    )  # type: ignore[union-attr]


def test_text_a_replica_held_back_comes_with_the_continuation() -> None:
    """The replica sent ids 1, 2, 3 and the text of 1, 2 only (3 might begin a stop
    string): the continuation's first event brings 3's text before its own."""
    texts = {1: "a", 2: "b", 3: "c", 4: "d"}
    decode = lambda ids, skip: "".join(texts[i] for i in ids)  # noqa: E731
    native = StreamResume.of("/generate", body_of(), PROMPT, decode)
    assert native is not None
    list(native.events(b'data: {"text": "ab", "output_ids": [1, 2, 3], "meta_info": {}}\n\n'))
    assert native.continuation() is not None
    out = list(native.events(b'data: {"text": "d", "output_ids": [4], "meta_info": {}}\n\n'))
    assert json.loads(out[0][6:])["text"] == "abcd"
    body = {"prompt": "x", "stream": True, "max_tokens": 8}
    openai = StreamResume.of("/v1/completions", body, [9], decode)
    assert openai is not None
    head = b'data: {"id": "i", "object": "text_completion", "created": 1, "model": "m", '
    list(
        openai.events(
            head + b'"choices": [{"index": 0, "text": "ab", "token_ids": [1, 2, 3]}]}\n\n'
        )
    )
    assert openai.continuation() is not None
    out = list(
        openai.events(head + b'"choices": [{"index": 0, "text": "d", "token_ids": [4]}]}\n\n')
    )
    assert json.loads(out[0][6:])["choices"][0]["text"] == "cd" and openai.text == "abcd"


def test_events_a_replica_garbled_are_relayed_but_not_continued() -> None:
    """What a replica sends is not trusted: an event whose fields have the wrong types is
    passed on and not recorded, and ids that are not ints refuse a continuation."""
    resume = StreamResume.of("/generate", body_of(), PROMPT, no_decode)
    assert resume is not None
    odd = [b'data: {"text": 5, "output_ids": [1]}', b'data: {"text": "a", "output_ids": "x"}',
           b"data: [1, 2]", b"data: {not json"]  # fmt: skip
    for raw in odd:
        assert list(resume.events(raw + b"\n\n")) == [raw + b"\n\n"]
    resume.settle()
    assert resume.ids == [] and resume.text == ""
    list(resume.events(b'data: {"text": "a", "output_ids": [1, "2"], "meta_info": {}}\n\n'))
    with pytest.raises(ValueError, match="not token ids"):
        resume.continuation()


def test_a_native_stream_is_read_only_when_it_breaks(
    server: ServerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cumulative events are relayed unread; a break reads the first and the newest few, so
    a stream of n tokens is not parsed n times over."""
    import radixserve.ray.resume as resume_module

    reads = []
    loads = json.loads
    monkeypatch.setattr(resume_module.json, "loads", lambda raw: reads.append(raw) or loads(raw))
    whole = events(stream_bytes(server, body_of()))
    resume = StreamResume.of("/generate", body_of(), PROMPT, no_decode)
    assert resume is not None
    assert list(resume.events(b"".join(whole[:-2]))) == whole[:-2] and reads == []
    resume.settle()
    assert len(reads) <= 5 and resume.ids == last_event(whole[:-2])["output_ids"]
