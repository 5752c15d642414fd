"""A `/generate` stream continued from what it sent (radixserve/ray/resume.py), on a real
server: a greedy stream cut after some events and continued by the call `StreamResume`
makes ends with the text, token ids and counts of the stream that was never cut; events
are relayed whole whatever the chunking; streams that cannot be continued are named."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import API_KEY, ServerHandle, bearer

from radixserve.ray.resume import DONE, StreamResume

PROMPT = [1, 504, 3121, 28, 260, 1345, 29, 2444]  # token ids of the tiny model's vocabulary
MAX_NEW = 24


def stream_bytes(server: ServerHandle, body: dict[str, Any]) -> bytes:
    with httpx.Client(base_url=server.url, timeout=120, headers=bearer(API_KEY)) as c:
        with c.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            return b"".join(r.iter_raw())


def events(raw: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def last_event(relayed: list[bytes]) -> dict[str, Any]:
    data = [e for e in relayed if e.startswith(b"data: {")]
    return json.loads(data[-1][len(b"data: ") :])


def body_of(**sampling: Any) -> dict[str, Any]:
    params = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True, **sampling}
    return {"input_ids": PROMPT, "sampling_params": params, "stream": True}


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_cut_stream_continued_ends_as_the_uncut_one(server: ServerHandle, where: str) -> None:
    """Cut after the first event, half-way, or before the one with the finish reason."""
    body = body_of(min_new_tokens=20)
    whole = events(stream_bytes(server, body))
    want = last_event(whole)
    assert whole[-1] == DONE and len(want["output_ids"]) == MAX_NEW
    cut = {"first": 1, "middle": len(whole) // 2, "last": len(whole) - 2}[where]
    assert 1 <= cut < len(whole) - 1, (cut, len(whole))
    resume = StreamResume.of("/generate", body, PROMPT)
    assert resume is not None
    sent = b"".join(whole[:cut])
    relayed = []
    for i in range(0, len(sent), 7):  # chunks that split events
        relayed += resume.events(sent[i : i + 7])
    relayed += resume.events(b'data: {"text": "half an ev')  # the failed call's last bytes
    assert relayed == whole[:cut]  # whole events only, as the replica sent them
    more = resume.continuation()
    assert more is not None
    cont_body, ids = more
    cont = json.loads(cont_body)
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
    resume = StreamResume.of("/generate", body, PROMPT)
    assert resume is not None
    list(resume.events(b"".join(whole[:-1])))  # every event but [DONE]
    assert resume.finished and resume.continuation() is None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x", "stream": True}),
        ("/generate", {"text": "x"}),  # not streamed
        ("/generate", {"text": ["x", "y"], "stream": True}),  # a batch
        ("/generate", {"text": "x", "stream": True, "sampling_params": {"n": 2}}),
        ("/generate", {"text": "x", "stream": True, "return_logprob": True}),
    ],
)
def test_streams_that_are_not_continued(path: str, body: dict[str, Any]) -> None:
    assert StreamResume.of(path, body, [1, 2]) is None
    assert StreamResume.of("/generate", {"text": "x", "stream": True}, [1, 2]) is not None


def test_events_a_replica_garbled_are_relayed_but_not_continued() -> None:
    """What a replica sends is not trusted: an event whose fields have the wrong types is
    passed on and not recorded, and ids that are not ints refuse a continuation."""
    resume = StreamResume.of("/generate", body_of(), PROMPT)
    assert resume is not None
    odd = [b'data: {"text": 5, "output_ids": [1]}', b'data: {"text": "a", "output_ids": "x"}',
           b"data: [1, 2]", b"data: {not json"]  # fmt: skip
    for raw in odd:
        assert list(resume.events(raw + b"\n\n")) == [raw + b"\n\n"]
    assert resume.ids == [] and resume.text == ""
    list(resume.events(b'data: {"text": "a", "output_ids": [1, "2"], "meta_info": {}}\n\n'))
    with pytest.raises(ValueError, match="not token ids"):
        resume.continuation()
