"""The web console: `GET /` (one page from package data, no external assets) and the two
read-only JSON endpoints it polls, `/cache_tree` and `/metrics_history`; and `/cache_digest`,
the cache as a router reads it.

With `--api-key` the page is reached as `/?key=<api key>` (the page sends the key as a Bearer
header on every call it makes); `--no-web-ui` leaves `/` unrouted (404).
"""

from __future__ import annotations

import functools
from importlib import resources

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from radixserve.kvcache.digest import MAX_BLOCKS
from radixserve.kvcache.tree_view import MAX_DEPTH, MAX_NODES
from radixserve.message.messages import CacheDigestReq, CacheDigestResp, CacheTreeReq, CacheTreeResp
from radixserve.server.guard import require_admin, role, scoped_to
from radixserve.server.history import History
from radixserve.server.manager import RequestManager
from radixserve.server.protocol import ApiError

DEFAULT_NODES = 300
DEFAULT_DEPTH = 16

api = APIRouter()  # always served
page = APIRouter()  # GET /, unless --no-web-ui


@functools.cache
def _page_html() -> str:
    return resources.files("radixserve.server").joinpath("static/console.html").read_text()


@page.get("/", include_in_schema=False)
async def console(request: Request) -> Response:
    return HTMLResponse(_page_html())


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ApiError(400, f"{name} must be an integer, got {raw!r}", name) from None
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be in [{low}, {high}], got {value}", name)
    return value


@api.get("/cache_tree")
async def cache_tree(request: Request) -> Response:
    """The radix tree breadth first from the root, at most `max_nodes` nodes (default 300,
    at most 2000) within `max_depth` of the root (default 16, at most 64), each with its
    first token ids and their text; plus the cache's token counts and a scheduler snapshot.
    The ids and text are other tenants' prompts: an inference key gets the tree's shape only
    (`content_hidden`: true); when a keys file gives several tenants, a tenant's key gets
    the parts of its own salts alone, with their text, and the counts of what it is shown
    (`tenant`: its name; kvcache/tree_view.py)."""
    max_nodes = _int_param(request, "max_nodes", DEFAULT_NODES, 1, MAX_NODES)
    max_depth = _int_param(request, "max_depth", DEFAULT_DEPTH, 0, MAX_DEPTH)
    manager: RequestManager = request.app.state.manager
    tenant = scoped_to(request)
    resp = await manager.call(lambda seq: CacheTreeReq(seq, max_nodes, max_depth, tenant))
    assert isinstance(resp, CacheTreeResp)
    view = resp.view
    body = msgspec.to_builtins(view)  # ~10x faster than dataclasses.asdict on 2000 nodes
    body["stats"].update(kv_usage=view.stats.kv_usage, cache_hit_rate=view.stats.cache_hit_rate)
    body["content_hidden"] = role(request) != "admin" and tenant is None
    if body["content_hidden"]:
        for node in body["nodes"]:
            node["preview_ids"], node["text"], node["salt"] = [], "", None
    return Response(msgspec.json.encode(body), media_type="application/json")


@api.get("/cache_digest")
async def cache_digest(request: Request) -> Response:
    """The shared part of the prefix cache as the hashes of its blocks of `block` token ids
    (default 16, at most 1024), shallow blocks first, at most `max_blocks` (default 4096):
    8 bytes each, concatenated (radixserve/core/digest.py says how a prompt is hashed to
    compare). `X-Radixserve-Cached-Tokens`: the tokens the cache holds. Admin key."""
    require_admin(request, "/cache_digest")
    block = _int_param(request, "block", 16, 1, 1024)
    max_blocks = _int_param(request, "max_blocks", 4096, 1, MAX_BLOCKS)
    manager: RequestManager = request.app.state.manager
    resp = await manager.call(lambda seq: CacheDigestReq(seq, block, max_blocks))
    assert isinstance(resp, CacheDigestResp)
    headers = {"X-Radixserve-Cached-Tokens": str(resp.cached_tokens)}
    return Response(resp.hashes, media_type="application/octet-stream", headers=headers)


@api.get("/metrics_history")
async def metrics_history(request: Request) -> Response:
    """The last ten minutes in 5-second points: tokens/s, TTFT and inter-token latency
    p50/p99 (seconds), cache hit rate (None where a bucket had no such event). Every
    tenant's together: a tenant's key gets empty points when there are several."""
    history = request.app.state.metrics.history if scoped_to(request) is None else History()
    return JSONResponse(history.series())
