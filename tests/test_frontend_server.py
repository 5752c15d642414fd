"""Frontend programs against the REAL server (conftest `server` fixture: tiny random Llama,
1024-token KV pool, API key) through RuntimeEndpoint: fork shares the prefix (server
counters and cached_tokens), select, chat roles, streaming, batching, errors."""

from __future__ import annotations

from typing import Any

import pytest

import radixserve.frontend as rs

GREEDY = {"temperature": 0, "ignore_eos": True}
PREFIX = "The quick brown fox jumps over the lazy dog. " * 10  # ~100 tokens


@pytest.fixture(scope="module")
def endpoint(server: Any) -> rs.RuntimeEndpoint:
    ep = rs.RuntimeEndpoint(server.url, api_key=server.api_key)
    yield ep
    ep.close()


def computed(ep: rs.RuntimeEndpoint) -> int:
    """Token rows the server has computed, less the draft tokens it did not keep (speculative
    decoding computes those too)."""
    stats = ep.get_server_info()["scheduler"]
    rejected = stats["draft_tokens_total"] - stats["accepted_draft_tokens_total"]
    return int(stats["computed_tokens_total"] - rejected)


@rs.function
def fork_program(s: Any, n: int, max_tokens: int) -> None:
    s += PREFIX
    forks = s.fork(n)
    for i, f in enumerate(forks):
        f += f" Option {i}:" + rs.gen("x", max_tokens=max_tokens, **GREEDY)
    forks.join()


def test_fork_of_16_prefills_the_shared_prefix_once(endpoint: rs.RuntimeEndpoint) -> None:
    assert endpoint.flush_cache()
    prefix_len = len(endpoint.encode(PREFIX))
    before = computed(endpoint)
    state = fork_program.run(16, 6, backend=endpoint)
    metas = state.get_meta_info("x")
    assert len(metas) == 16 and all(m["completion_tokens"] == 6 for m in metas)
    assert all(m["cached_tokens"] >= prefix_len - 1 for m in metas), [
        m["cached_tokens"] for m in metas
    ]
    # Server counters: the commit prefilled the prefix once; each child ran only its
    # uncached prompt tokens plus 5 decode inputs (a kept draft token stands for one).
    children = sum(m["prompt_tokens"] - m["cached_tokens"] + 5 for m in metas)
    assert computed(endpoint) - before == prefix_len + children
    assert children < 16 * 12


def test_program_output_matches_plain_generate(server: Any, endpoint: rs.RuntimeEndpoint) -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "Once upon a time" + rs.gen("x", max_tokens=10, **GREEDY)

    state = prog.run(backend=endpoint)
    with server.client() as c:
        ref = c.post(
            "/generate",
            json={"text": "Once upon a time", "sampling_params": {"max_new_tokens": 10, **GREEDY}},
        ).json()
    assert state["x"] == ref["text"]
    assert state.get_meta_info("x")["completion_tokens"] == 10


def test_stream_and_chat_roles(endpoint: rs.RuntimeEndpoint) -> None:
    from transformers import AutoTokenizer

    @rs.function
    def chat(s: Any) -> None:
        s += rs.system("You are terse.")
        s += rs.user("Hi")
        s += rs.assistant(rs.gen("a", max_tokens=12, **GREEDY))

    full = chat.run(backend=endpoint)
    streamed = chat.run(backend=endpoint, stream=True)
    pieces = list(streamed.text_iter("a"))
    assert len(pieces) > 1 and "".join(pieces) == streamed["a"] == full["a"]
    tok = AutoTokenizer.from_pretrained(endpoint.model_info["tokenizer_path"])
    assert full.text() == tok.apply_chat_template(full.messages(), tokenize=False)


