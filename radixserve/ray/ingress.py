"""The ingress: radixserve's HTTP routes behind Ray Serve's proxy, each call sent to a replica.

Per request: the body is read (a body that is not JSON is a 400 here), its prompt tokenized
as the replicas will (`prompt_ids`: the router matches token ids), and the call sent through
the replicas' deployment handle, whose request router picks the replica. The replica's
answer is relayed as it comes. Failover, as the HTTP router's (docs/router.md):

- a replica that fails before answering (it died, or its server did) is left and the call
  is sent again, up to `max_attempts` times, then 503 + Retry-After;
- a non-streamed answer is relayed only once whole, so one broken mid-way is sent again;
- a stream is relayed from its first event on, so one whose replica fails before that
  (queued, or in prefill) is sent again too; a stream of one prompt and one sample that
  breaks after its first event is continued on another replica from the tokens it has sent
  (resume.py says which streams); any other stream that breaks ends with an
  `{"error": ...}` event and `data: [DONE]`; the replica's own answers, errors included,
  are never sent again.
"""

# No `from __future__ import annotations`: Ray Serve rebuilds the routes' signatures, and
# FastAPI must see `Request` as a class there, not as a string, or it reads it as a query field.
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from radixserve.ray.call import Call
from radixserve.ray.resume import DONE, StreamResume
from radixserve.server.openai_protocol import parse_messages
from radixserve.server.protocol import ApiError
from radixserve.tokenizer.chat import render_chat

logger = logging.getLogger("radixserve.ray")

api = FastAPI(title="radixserve on Ray Serve")
PROMPT_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
OTHER_ROUTES = ("/v1/models", "/get_model_info", "/health", "/health_generate")


BROKEN = (
    b'data: {"error": {"message": "the replica serving this stream failed; send the request '
    b'again", "type": "server_error", "code": 503}}\n\ndata: [DONE]\n\n'
)


def prompt_ids(tok: Any, path: str, body: Any) -> list[int] | None:
    """The token ids the replica's tokenizer process will make of the body's (first)
    prompt, as its api server reads the body; None when the body does not say plainly (the
    replica then answers it, a 4xx if it is wrong)."""
    if not isinstance(body, dict):
        return None
    if path == "/v1/chat/completions":
        try:  # the messages as the api server reads them
            messages = parse_messages(body)
            return render_chat(tok, messages, body.get("tools"), body.get("chat_template_kwargs"))
        except (ApiError, ValueError, TypeError):
            return None
    prompt = body.get("text") if path == "/generate" else body.get("prompt")
    ids = body.get("input_ids") if path == "/generate" else prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]  # a batch: routed by its first prompt
    if isinstance(prompt, str):
        return list(tok.encode(prompt))
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        ids = ids[0]
    if isinstance(ids, list) and ids and all(type(i) is int for i in ids):
        return ids
    return None


def prompt_text(body: Any) -> str:
    """The body's prompt as plain text, for routers that match text (Ray's own)."""
    if not isinstance(body, dict):
        return ""
    if isinstance(body.get("messages"), list):
        return "".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
    prompt = body.get("text", body.get("prompt"))
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else ""


