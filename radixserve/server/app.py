"""The FastAPI application: routes, key scopes and cross-site guard, error shape, /metrics.

Every error is JSON `{"error": {"message", "type", "param", "code"}}` (the OpenAI shape, which
the openai client parses) with the matching HTTP status.
"""

from __future__ import annotations

import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.config import EngineConfig
from radixserve.message.messages import ServerInfoReq, ServerInfoResp
from radixserve.redact import redact
from radixserve.server import console, openai_api, schemas_api, sglang_api
from radixserve.server.guard import ApiKeyMiddleware, CrossSiteGuard, allowed_hosts, scoped_to
from radixserve.server.manager import RequestManager
from radixserve.server.metrics import Metrics
from radixserve.server.protocol import ApiError, api_error_handler

logger = logging.getLogger("radixserve.server")

# What an inference key does not reach (radixserve/server/guard.py); the routes whose
# answer depends on the key check `guard.role` themselves (/cache_tree, /metrics, aborts).
ADMIN_ROUTES = (
    ("*", "/flush_cache"),
    ("GET", "/get_server_info"),
    ("POST", "/schemas"),
    ("DELETE", "/schemas/"),
)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return ApiError(500, redact(f"internal server error: {type(exc).__name__}: {exc}")).response()


async def metrics(request: Request) -> Response:
    """Every series; a tenant's own alone for a tenant's key when there are several
    (`guard.scoped_to`)."""
    manager: RequestManager = request.app.state.manager
    tenant = scoped_to(request)
    if tenant is not None:
        body = request.app.state.metrics.render_tenant(tenant)
        return Response(body, media_type=CONTENT_TYPE_LATEST)
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
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(
        ApiKeyMiddleware, tenant_keys=config.tenant_keys(), admin_key=config.admin_key(),
        admin_routes=ADMIN_ROUTES,
    )  # fmt: skip
    app.add_middleware(CrossSiteGuard, hosts=allowed_hosts(config.host, config.allowed_hosts))
    return app
