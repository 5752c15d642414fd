"""Prompt-module schemas: POST /schemas (register a PML schema: its modules' K/V is encoded
once and pinned), GET /schemas (list), DELETE /schemas/{name} (free its K/V). A prompt
then imports them through /generate's `pml` field."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from radixserve.message.messages import SchemaReq, SchemaResp
from radixserve.server.manager import RequestManager
from radixserve.server.protocol import ApiError, bad, check_fields, get, read_json

router = APIRouter()
# Registering encodes every module (a prefill of the whole schema): allow for long ones.
SCHEMA_TIMEOUT_S = 600.0


async def _call(request: Request, op: str, pml: str = "", name: str = "") -> SchemaResp:
    manager: RequestManager = request.app.state.manager
    resp = await manager.call(lambda seq: SchemaReq(seq, op, pml, name), SCHEMA_TIMEOUT_S)
    assert isinstance(resp, SchemaResp)
    if resp.status != 200:
        raise ApiError(resp.status, resp.message)
    return resp


@router.post("/schemas")
async def register_schema(request: Request) -> Response:
    """Body {"pml": "<schema name=...>...</schema>"}; 400 naming what is wrong."""
    body = await read_json(request)
    check_fields(body, {"pml"})
    pml = get(body, "pml", "str")
    if not pml:
        raise bad("pml: a <schema> document is required", "pml")
    return JSONResponse({"schemas": (await _call(request, "register", pml=pml)).schemas})


@router.get("/schemas")
async def list_schemas(request: Request) -> Response:
    return JSONResponse({"schemas": (await _call(request, "list")).schemas})


@router.delete("/schemas/{name}")
async def delete_schema(request: Request, name: str) -> Response:
    """400 for an unknown schema or one that queued or running requests still import."""
    return JSONResponse({"schemas": (await _call(request, "delete", name=name)).schemas})
