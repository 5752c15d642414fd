"""Tenants on a live server (tiny random Llama, loopback HTTP): a keys file of two tenants
(alice with two keys, bob with one) beside an admin key, served with `--cache-isolation
tenant` and, for comparison, `none`.

Under `tenant` no tenant's requests reuse, or learn of, another's cached prompt: cached_tokens
(native and OpenAI), the prompt-extraction probe (a prefix plus a candidate next token),
`cache_salt` within a tenant; request ids, aborts, /cache_tree and /metrics are the tenant's
own; prompt modules (registered by the admin) tell one tenant nothing of another. Under
`none` the same probe works, which is what `tenant` prevents."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import (
    ServerHandle,
    abort_mid_stream,
    bearer,
    free_port,
    launch_server,
    wait_healthy,
)

pytestmark = pytest.mark.slow  # two live servers and a router: ~30 s (the engine-level
# properties are in tests/test_cache_salt.py, in the fast tier)

ALICE = "alice-key-0123456789"
ALICE_2 = "alice-second-key-0123"
BOB = "bob-key-0123456789abc"
ADMIN = "admin-key-for-the-operator"
KEYS = f"# tenants of the test servers\n{ALICE} alice\n{ALICE_2} alice\n\n{BOB} bob\n"
ONE = {"max_new_tokens": 1, "temperature": 0}


def serve(tmp: Path, tiny_model_dir: Path, isolation: str) -> ServerHandle:
    keys = tmp / "keys"
    keys.write_text(KEYS)
    keys.chmod(0o600)
    args = ("--max-total-tokens", "4096", "--admin-api-key", ADMIN)
    handle = launch_server(
        tiny_model_dir, tmp, *args, "--api-keys-file", str(keys), "--cache-isolation", isolation
    )
    handle.api_key = ADMIN
    return handle


@pytest.fixture(scope="module")
def isolated(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    handle = serve(tmp_path_factory.mktemp("isolated"), tiny_model_dir, "tenant")
    yield handle
    assert handle.stop() == 0, handle.log_text()[-3000:]


@pytest.fixture(scope="module")
def shared(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    handle = serve(tmp_path_factory.mktemp("shared"), tiny_model_dir, "none")
    yield handle
    assert handle.stop() == 0, handle.log_text()[-3000:]


def fresh_ids(n: int) -> list[int]:
    """Token ids no other test sends (a prompt nobody cached yet)."""
    start = 1000 + uuid.uuid4().int % 40000
    return list(range(start, start + n))


def cached(server: ServerHandle, key: str, ids: list[int], **body: Any) -> int:
    """Prompt tokens /generate found cached for `ids` sent with `key`."""
    r = httpx.post(
        server.url + "/generate",
        json={"input_ids": ids, "sampling_params": ONE, **body},
        headers=bearer(key),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["meta_info"]["cached_tokens"])


def openai_cached(server: ServerHandle, key: str, text: str) -> int:
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "m", "prompt": text, "max_tokens": 1, "temperature": 0},
        headers=bearer(key),
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


# ---------------------------------------------------------------- cached_tokens


def test_a_tenant_never_hits_another_tenants_prompt(isolated: ServerHandle) -> None:
    ids = fresh_ids(60)
    assert cached(isolated, ALICE, ids) == 0
    assert cached(isolated, BOB, ids) == 0  # alice's prompt is cached, not for bob
    assert cached(isolated, ALICE_2, ids) == len(ids) - 1  # alice's other key: her tenant
    assert cached(isolated, BOB, ids) == len(ids) - 1  # bob's own copy now
    assert cached(isolated, ADMIN, ids) == 0  # the admin key's requests are a tenant too


def test_openai_usage_reports_cached_tokens_within_the_tenant(isolated: ServerHandle) -> None:
    text = f"Tenant note {uuid.uuid4().hex}: " + "the quick brown fox jumps over the dog. " * 8
    assert openai_cached(isolated, ALICE, text) == 0
    assert openai_cached(isolated, BOB, text) == 0
    assert openai_cached(isolated, ALICE, text) > 40


def extraction_probe(server: ServerHandle, secret: int, candidates: list[int]) -> list[int]:
    """Alice caches a prompt holding `secret` after a known prefix; bob sends the prefix, a
    candidate, and one more token (so the candidate is within what may come from the cache),
    and reads cached_tokens for each candidate."""
    prefix = fresh_ids(40)
    assert cached(server, ALICE, [*prefix, secret, 7, 8, 9]) == 0
    return [cached(server, BOB, [*prefix, c, 5]) for c in candidates]


def test_the_prompt_extraction_probe_works_only_without_isolation(
    isolated: ServerHandle, shared: ServerHandle
) -> None:
    candidates = [311, 4242, 777]  # 4242 is alice's
    assert extraction_probe(shared, 4242, candidates) == [40, 41, 40]  # the secret shows
    # bob's first probe put the prefix in his own part; the secret does not stand out
    assert extraction_probe(isolated, 4242, candidates) == [0, 40, 40]


def test_cache_salt_separates_requests_of_one_tenant(isolated: ServerHandle) -> None:
    ids = fresh_ids(50)
    assert cached(isolated, ALICE, ids, cache_salt="user-1") == 0
    assert cached(isolated, ALICE, ids, cache_salt="user-2") == 0
    assert cached(isolated, ALICE, ids) == 0  # her unsalted part is another still
    assert cached(isolated, ALICE_2, ids, cache_salt="user-1") == len(ids) - 1
    assert cached(isolated, BOB, ids, cache_salt="user-1") == 0  # the salt is alice's


def test_without_isolation_tenants_share_and_cache_salt_still_separates(
    shared: ServerHandle,
) -> None:
    ids = fresh_ids(50)
    assert cached(shared, ALICE, ids) == 0
    assert cached(shared, BOB, ids) == len(ids) - 1
    assert cached(shared, BOB, ids, cache_salt="s") == 0
    assert cached(shared, ALICE, ids, cache_salt="s") == len(ids) - 1  # the same salt


@pytest.mark.parametrize("value", [5, "", "x" * 257, ["a"], True, {"a": 1}])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_a_bad_cache_salt_is_a_400_naming_the_field(
    isolated: ServerHandle, path: str, value: Any
) -> None:
    body: dict[str, Any] = {
        "/generate": {"text": "hi"},
        "/v1/completions": {"model": "m", "prompt": "hi"},
        "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    }[path]
    r = httpx.post(
        isolated.url + path, json={**body, "cache_salt": value}, headers=bearer(ALICE), timeout=60
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "cache_salt" and "cache_salt must be" in error["message"]


# ---------------------------------------------------------------- aborts


def finish_when_aborted(
    server: ServerHandle, owner: str, aborter: str
) -> tuple[int, dict[str, Any], str]:
    """Stream a long request with key `owner`; after its first chunk, key `aborter` aborts
    its rid: (the abort's status, its body, how the request finished)."""
    abort, finish = abort_mid_stream(server, owner, aborter, f"run-{uuid.uuid4().hex}")
    return abort.status_code, abort.json(), finish


def abort_answer(server: ServerHandle, key: str, rid: str) -> tuple[int, Any]:
    r = httpx.post(
        server.url + "/abort_request", json={"rid": rid}, headers=bearer(key), timeout=60
    )
    return r.status_code, r.json()


def test_a_tenant_aborts_its_own_requests_only(isolated: ServerHandle) -> None:
    unknown = abort_answer(isolated, BOB, f"nobody-{uuid.uuid4().hex}")
    assert unknown == (200, {"success": True})
    # alice's rid in flight is, to bob, a rid nobody sent
    assert finish_when_aborted(isolated, ALICE, BOB) == (*unknown, "length")
    assert finish_when_aborted(isolated, ALICE, ALICE_2) == (*unknown, "abort")  # her other key
    assert finish_when_aborted(isolated, BOB, ADMIN) == (*unknown, "abort")
    r = httpx.post(
        isolated.url + "/abort_request", json={"abort_all": True}, headers=bearer(BOB), timeout=60
    )
    assert r.status_code == 403 and "admin API key" in r.json()["error"]["message"]


# ---------------------------------------------------------------- request ids


def in_use(server: ServerHandle, key: str, rid: str) -> bool:
    """Whether the tenant of `key` has `rid` in flight, asked while it has (else this
    request would take the rid): the api server refuses a rid in flight at once, without
    the scheduler."""
    r = httpx.post(
        server.url + "/generate", json={"text": "probe", "rid": rid}, headers=bearer(key),
        timeout=60,
    )  # fmt: skip
    return r.status_code == 400 and "already in use" in r.text


class Held:
    """`/generate` of `ids` under `rid` with `key`, sent twice at once from two threads: the
    api server takes one and refuses the other at once ("already in use"), whichever comes
    first. While the scheduler is stopped the one taken stays in flight: `wait_in_flight`
    returns when the other is refused, `response()` gives the answer to the one taken."""

    def __init__(self, server: ServerHandle, key: str, rid: str, ids: list[int], out: int):
        body = {"input_ids": ids, "rid": rid,
                "sampling_params": {"max_new_tokens": out, "ignore_eos": True}}  # fmt: skip
        self.pool = futures.ThreadPoolExecutor(2)
        self.futures = [
            self.pool.submit(
                httpx.post, server.url + "/generate", json=body, headers=bearer(key), timeout=120
            )
            for _ in range(2)
        ]
        self.taken: futures.Future[httpx.Response] | None = None

    def wait_in_flight(self) -> None:
        done, _ = futures.wait(self.futures, 60, futures.FIRST_COMPLETED)
        assert len(done) == 1, [f.result().text for f in done]
        refused = done.pop()
        assert "already in use" in refused.result().text, refused.result().text
        self.taken = next(f for f in self.futures if f is not refused)

    def response(self) -> dict[str, Any]:
        assert self.taken is not None, "wait_in_flight first"
        r = self.taken.result()
        self.pool.shutdown()
        assert r.status_code == 200, r.text
        return dict(r.json())


def test_two_tenants_use_one_rid_at_once(isolated: ServerHandle) -> None:
    rid = f"shared-{uuid.uuid4().hex}"
    with isolated.scheduler_stopped():
        alice = Held(isolated, ALICE, rid, fresh_ids(5), 3)
        alice.wait_in_flight()
        bob = Held(isolated, BOB, rid, fresh_ids(7), 4)
        bob.wait_in_flight()  # both in flight under one rid
        assert in_use(isolated, ALICE_2, rid)  # still one rid per tenant
    a, b = alice.response(), bob.response()
    assert a["meta_info"]["id"] == b["meta_info"]["id"] == rid
    assert (a["meta_info"]["prompt_tokens"], len(a["output_ids"])) == (5, 3)
    assert (b["meta_info"]["prompt_tokens"], len(b["output_ids"])) == (7, 4)


def test_an_abort_of_another_tenants_rid_is_an_unknown_rid(isolated: ServerHandle) -> None:
    rid = f"hers-{uuid.uuid4().hex}"
    unknown = abort_answer(isolated, BOB, f"nobody-{uuid.uuid4().hex}")
    with isolated.scheduler_stopped():
        alice = Held(isolated, ALICE, rid, fresh_ids(5), 3)
        alice.wait_in_flight()
        assert abort_answer(isolated, BOB, rid) == unknown
    assert alice.response()["meta_info"]["finish_reason"]["type"] == "length"
    assert not isolated.abort_sent(rid)


def test_the_admin_key_aborts_a_rid_under_every_tenant(isolated: ServerHandle) -> None:
    rid = f"both-{uuid.uuid4().hex}"
    with isolated.scheduler_stopped():
        held = [Held(isolated, key, rid, fresh_ids(5), 1000) for key in (ALICE, BOB)]
        for h in held:
            h.wait_in_flight()
        assert abort_answer(isolated, ADMIN, rid) == (200, {"success": True})
        isolated.wait_aborts_sent([rid])
    log = isolated.log_text()
    assert f"aborting rid {rid!r} of tenant 'alice'" in log
    assert f"aborting rid {rid!r} of tenant 'bob'" in log
    assert [h.response()["meta_info"]["finish_reason"]["type"] for h in held] == ["abort", "abort"]


# ---------------------------------------------------------------- what a tenant sees


def tree(server: ServerHandle, key: str) -> dict[str, Any]:
    r = httpx.get(
        server.url + "/cache_tree", params={"max_depth": 64}, headers=bearer(key), timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_the_cache_tree_shows_a_tenant_its_own_parts(
    isolated: ServerHandle, shared: ServerHandle
) -> None:
    mark = uuid.uuid4().hex[:8]
    for key, who in ((ALICE, "alice"), (BOB, "bob")):
        text = f"{who} {mark} writes a note about the weather in the mountains today."
        r = httpx.post(
            isolated.url + "/generate",
            json={"text": text, "sampling_params": ONE, "cache_salt": "notes"},
            headers=bearer(key),
            timeout=120,
        )
        assert r.status_code == 200, r.text
    alice, bob, admin = tree(isolated, ALICE), tree(isolated, BOB), tree(isolated, ADMIN)
    for view, own, other in ((alice, "alice", "bob"), (bob, "bob", "alice")):
        assert view["tenant"] == own and not view["content_hidden"]
        parts = {n["salt"]["tenant"] for n in view["nodes"] if n["salt"]}
        assert parts == {own}
        text = "".join(n["text"] for n in view["nodes"])
        assert f"{own} {mark}" in text and f"{other} {mark}" not in text
        assert view["stats"]["prompt_tokens_total"] == 0  # no aggregate
        assert view["total_nodes"] == len(view["nodes"])
    text = "".join(n["text"] for n in admin["nodes"])
    assert f"alice {mark}" in text and f"bob {mark}" in text
    assert {n["salt"]["tenant"] for n in admin["nodes"] if n["salt"]} >= {"alice", "bob"}
    assert admin["tenant"] is None and admin["stats"]["prompt_tokens_total"] > 0
    # without isolation nothing in the tree is a tenant's own: it sees none of it
    cached(shared, ALICE, fresh_ids(30))
    view = tree(shared, BOB)
    assert [n["id"] for n in view["nodes"]] == [tree(shared, ADMIN)["nodes"][0]["id"]]


def test_metrics_show_a_tenant_its_own_series_and_the_admin_all(isolated: ServerHandle) -> None:
    cached(isolated, BOB, fresh_ids(20))
    bob = httpx.get(isolated.url + "/metrics", headers=bearer(BOB), timeout=60)
    admin = httpx.get(isolated.url + "/metrics", headers=bearer(ADMIN), timeout=60)
    assert bob.status_code == admin.status_code == 200
    assert 'radixserve_tenant_requests_total{tenant="bob"}' in bob.text
    assert 'tenant="alice"' not in bob.text
    assert "radixserve_num_running_reqs" not in bob.text  # every tenant's: admin only
    assert "radixserve_cache_hit_rate" not in bob.text
    assert 'radixserve_tenant_requests_total{tenant="alice"}' in admin.text
    assert "radixserve_num_running_reqs" in admin.text
    history = httpx.get(isolated.url + "/metrics_history", headers=bearer(BOB), timeout=60)
    points = history.json()["points"]
    assert points and all(p["tokens_per_s"] == 0 and p["cache_hit_rate"] is None for p in points)


# ---------------------------------------------------------------- prompt modules

DOC = " ".join(f"fact {i} is that the number {i} is {i * 7 % 11}." for i in range(20))
SCHEMA = f'<schema name="tenants"><module name="doc"><user>{DOC}</user></module></schema>'
PROMPT = '<prompt schema="tenants"><doc/><user>Which fact is about 3?</user><assistant/></prompt>'


def test_prompt_modules_tell_a_tenant_nothing_of_another(isolated: ServerHandle) -> None:
    """A registered schema is the operator's text, encoded once: every import of it reuses
    it whoever imported it before, so what an import reports does not depend on other
    tenants; its expanded text (module_reuse false) is cached per tenant like any prompt."""
    with httpx.Client(base_url=isolated.url, timeout=120) as c:
        r = c.post("/schemas", json={"pml": SCHEMA}, headers=bearer(ADMIN))
        assert r.status_code == 200, r.text
        (schema,) = [s for s in r.json()["schemas"] if s["name"] == "tenants"]
        module = schema["modules"]["doc"]
        try:

            def imported(key: str, reuse: bool) -> int:
                body = {"pml": PROMPT, "sampling_params": ONE, "module_reuse": reuse}
                r = c.post("/generate", json=body, headers=bearer(key))
                assert r.status_code == 200, r.text
                return int(r.json()["meta_info"]["cached_tokens"])

            assert [imported(BOB, True) for _ in range(2)] == [module, module]
            assert imported(ALICE, True) == module
            assert imported(ALICE, False) == 0
            assert imported(BOB, False) == 0  # alice's expanded prompt is hers
            assert imported(BOB, False) > module
        finally:
            assert c.delete("/schemas/tenants", headers=bearer(ADMIN)).status_code == 200


# ---------------------------------------------------------------- through the router


def test_the_router_takes_the_tenants_keys_and_the_worker_keeps_them_apart(
    isolated: ServerHandle, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve", "router", "--port", str(port),
           "--worker-urls", isolated.url, "--admin-api-key", ADMIN, "--api-keys-file",
           str(keys), "--cache-isolation", "tenant", "--health-interval-s", "0.5"]  # fmt: skip
    log = tmp_path / "router.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    router = ServerHandle(f"http://127.0.0.1:{port}", proc, log, ADMIN)
    try:
        wait_healthy(router, timeout=60)
        ids = fresh_ids(40)
        assert cached(router, ALICE, ids) == 0
        assert cached(router, BOB, ids) == 0
        assert cached(router, ALICE_2, ids) == len(ids) - 1
        r = httpx.post(router.url + "/generate", json={"text": "hi"}, headers=bearer("x" * 20))
        assert r.status_code == 401
    finally:
        assert router.stop() == 0, router.log_text()[-3000:]