# Defined last: Ray Serve serializes the class where it is decorated, with the module's
# names it uses then.
@serve.ingress(api)
class Ingress:
    def __init__(
        self, engine: DeploymentHandle, model: str | None = None, revision: str | None = None,
        max_attempts: int = 3,
    ) -> None:  # fmt: skip
        from radixserve.models.loader import load_tokenizer
        from radixserve.models.resolve import resolve_model_path

        self.engine = engine.options(stream=True)
        self.tok = load_tokenizer(resolve_model_path(model, revision))
        self.max_attempts = max_attempts
        self.context_len: int | None = None

    @api.post("/generate")
    @api.post("/v1/completions")
    @api.post("/v1/chat/completions")
    async def prompt_route(self, request: Request) -> Response:
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            return ApiError(400, "body: not valid JSON", "body").response()
        path = request.url.path
        ids = prompt_ids(self.tok, path, parsed)
        content_type = request.headers.get("content-type", "application/json")
        text = prompt_text(parsed) or path  # never empty: Ray's prefix router divides by it
        resume = StreamResume.of(path, parsed, ids, self._decode)
        body = body if resume is None else resume.request()
        return await self._send(Call("POST", path, body, content_type, ids, text), resume)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))

    async def _context_len(self) -> int | None:
        """The model's context length, as a replica's `/v1/models` says."""
        if self.context_len is None:
            opened = await self._open(Call("GET", "/v1/models", b"", "", None, "/v1/models"))
            try:  # a replica's answer is not trusted
                assert opened is not None and opened[0]["status"] == 200, opened
                self.context_len = int(json.loads(opened[1])["data"][0]["max_model_len"])
            except (AssertionError, ValueError, TypeError, KeyError, IndexError) as e:
                logger.warning("no context length from a replica: %r", e)
        return self.context_len

    @api.get("/v1/models")
    @api.get("/get_model_info")
    @api.get("/health")
    @api.get("/health_generate")
    async def other_route(self, request: Request) -> Response:
        path = request.url.path
        return await self._send(Call("GET", path, b"", "", None, path))

    async def _send(self, call: Call, resume: StreamResume | None = None) -> Response:
        """The first replica answer that starts (module docstring); a stream that `resume`
        follows is continued on another replica if its own fails."""
        opened = await self._open(call)
        if opened is None:
            message = f"no replica answered after {self.max_attempts} attempts"
            return ApiError(503, message, headers={"Retry-After": "1"}).response()
        head, first, stream = opened
        if stream is None:
            return Response(first, head["status"], media_type=head["content_type"])
        relay = self._relay(first, stream, call, resume if head["status"] == 200 else None)
        return StreamingResponse(relay, head["status"], media_type=head["content_type"])

    async def _open(
        self, call: Call
    ) -> tuple[dict[str, Any], bytes, DeploymentResponseGenerator | None] | None:
        """The first replica answer that starts, within max_attempts: its head and, for a
        stream, its first chunk and the stream; else the whole answer and None."""
        for attempt in range(1, self.max_attempts + 1):
            stream = cast(DeploymentResponseGenerator, self.engine.forward.remote(call))
            try:
                head = await stream.__anext__()
                if not head["content_type"].startswith("text/event-stream"):
                    return head, b"".join([chunk async for chunk in stream]), None
                return head, await anext(stream, b""), stream
            except (RayError, StopAsyncIteration) as e:
                logger.warning("%s: attempt %d failed: %r", call.path, attempt, e)
        return None

    async def _relay(
        self,
        first: bytes,
        stream: DeploymentResponseGenerator,
        call: Call,
        resume: StreamResume | None,
    ) -> AsyncIterator[bytes]:
        """The stream's chunks as they come (whole events under `resume`); when its replica
        fails, its continuation on another one, else an error event."""
        chunk = first
        while True:
            try:
                while True:
                    if resume is None:
                        yield chunk
                    else:
                        for event in resume.events(chunk):
                            yield event
                    chunk = await anext(stream)
            except StopAsyncIteration:
                return
            except RayError as e:
                logger.warning("%s: a stream broke: %r", call.path, e)
                if resume is None:
                    yield BROKEN
                    return
                context_len = await self._context_len() if resume.needs_context_len else None
                try:
                    more = resume.continuation(context_len)
                except ValueError as bad:
                    logger.warning("%s: not continued: %s", call.path, bad)
                    yield BROKEN
                    return
                if more is None:  # all was sent but the end
                    yield DONE
                    return
                path, body, ids = more
                again_call = dataclasses.replace(call, path=path, body=body, ids=ids)
                opened = await self._open(again_call)
                again = None if opened is None else opened[2]
                if opened is None or again is None:  # no replica, or not a stream (a 4xx)
                    yield BROKEN
                    return
                chunk, stream = opened[1], again
