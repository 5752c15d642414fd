"""Key scopes and cross-site protections on a live server and router (radixserve/server/guard.py):
an inference key never reaches other tenants' data or server state, the admin key does; a
web page in the operator's browser cannot change state (text/plain posts, GET state
changes, other origins, other Host names)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
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
    poll_until,
)

from radixserve.cli import build_parser, config_from_args
from radixserve.config import EngineConfig
from radixserve.keys import ADMIN_API_KEY_ENV, API_KEY_ENV
from radixserve.router.config import RouterConfig

INFERENCE = "inference-key-for-tenants"
ADMIN = "admin-key-for-the-operator"
BODY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    """Keys from the environment, as a deployment passes them."""
    logs = tmp_path_factory.mktemp("security")
    env = {API_KEY_ENV: INFERENCE, ADMIN_API_KEY_ENV: ADMIN}
    handle = launch_server(tiny_model_dir, logs, "--max-total-tokens", "2048", env=env)
    handle.api_key = ADMIN
    yield handle
    assert handle.stop() == 0, handle.log_text()[-3000:]


def test_keys_from_the_environment_never_reach_the_command_line(server: ServerHandle) -> None:
    cmdline = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().decode()
    assert INFERENCE not in cmdline and ADMIN not in cmdline
    with httpx.Client(base_url=server.url) as c:
        assert c.post("/generate", json=BODY).status_code == 401
        assert c.get("/health").status_code == 200
        info = c.get("/get_server_info", headers=bearer(ADMIN)).json()
    assert INFERENCE not in str(info) and ADMIN not in str(info)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/flush_cache", {}),
        ("GET", "/get_server_info", None),
        ("GET", "/cache_digest", None),
        ("POST", "/abort_request", {"abort_all": True}),
        ("POST", "/schemas", {"name": "s", "pml": "<module name='m'>hi</module>"}),
        ("DELETE", "/schemas/anything", None),
    ],
)
def test_admin_routes_refuse_the_inference_key(
    server: ServerHandle, method: str, path: str, body: dict | None
) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.request(method, path, json=body, headers=bearer(INFERENCE))
        assert r.status_code == 403, r.text
        assert "admin API key" in r.json()["error"]["message"]
        admin = c.request(method, path, json=body, headers=bearer(ADMIN))
        assert admin.status_code not in (401, 403), admin.text


def test_cache_digest_names_a_bad_field(server: ServerHandle) -> None:
    with httpx.Client(base_url=server.url, timeout=60, headers=bearer(ADMIN)) as c:
        for params, field in [
            ({"block": "0"}, "block"),
            ({"block": "2000"}, "block"),
            ({"block": "sixteen"}, "block"),
            ({"max_blocks": "0"}, "max_blocks"),
            ({"max_blocks": "x"}, "max_blocks"),
            ({"block": "4", "max_blocks": str(1 << 20)}, "max_blocks"),
        ]:
            r = c.get("/cache_digest", params=params)
            assert r.status_code == 400, (params, r.text)
            assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
        text = "one two three four five six seven eight nine ten"
        body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
        assert c.post("/generate", json=body).status_code == 200
        r = c.get("/cache_digest", params={"block": "2", "max_blocks": "3"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    assert len(r.content) == 3 * 8  # the prompt's first 3 blocks of 2 ids, 8 bytes each
    assert int(r.headers["x-radixserve-cached-tokens"]) >= 6


def test_inference_key_serves_and_sees_the_tree_without_content(server: ServerHandle) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post("/generate", json=BODY, headers=bearer(INFERENCE))
        assert r.status_code == 200, r.text
        assert (
            c.post("/abort_request", json={"rid": "x"}, headers=bearer(INFERENCE)).status_code
            == 200
        )
        tenant = c.get("/cache_tree", headers=bearer(INFERENCE)).json()
        admin = c.get("/cache_tree", headers=bearer(ADMIN)).json()
    assert tenant["content_hidden"] and not admin["content_hidden"]
    assert len(tenant["nodes"]) == len(admin["nodes"]) > 1
    assert all(n["text"] == "" and n["preview_ids"] == [] for n in tenant["nodes"])
    assert any("France" in n["text"] for n in admin["nodes"])


def test_a_web_page_cannot_change_state(server: ServerHandle) -> None:
    with httpx.Client(base_url=server.url, headers=bearer(ADMIN), timeout=60) as c:
        form = c.post(
            "/generate", content=b'{"text": "hi"}', headers={"Content-Type": "text/plain"}
        )
        assert form.status_code == 415 and form.json()["error"]["param"] == "Content-Type"
        assert c.get("/flush_cache").status_code == 405
        other = c.post("/flush_cache", json={}, headers={"Origin": "http://evil.example"})
        assert other.status_code == 403 and other.json()["error"]["param"] == "Origin"
        same = c.post("/flush_cache", json={}, headers={"Origin": server.url})
        assert same.status_code == 200, same.text
        rebound = c.get("/get_server_info", headers={"Host": f"evil.example:{server.url[-5:]}"})
        assert rebound.status_code == 400 and rebound.json()["error"]["param"] == "Host"
        assert c.get("/get_server_info", headers={"Host": "localhost"}).status_code == 200


def test_router_refuses_a_public_address_without_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_API_KEY_ENV, raising=False)
    with pytest.raises(ValueError, match="bind to 127.0.0.1"):
        RouterConfig(host="0.0.0.0")
    assert RouterConfig(host="0.0.0.0", admin_api_key=ADMIN).host == "0.0.0.0"
    monkeypatch.setenv(API_KEY_ENV, INFERENCE)
    assert RouterConfig(host="0.0.0.0").inference_key() == INFERENCE


def test_a_server_refuses_a_public_address_without_a_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the router: refused at start (a usage error) unless a key is set or the operator
    says --allow-unauthenticated; `serve --dp-size` passes that to its router."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_API_KEY_ENV, raising=False)
    with pytest.raises(ValueError, match="on 0.0.0.0 with no API key, anyone could run"):
        EngineConfig(host="0.0.0.0")
    parser = build_parser()
    with pytest.raises(SystemExit):
        config_from_args(parser.parse_args(["serve", "--host", "0.0.0.0"]), parser)
    assert "--allow-unauthenticated" in capsys.readouterr().err
    open_args = parser.parse_args(["serve", "--host", "0.0.0.0", "--allow-unauthenticated"])
    assert config_from_args(open_args, parser).allow_unauthenticated
    assert RouterConfig(host="0.0.0.0", allow_unauthenticated=True).host == "0.0.0.0"
    assert EngineConfig(host="0.0.0.0", api_key=INFERENCE).host == "0.0.0.0"
    monkeypatch.setenv(ADMIN_API_KEY_ENV, ADMIN)
    assert EngineConfig(host="0.0.0.0").admin_key() == ADMIN


@pytest.mark.parametrize("env", [API_KEY_ENV, ADMIN_API_KEY_ENV])
def test_a_key_set_but_empty_is_an_error(monkeypatch: pytest.MonkeyPatch, env: str) -> None:
    """Not "no key": an empty variable is a template left unfilled."""
    monkeypatch.setenv(env, "")
    for config in (EngineConfig, RouterConfig):
        with pytest.raises(ValueError, match=f"{env} is set but empty"):
            config()
    monkeypatch.delenv(env)
    with pytest.raises(ValueError, match=f"the flag for {API_KEY_ENV} is set but empty"):
        EngineConfig(api_key=" ")


def wait_answering(h: ServerHandle, timeout: float = 60) -> None:
    """Until the process answers HTTP at all (a router with no workers is unhealthy: 503)."""

    def answering() -> bool:
        assert h.proc.poll() is None, h.log_text()[-3000:]
        try:
            httpx.get(h.url + "/health", timeout=2)
            return True
        except httpx.TransportError:
            return False

    poll_until(answering, timeout, lambda: f"an HTTP answer:\n{h.log_text()[-3000:]}")


def test_router_workers_need_the_admin_key(tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve", "router", "--port", str(port),
           "--health-interval-s", "0.5"]  # fmt: skip
    env = {**os.environ, API_KEY_ENV: INFERENCE, ADMIN_API_KEY_ENV: ADMIN}
    log = tmp_path / "router.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    handle = ServerHandle(f"http://127.0.0.1:{port}", proc, log, ADMIN)
    try:
        wait_answering(handle)
        with httpx.Client(base_url=handle.url, timeout=30) as c:
            add = {"url": "http://127.0.0.1:9"}
            assert c.post("/workers", json=add, headers=bearer(INFERENCE)).status_code == 403
            assert c.get("/workers", headers=bearer(INFERENCE)).status_code == 403
            assert c.post("/workers", json=add, headers=bearer(ADMIN)).status_code == 200
            assert (
                c.get("/workers", headers=bearer(ADMIN)).json()["workers"][0]["url"] == add["url"]
            )
            text = c.post("/workers", content=b'{"url": "http://x:1"}',
                          headers={**bearer(ADMIN), "Content-Type": "text/plain"})  # fmt: skip
            assert text.status_code == 415
    finally:
        assert handle.stop() == 0, handle.log_text()[-3000:]


def finish_of_aborted(server: ServerHandle, owner: str, aborter: str, rid: str) -> str:
    """Stream a long request with key `owner`, ask key `aborter` to abort its rid after the
    first chunk, and return how it finished. Whether it stops or not, the abort answers as
    for a rid nobody has in flight (a tenant learns nothing of another's rids)."""
    abort, finish = abort_mid_stream(server, owner, aborter, rid)
    unknown = httpx.post(
        server.url + "/abort_request", json={"rid": "nobody-runs-this"}, headers=bearer(aborter)
    )
    assert (abort.status_code, abort.json()) == (200, unknown.json()), abort.text
    return finish


def test_a_tenant_aborts_only_its_own_requests(server: ServerHandle) -> None:
    assert finish_of_aborted(server, ADMIN, INFERENCE, "admin-run") == "length"
    assert finish_of_aborted(server, INFERENCE, INFERENCE, "own-run") == "abort"
    assert finish_of_aborted(server, INFERENCE, ADMIN, "any-run") == "abort"


# ---------------------------------------------------------------- the route table


def documented_routes() -> dict[tuple[str, str, str], str]:
    """{(app, method, route): scope} of the table under "Routes and their scopes" in
    docs/security.md."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    section = text.split("\n## Routes and their scopes\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] in ("server", "router"):
            for method in cells[1].split(", "):
                rows[(cells[0], method, cells[2])] = cells[3]
    return rows


def served_routes(routes: Any) -> Iterator[tuple[str, str]]:
    """(method, path) of every route of an app, those of included routers too (HEAD, which
    Starlette adds to GET, left out)."""
    for r in routes:
        inner = getattr(r, "original_router", None)  # an included router (FastAPI >= 0.12x)
        if inner is not None:
            yield from served_routes(inner.routes)
            continue
        for method in sorted(r.methods - {"HEAD"}):
            yield method, r.path


def scope_seen(client: Any, method: str, path: str) -> str:
    """What the app makes of the route: "none" if it answers without a key, "admin" if it
    refuses the inference key as an admin route, else "inference"."""
    path = path.replace("{name}", "a-name")
    body = b"{}" if method in ("POST", "DELETE") else None
    json_type = {"Content-Type": "application/json"}
    if client.request(method, path, content=body, headers=json_type).status_code != 401:
        return "none"
    r = client.request(method, path, content=body, headers={**json_type, **bearer(INFERENCE)})
    return "admin" if r.status_code == 403 and "needs the admin API key" in r.text else "inference"


def test_security_md_lists_every_route_with_its_scope() -> None:
    """The table in docs/security.md is every route of the server and the router, each with
    the scope the app enforces (asked of the apps themselves, without a model: the key
    checks answer before any handler)."""
    from fastapi.testclient import TestClient

    from radixserve.router.app import build_app as build_router
    from radixserve.server.app import build_app as build_server

    apps = {
        "server": build_server(None, EngineConfig(api_key=INFERENCE, admin_api_key=ADMIN), None),
        "router": build_router(
            RouterConfig(
                worker_urls=("http://127.0.0.1:9",), api_key=INFERENCE, admin_api_key=ADMIN
            )
        ),  # fmt: skip
    }
    seen = {}
    for name, app in apps.items():
        client = TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False)
        for method, path in served_routes(app.routes):
            seen[(name, method, path)] = scope_seen(client, method, path)
    assert documented_routes() == seen
