"""HTTP backend: a running radixserve (or SGLang) server, over the SGLang-native routes
/generate, /get_model_info and /flush_cache.

Requests from concurrent program threads (fork children, run_batch) go out concurrently on
one pooled httpx client, so the server's scheduler batches them. The chat template and
the tokenizer (for `select`, which scores options in token space) come from the model's
tokenizer, loaded locally from the path /get_model_info reports.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from radixserve.core.request import PromptLogprob
from radixserve.frontend.backend import Backend, BackendError, GenRequest, GenResult, TextCallback
from radixserve.prompt.pml import Schema, to_pml
from radixserve.prompt.roles import RoleTemplate, template_for

DEFAULT_TIMEOUT_S = 600.0
MAX_CONNECTIONS = 256  # concurrent requests (one per fork child / batched program)


class RuntimeEndpoint(Backend):
    def __init__(
        self, base_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
    ) -> None:
        """Connect to the server at `base_url` (checked with /get_model_info now)."""
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=64)
        self._client = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, limits=limits
        )
        self.model_info: dict[str, Any] = self._json("GET", "/get_model_info")
        self._tok_lock = threading.Lock()
        self._tokenizer: Any = None
        self._template: RoleTemplate | None = None

    # ---------------------------------------------------------------- HTTP helpers
    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            resp = self._client.request(method, path, json=body)
        except httpx.TransportError as e:
            raise BackendError(f"{method} {self.base_url}{path}: {e!r}") from e
        _check(resp, path)
        return resp.json()

    def _tok(self) -> Any:
        """The model's tokenizer, loaded on first use. Caller holds _tok_lock."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # heavy: only when roles/select need it

            path = self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
            try:
                self._tokenizer = AutoTokenizer.from_pretrained(path)
            except (OSError, ValueError) as e:
                raise BackendError(
                    f"cannot load the server's tokenizer from {path!r} on this machine (it is "
                    f"needed for chat roles and select): {e}"
                ) from e
        return self._tokenizer

    # ---------------------------------------------------------------- Backend API
    def generate(self, req: GenRequest, on_text: TextCallback | None = None) -> GenResult:
        body = _generate_body(req)
        if on_text is None:
            out = self._json("POST", "/generate", body)
            return GenResult(out["text"], out["meta_info"])
        return self._stream(body, on_text)

    def _stream(self, body: dict[str, Any], on_text: TextCallback) -> GenResult:
        """SSE stream of cumulative results; hands out the text deltas."""
        try:
            return self._stream_events(body, on_text)
        except httpx.TransportError as e:
            raise BackendError(f"POST {self.base_url}/generate (stream): {e!r}") from e

    def _stream_events(self, body: dict[str, Any], on_text: TextCallback) -> GenResult:
        """Text is cumulative; output logprobs come per chunk (SGLang's stream) and are
        joined here, so the result's meta_info is that of a non-streamed request."""
        text, last = "", None
        logprobs: dict[str, list[Any]] = {"output_token_logprobs": [], "output_top_logprobs": []}
        with self._client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                resp.read()
                _check(resp, "/generate")
            for event in _sse_events(resp.iter_lines()):
                if "error" in event:
                    raise BackendError(f"/generate stream: {event['error']}")
                new = event["text"]
                assert new.startswith(text), "native stream text must be cumulative"
                if len(new) > len(text):
                    on_text(new[len(text) :])
                text, last = new, event
                for key, entries in logprobs.items():
                    entries.extend(event["meta_info"].get(key, []))
        if last is None:
            raise BackendError("/generate stream ended without any result")
        meta = last["meta_info"]
        return GenResult(text, {**meta, **logprobs} if "output_token_logprobs" in meta else meta)

    def register_schema(self, schema: Schema) -> list[str]:
        out = self._json("POST", "/schemas", {"pml": to_pml(schema)})
        (mine,) = [s for s in out["schemas"] if s["name"] == schema.name]
        return [name for name in mine["modules"] if name]

    def commit(self, prompt: str) -> None:
        if prompt:
            self._json(
                "POST", "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0}}
            )

    def role_template(self) -> RoleTemplate:
        with self._tok_lock:
            if self._template is None:
                self._template = template_for(self._tok())
            return self._template

    def encode(self, text: str) -> list[int]:
        with self._tok_lock:  # as the server tokenizes a text prompt (special tokens added)
            return list(self._tok().encode(text))

    def prompt_logprobs(self, reqs: list[tuple[list[int], int]]) -> list[list[PromptLogprob]]:
        body = {
            "input_ids": [ids for ids, _ in reqs],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": [start for _, start in reqs],
        }
        outs = self._json("POST", "/generate", body)
        return [[(e[0], e[1]) for e in o["meta_info"]["input_token_logprobs"]] for o in outs]

    def flush_cache(self) -> bool:
        """False when the server is busy (it answers 400 and flushes nothing)."""
        try:
            resp = self._client.post("/flush_cache")
        except httpx.TransportError as e:
            raise BackendError(f"POST {self.base_url}/flush_cache: {e!r}") from e
        if resp.status_code == 400:
            return False
        _check(resp, "/flush_cache")
        return True

    def get_server_info(self) -> dict[str, Any]:
        return self._json("GET", "/get_server_info")

    def close(self) -> None:
        self._client.close()


def _generate_body(req: GenRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"text": req.prompt, "sampling_params": req.sampling}
    if req.modules is not None:
        del body["text"]
        body["pml"] = to_pml(req.pml())
    if req.return_logprob:
        body.update(
            return_logprob=True,
            logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num,
            return_text_in_logprobs=req.return_text_in_logprobs,
        )
    return body


def _check(resp: httpx.Response, path: str) -> None:
    """BackendError with the server's message for any non-200 answer."""
    if resp.status_code == 200:
        return
    try:
        detail = resp.json().get("error", {}).get("message") or resp.text
    except (ValueError, AttributeError):
        detail = resp.text
    raise BackendError(f"{path}: HTTP {resp.status_code}: {detail}")


def _sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
