"""Prompt modules over the real server (tiny random Llama, fp32, loopback HTTP): POST / GET /
DELETE /schemas, /generate with `pml` (module reuse and the exact fallback), 400s naming the
problem, concurrent requests sharing module K/V, KV accounting back to zero."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import launch_server

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
DOC = " ".join(f"fact {i} is that the number {i} is {i * 7 % 11}." for i in range(30))
SCHEMA = (
    '<schema name="srv"><module name="doc"><user>' + DOC + "</user></module>"
    '<module name="ask">Ask about <param name="topic" len="6"/>.</module>'
    '<union><module name="en">English.</module><module name="fr">French.</module></union>'
    "</schema>"
)
PROMPT = '<prompt schema="srv"><doc/><user>Which fact is about 3?</user><assistant/></prompt>'


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def gen(client: httpx.Client, **body) -> dict:
    r = client.post("/generate", json={"sampling_params": GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def held(client: httpx.Client) -> tuple[int, int]:
    s = client.get("/get_server_info").json()["scheduler"]
    return s["kv_held_tokens"], s["kv_module_tokens"]


def test_schema_lifecycle_and_generate(client: httpx.Client) -> None:
    r = client.post("/schemas", json={"pml": SCHEMA})
    assert r.status_code == 200, r.text
    (listed,) = [s for s in r.json()["schemas"] if s["name"] == "srv"]
    assert set(listed["modules"]) == {"", "doc", "ask", "en", "fr"}
    pinned = sum(listed["modules"].values())
    assert held(client) == (0, pinned)
    assert client.get("/schemas").json()["schemas"] == r.json()["schemas"]
    try:
        reused = gen(client, pml=PROMPT)
        full = gen(client, pml=PROMPT, module_reuse=False)
        # one module at position 0, then the text: the same K/V as a plain prefill
        assert reused["output_ids"] == full["output_ids"]
        assert reused["meta_info"]["cached_tokens"] == listed["modules"]["doc"]
        assert reused["meta_info"]["prompt_tokens"] == full["meta_info"]["prompt_tokens"]
        many = [
            '<prompt schema="srv"><ask topic="fact 3"/><doc/><fr/>Say it.</prompt>',
            '<prompt schema="srv"><doc/><en/>Say it.</prompt>',
        ]
        batch = gen(client, pml=many)
        assert len(batch) == 2 and all(b["meta_info"]["cached_tokens"] > 0 for b in batch)
        with ThreadPoolExecutor(4) as pool:  # concurrent requests share the module's slots
            outs = list(pool.map(lambda _: gen(client, pml=PROMPT)["output_ids"], range(4)))
        assert outs == [reused["output_ids"]] * 4
        assert held(client) == (0, pinned)
    finally:
        r = client.delete("/schemas/srv")
    assert r.status_code == 200, r.text
    assert all(s["name"] != "srv" for s in r.json()["schemas"])
    assert held(client) == (0, 0)


@pytest.mark.parametrize(
    ("method", "path", "body", "message"),
    [
        ("POST", "/schemas", {"pml": "<schema name='x'><module name='a'>"}, "malformed markup"),
        ("POST", "/schemas", {"pml": "<schema name='x'><bad/></schema>"}, "unknown tag <bad>"),
        ("POST", "/schemas", {}, "pml: a <schema> document is required"),
        ("POST", "/schemas", {"pml": "<schema name='x'/>", "extra": 1}, "extra"),
        ("DELETE", "/schemas/none", None, "no schema 'none' is registered"),
        ("POST", "/generate", {"pml": '<prompt schema="none">x</prompt>'}, "no schema 'none'"),
        ("POST", "/generate", {"pml": "x", "text": "y"}, "exactly one of text, input_ids or pml"),
        ("POST", "/generate", {"pml": 3}, "pml must be a list of strings"),
        ("POST", "/generate", {"pml": "<prompt schema='x'>", "module_reuse": 1}, "module_reuse"),
    ],
)
def test_bad_input_is_400(client: httpx.Client, method: str, path: str, body, message: str) -> None:
    r = client.request(method, path, json=body)
    assert r.status_code == 400, r.text
    assert message in r.text
    assert held(client) == (0, 0)


def test_bad_prompts_against_a_schema_are_400(client: httpx.Client) -> None:
    assert client.post("/schemas", json={"pml": SCHEMA}).status_code == 200
    try:
        r = client.post("/schemas", json={"pml": SCHEMA})
        assert r.status_code == 400 and "already registered" in r.text
        bad = {
            '<prompt schema="srv"><en/><fr/>x</prompt>': "members of one union",
            '<prompt schema="srv"><ask topic="a b c d e f g h"/>x</prompt>': "its param holds 6",
            '<prompt schema="srv"><zz/>x</prompt>': "has no module 'zz'",
            '<prompt schema="srv"><doc/></prompt>': "no text or arguments of its own",
        }
        for prompt, message in bad.items():
            r = client.post("/generate", json={"pml": prompt})
            assert r.status_code == 400 and message in r.text, (prompt, r.text)
    finally:
        assert client.delete("/schemas/srv").status_code == 200
    assert held(client) == (0, 0)


def test_dsl_program_over_http(server, client: httpx.Client) -> None:
    import radixserve as rs

    backend = rs.RuntimeEndpoint(server.url, api_key=server.api_key)
    schema = rs.schema("dslsrv", rs.module("doc", rs.role("user", DOC)), rs.module("x", "X"))
    assert rs.register_schema(schema, backend=backend) == ["doc", "x"]
    try:

        @rs.function
        def ask(s) -> None:
            s += rs.imports("dslsrv", "doc")
            s += rs.user("Which fact is about 3?") + rs.assistant_begin()
            s += rs.gen("answer", max_tokens=6, temperature=0, ignore_eos=True)

        state = ask.run(backend=backend)
        prompt = (
            '<prompt schema="dslsrv"><doc/><user>Which fact is about 3?</user><assistant/></prompt>'
        )
        assert state["answer"] == gen(client, pml=prompt)["text"]
    finally:
        assert client.delete("/schemas/dslsrv").status_code == 200
    assert held(client) == (0, 0)


def test_openai_chat_with_pml(client: httpx.Client) -> None:
    """/v1/chat/completions takes `pml` instead of `messages`: the same tokens as /generate."""
    assert client.post("/schemas", json={"pml": SCHEMA}).status_code == 200
    try:
        body = {"pml": PROMPT, "temperature": 0, "max_tokens": 6}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        want = gen(client, pml=PROMPT)
        assert r.json()["choices"][0]["message"]["content"] == want["text"]
        assert r.json()["usage"]["prompt_tokens"] == want["meta_info"]["prompt_tokens"]
        full = client.post("/v1/chat/completions", json={**body, "module_reuse": False})
        assert full.status_code == 200 and full.json()["choices"][0]["message"]["content"]
        bad = {
            "both": ({**body, "messages": [{"role": "user", "content": "x"}]}, "either messages"),
            "tools": ({**body, "tools": []}, "either messages (and tools) or pml"),
            "neither": ({"max_tokens": 2}, "messages must be a non-empty list (or give pml"),
            "unknown": ({"pml": '<prompt schema="zz">x</prompt>'}, "no schema 'zz'"),
            "stream": ({"pml": "0", "stream": True}, "PML: malformed markup"),
            "module_reuse": ({**body, "module_reuse": "no"}, "module_reuse must be"),
        }
        for name, (b, message) in bad.items():
            r = client.post("/v1/chat/completions", json=b)
            assert r.status_code == 400 and message in r.text, (name, r.text)
    finally:
        assert client.delete("/schemas/srv").status_code == 200
    assert held(client) == (0, 0)


BIG_DOC = " ".join(f"item {i} weighs {i * 13 % 17} grams." for i in range(90))
BIG_SCHEMA = '<schema name="big"><module name="doc">' + BIG_DOC + "</module></schema>"


@pytest.fixture(scope="module")
def slow_encoding(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server encoding 16 tokens a step (and admitting up to 48 beside them): BIG_SCHEMA
    (~800 tokens) takes ~50 steps."""
    h = launch_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("slow-encoding"),
        "--max-total-tokens", "4096", "--chunked-prefill-size", "16", "--max-prefill-tokens", "64",
    )  # fmt: skip
    with h.client() as c:
        yield c
    assert h.stop() == 0, h.log_text()[-4000:]


