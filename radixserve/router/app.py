"""The router's FastAPI app: a worker's HTTP API in front of many workers.

Routed by prompt (the policy picks): POST /generate (single, batch: the batch goes whole to
the worker its first prompt picks; streamed or not), /v1/completions, /v1/chat/completions.
Sent to the least-loaded worker: /v1/models, /get_model_info, /health_generate.
Fanned out to every healthy worker: /flush_cache, /abort_request (the admin key gets every
worker's answer by URL, an inference key one worker's answer, as a worker gives it). The
router's own: /health (200 while a worker is healthy), /metrics, /get_server_info, and
GET / POST / DELETE /workers (list, add, remove: `{"url": "http://host:port"}`).

A request carrying an `X-Session-ID` header goes to the worker its session went to last
(while that worker is up). A request is routed by its prompt within its part of the
workers' caches: its `cache_salt`, and its tenant under `--cache-isolation tenant`, open its
routing key, so no tenant's prompts steer another's requests. `n > 1` and batches are one
request, so they stay on one worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.router import metrics
from radixserve.router.backend import BackendTransport
from radixserve.router.config import RouterConfig
from radixserve.router.policy import make_policy
from radixserve.router.pool import BackendPool
from radixserve.router.proxy import Forward, Proxy
from radixserve.router.tree import ids_key
from radixserve.server.guard import (
    ApiKeyMiddleware,
    CrossSiteGuard,
    allowed_hosts,
    require_admin,
    role,
    tenant,
)
from radixserve.server.protocol import MAX_BODY_BYTES, ApiError, api_error_handler, parse_body

logger = logging.getLogger("radixserve.router")

ROUTED = ("/generate", "/v1/completions", "/v1/chat/completions")
ANY_WORKER = ("/v1/models", "/get_model_info", "/health_generate")
SESSION_HEADER = "x-session-id"
# What an inference key does not reach here (radixserve/server/guard.py): the worker set
# and what names the workers (/metrics labels them by URL; the X-Radixserve-Worker header
# is left off for it), every worker's cache, their configs; abort_all is checked in the
# fan-out.
ADMIN_ROUTES = (
    ("*", "/workers"),
    ("*", "/flush_cache"),
    ("GET", "/get_server_info"),
    ("GET", "/metrics"),
)
MAX_KEY_CHARS = 1 << 16  # a prompt's routing key is cut here (the tree holds prefixes)


def routing_key(path: str, body: Any) -> str:
    """The text the policy matches: the (first) prompt, token ids spelled by `ids_key`, a
    chat's messages as JSON (shared leading messages give a shared prefix). '' if none."""
    if not isinstance(body, dict):
        return ""
    if path == "/v1/chat/completions":
        prompt: Any = json.dumps(body.get("messages"), ensure_ascii=False)
    elif path == "/v1/completions":
        prompt = body.get("prompt")
    else:
        prompt = body.get("text", body.get("input_ids"))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its first prompt
    if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
        prompt = ids_key(prompt)
    return prompt[:MAX_KEY_CHARS] if isinstance(prompt, str) else ""


def salted_key(request: Request, body: Any, key: str) -> str:
    """`key` behind the request's part of the workers' caches: its `cache_salt` and, under
    --cache-isolation tenant, its tenant (each as JSON, so no two parts spell the same)."""
    given = body.get("cache_salt") if isinstance(body, dict) else None
    isolated = request.app.state.config.cache_isolation == "tenant"
    part = [tenant(request) if isolated else "", given if isinstance(given, str) else ""]
    return key if part == ["", ""] else json.dumps(part) + key


