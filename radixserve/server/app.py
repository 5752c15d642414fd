"""The FastAPI application: routes, API-key check, error shape, /metrics.

Every error is JSON `{"error": {"message", "type", "param", "code"}}` (the OpenAI shape, which
the openai client parses) with the matching HTTP status.
"""

from __future__ import annotations

import hmac
import logging
import time
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.config import EngineConfig
from radixserve.message.messages import ServerInfoReq, ServerInfoResp
from radixserve.server import console, openai_api, schemas_api, sglang_api
from radixserve.server.manager import RequestManager
from radixserve.server.metrics import Metrics
from radixserve.server.protocol import ApiError

logger = logging.getLogger("radixserve.server")

PUBLIC_PATHS = frozenset({"/health"})  # reachable without the API key (load balancers)


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every HTTP route but PUBLIC_PATHS; the web
    console's page (`/`), which a browser opens without headers, takes it as `?key=`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_query = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected) or self._page_key_ok(scope):
            await self.app(scope, receive, send)
            return
        err = ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
        response = JSONResponse(err.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _page_key_ok(self, scope: Scope) -> bool:
        if scope["path"] != "/":
            return False
        key = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("key", [""])[0]
        return hmac.compare_digest(key.encode(), self.expected_query.encode())


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError), type(exc)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    err = ApiError(500, f"internal server error: {type(exc).__name__}: {exc}")
    return JSONResponse(err.body(), status_code=500)


async def metrics(request: Request) -> Response:
    manager: RequestManager = request.app.state.manager
    resp = await manager.call(ServerInfoReq)
    assert isinstance(resp, ServerInfoResp)
    body = request.app.state.metrics.render(resp.stats)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def build_app(manager: RequestManager, config: EngineConfig, metrics_: Metrics) -> FastAPI:
    # /openapi.json describes every request body (server/openapi.py); no docs UI is served.
    app = FastAPI(title="radixserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.manager = manager
    app.state.config = config
    app.state.metrics = metrics_
    app.state.started = time.time()
    app.include_router(sglang_api.router)
    app.include_router(openai_api.router)
    app.include_router(schemas_api.router)
    app.include_router(console.api)
    if config.web_ui:
        app.include_router(console.page)
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(Exception, _internal_error)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app