def test_stream_logprobs(endpoint: rs.RuntimeEndpoint) -> None:
    """SGLang's test_stream_logprobs program: a streamed gen with return_logprob ends with
    the whole output's logprobs (the server sends them per chunk; the endpoint joins them),
    the same as without streaming."""

    @rs.function
    def prog(s: Any) -> None:
        s += "Logprobs while streaming:" + rs.gen(
            "x", max_tokens=10, return_logprob=True, top_logprobs_num=3, **GREEDY
        )

    streamed = prog.run(backend=endpoint, stream=True)
    text = "".join(streamed.text_iter("x"))
    full = prog.run(backend=endpoint)
    meta, want = streamed.get_meta_info("x"), full.get_meta_info("x")
    assert text == full["x"] and meta["completion_tokens"] == 10
    assert meta["output_token_logprobs_length"] == len(meta["output_token_logprobs"]) == 10
    assert [e[1] for e in meta["output_token_logprobs"]] == [
        e[1] for e in want["output_token_logprobs"]
    ]
    assert len(meta["output_top_logprobs"]) == 10 and all(
        len(t) == 3 for t in meta["output_top_logprobs"]
    )


def test_select_against_server_equals_engine_scores(
    endpoint: rs.RuntimeEndpoint, tiny_model_dir: Any
) -> None:
    """The same select on the server and on an in-process Engine of the same checkpoint
    (both fp32) gives the same scores and decision."""
    from radixserve.frontend.engine_backend import EngineBackend

    @rs.function
    def prog(s: Any) -> None:
        s += "My favourite fruit is" + rs.select("f", [" apple", " banana split", " kiwi"])

    remote = prog.run(backend=endpoint)
    local_backend = EngineBackend(dtype="float32", max_total_tokens=1024, model=str(tiny_model_dir))
    try:
        local = prog.run(backend=local_backend)
    finally:
        local_backend.close()
    got = remote.get_meta_info("f")["normalized_prompt_logprobs"]
    want = local.get_meta_info("f")["normalized_prompt_logprobs"]
    assert got == pytest.approx(want, abs=1e-4)
    assert remote["f"] == local["f"]


def test_run_batch_on_server(endpoint: rs.RuntimeEndpoint) -> None:
    @rs.function
    def prog(s: Any, topic: str) -> None:
        s += rs.user(f"Write about {topic}.")
        s += rs.assistant(rs.gen("t", max_tokens=6, **GREEDY))

    topics = ["cats", "rivers", "snow", "trains"]
    alone = [prog.run(t, backend=endpoint)["t"] for t in topics]
    batched = prog.run_batch([(t,) for t in topics], backend=endpoint)
    assert [st["t"] for st in batched] == alone


def test_constrained_parameters_are_accepted_by_the_server(endpoint: rs.RuntimeEndpoint) -> None:
    # Constrained decoding is not enforced yet; the server must accept the parameters.
    @rs.function
    def prog(s: Any) -> None:
        s += "n=" + rs.gen("r", max_tokens=3, regex=r"[0-9]+", **GREEDY)
        s += " j=" + rs.gen("j", max_tokens=3, json_schema={"type": "integer"}, **GREEDY)

    state = prog.run(backend=endpoint)
    assert state.get_meta_info("r")["completion_tokens"] == 3
    assert state.get_meta_info("j")["completion_tokens"] == 3


def test_server_refusals_become_backend_errors(server: Any, endpoint: rs.RuntimeEndpoint) -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "x" + rs.gen("x")  # max_tokens from run()

    with pytest.raises(rs.BackendError, match=r"HTTP 400: .*top_p must be in \(0, 1\], got 0"):
        prog.run(backend=endpoint, top_p=0, max_new_tokens=2)
    with pytest.raises(rs.BackendError, match="HTTP 400: .*context length"):
        prog.run(backend=endpoint, max_new_tokens=100_000)
    with pytest.raises(rs.BackendError, match="HTTP 401"):
        rs.RuntimeEndpoint(server.url, api_key="wrong-key")
    with pytest.raises(rs.BackendError, match="ConnectError"):
        rs.RuntimeEndpoint("http://127.0.0.1:9")  # nothing listens on the discard port