def build_app(config: RouterConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        timeout = httpx.Timeout(None, connect=config.health_timeout_s)  # generation is slow
        transport = BackendTransport(limits=limits)
        async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
            pool = BackendPool(config, make_policy(config), client)
            app.state.pool, app.state.proxy = pool, Proxy(pool, client)
            await pool.check_all()
            checks = asyncio.create_task(pool.run_health_checks())
            logger.info(
                "router on http://%s:%d, policy %s, %d of %d workers healthy",
                config.host, config.port, config.policy, len(pool.healthy()), len(pool.workers),
            )  # fmt: skip
            yield
            checks.cancel()
            with suppress(asyncio.CancelledError):
                await checks

    app = FastAPI(title="radixserve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.config = config
    for path in ROUTED:
        app.add_api_route(path, _routed, methods=["POST"], include_in_schema=False)
    for path in ANY_WORKER:
        app.add_api_route(path, _any_worker, methods=["GET"], include_in_schema=False)
    app.add_api_route("/flush_cache", _fan_out, methods=["POST"])
    app.add_api_route("/abort_request", _fan_out, methods=["POST"])
    app.add_api_route("/health", _health, methods=["GET"])
    app.add_api_route("/metrics", _metrics, methods=["GET"])
    app.add_api_route("/get_server_info", _server_info, methods=["GET"])
    app.add_api_route("/workers", _workers, methods=["GET", "POST", "DELETE"])
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_middleware(
        ApiKeyMiddleware, tenant_keys=config.tenant_keys(), admin_key=config.admin_key(),
        admin_routes=ADMIN_ROUTES,
    )  # fmt: skip
    app.add_middleware(CrossSiteGuard, hosts=allowed_hosts(config.host, config.allowed_hosts))
    return app


# ---------------------------------------------------------------- proxied routes


async def _read(request: Request) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
    return bytes(body)


def _parse(body: bytes) -> Any:
    """The body as the workers parse it (400 naming what is wrong: not JSON, nested too
    deep, a value no worker takes); None for an empty one (the worker answers that)."""
    return parse_body(body) if body.strip() else None


async def _routed(request: Request) -> Response:
    body = await _read(request)
    parsed = _parse(body)
    path = request.url.path
    fwd = Forward(
        "POST", path, body, dict(request.headers),
        salted_key(request, parsed, routing_key(path, parsed)),
        request.headers.get(SESSION_HEADER), role(request) == "admin",
    )  # fmt: skip
    proxy: Proxy = request.app.state.proxy
    if isinstance(parsed, dict) and parsed.get("stream") is True:
        return await proxy.stream(fwd)
    return await proxy.forward(fwd)


async def _any_worker(request: Request) -> Response:
    fwd = Forward(
        "GET", request.url.path, b"", dict(request.headers), None,
        show_worker=role(request) == "admin",
    )  # fmt: skip
    return await request.app.state.proxy.forward(fwd)


async def _fan_out(request: Request) -> Response:
    """The route on every healthy worker; 200 if all answered 200, else the first other
    status (a busy worker's 400 for /flush_cache), with each worker's answer."""
    pool: BackendPool = request.app.state.pool
    body = await _read(request)
    parsed = _parse(body)
    if request.url.path == "/abort_request" and isinstance(parsed, dict):
        if parsed.get("abort_all") is True:
            require_admin(request, "abort_all")
    headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}

    async def one(url: str) -> tuple[int, Any]:
        try:
            r = await pool.client.request(
                request.method, url + request.url.path, content=body, headers=headers,
                timeout=30,
            )  # fmt: skip
        except httpx.HTTPError as e:
            return 502, repr(e)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    urls = [w.url for w in pool.healthy()]
    if not urls:
        raise ApiError(503, "no healthy worker", headers={"Retry-After": "1"})
    answers = dict(zip(urls, await asyncio.gather(*(one(u) for u in urls))))
    status = next((s for s, _ in answers.values() if s != 200), 200)
    if role(request) != "admin":  # which workers there are is the admin's to know
        return _one_answer(status, [b for s, b in answers.values() if s == status][0])
    workers = {u: {"status": s, "body": b} for u, (s, b) in answers.items()}
    return JSONResponse({"success": status == 200, "workers": workers}, status_code=status)


def _one_answer(status: int, body: Any) -> Response:
    """A worker's answer as one worker gives it; an error that is not a worker's JSON (a
    worker out of reach: its text may name it) becomes a plain one."""
    if not isinstance(body, dict):
        return ApiError(status, "a worker failed to answer").response()
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------- the router's own


async def _health(request: Request) -> Response:
    pool: BackendPool = request.app.state.pool
    if pool.healthy():
        return Response(status_code=200)
    return JSONResponse({"status": "no healthy worker"}, status_code=503)


async def _metrics(request: Request) -> Response:
    return Response(await metrics.render(request.app.state.pool), media_type=CONTENT_TYPE_LATEST)


def _worker_list(pool: BackendPool) -> list[dict[str, Any]]:
    return [
        {
            "url": w.url,
            "healthy": w.healthy,
            "in_flight": w.in_flight,
            "load": w.load,
            "sent": w.sent,
            **pool.policy.stats(w.url),
        }
        for w in pool.workers.values()
    ]


async def _server_info(request: Request) -> Response:
    pool: BackendPool = request.app.state.pool
    config: RouterConfig = request.app.state.config
    return JSONResponse(
        {
            "router": {"policy": config.policy, "retries": pool.retries},
            "decisions": dict(pool.decisions),
            "workers": _worker_list(pool),
        }
    )


async def _workers(request: Request) -> Response:
    pool: BackendPool = request.app.state.pool
    if request.method == "GET":
        return JSONResponse({"workers": _worker_list(pool)})
    parsed = _parse(await _read(request))
    url = parsed.get("url") if isinstance(parsed, dict) else None
    if not isinstance(url, str):
        raise ApiError(400, 'the body must be {"url": "http://host:port"}', "url")
    if request.method == "DELETE":
        if not pool.remove(url):
            raise ApiError(404, f"no worker {url!r}", "url")
        return JSONResponse({"success": True, "workers": _worker_list(pool)})
    try:
        worker = pool.add(url)
    except ValueError as e:
        raise ApiError(400, str(e), "url") from None
    await pool.check(worker)
    return JSONResponse({"success": True, "healthy": worker.healthy, "workers": _worker_list(pool)})