def wait_encoding(client: httpx.Client, name: str) -> None:
    """Poll GET /schemas until `name` is listed as being encoded."""
    for _ in range(2000):
        listed = {s["name"]: s["status"] for s in client.get("/schemas").json()["schemas"]}
        if listed.get(name) == "encoding":
            return
    raise AssertionError(f"{name} never listed as encoding")


def test_generate_goes_on_while_a_schema_encodes(slow_encoding: httpx.Client) -> None:
    """A request sent while a schema encodes is admitted, decodes and finishes before the
    registration returns (the encoding takes one chunk a step); meanwhile a prompt
    importing the schema is refused as still being encoded."""
    client, order = slow_encoding, []
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        schema = {"pml": BIG_SCHEMA}
        register = pool.submit(
            lambda: order.append(("register", client.post("/schemas", json=schema)))
        )
        wait_encoding(client, "big")
        r = client.post("/generate", json={"pml": '<prompt schema="big"><doc/>x</prompt>'})
        assert r.status_code == 400 and "'big' is still being encoded" in r.text, r.text
        order.append(
            (
                "generate",
                client.post("/generate", json={"text": "1 2 3", "sampling_params": params}),
            )
        )
        register.result()
    assert [what for what, _ in order] == ["generate", "register"]
    (_, generated), (_, registered) = order
    assert generated.status_code == 200 and generated.json()["meta_info"]["completion_tokens"] == 16
    assert registered.status_code == 200, registered.text
    assert [s["status"] for s in registered.json()["schemas"]] == ["ready"]
    assert (
        gen(client, pml='<prompt schema="big"><doc/>x</prompt>')["meta_info"]["cached_tokens"] > 600
    )
    assert client.delete("/schemas/big").status_code == 200
    assert held(client) == (0, 0)


def test_delete_while_encoding(slow_encoding: httpx.Client) -> None:
    client = slow_encoding
    with ThreadPoolExecutor(1) as pool:
        register = pool.submit(client.post, "/schemas", json={"pml": BIG_SCHEMA})
        wait_encoding(client, "big")
        assert client.delete("/schemas/big").status_code == 200
        r = register.result()
    assert r.status_code == 400 and "deleted while it was being encoded" in r.text, r.text
    r = client.post("/generate", json={"pml": '<prompt schema="big"><doc/>x</prompt>'})
    assert r.status_code == 400 and "no schema 'big' is registered" in r.text, r.text
    assert held(client) == (0, 0)
