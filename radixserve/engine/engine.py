"""Offline, in-process engine: `Engine(model).generate(...)` -> SGLang /generate-shaped dicts.

`generate` is the edge of this path (parameters parsed once, prompts tokenized and checked
here); it then drives the scheduler's one `StepLoop` in the calling thread, and each
sample's outputs go through the one `SampleAccumulator`, as in the server.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from radixserve.config import EngineConfig
from radixserve.core.limits import MAX_CACHE_SALT_CHARS
from radixserve.core.modules import ModuleUse
from radixserve.core.params import SamplingParams
from radixserve.core.request import SHARED, CacheSalt, FinishReason, TokenDelta, TokenizedRequest
from radixserve.core.result import native_result
from radixserve.prompt.pml import Prompt as PmlPrompt
from radixserve.prompt.pml import Schema
from radixserve.prompt.registry import SchemaRegistry
from radixserve.scheduler.loop import StepLoop
from radixserve.scheduler.modules import SchemaDone
from radixserve.scheduler.parts import load_parts
from radixserve.scheduler.scheduler import Scheduler
from radixserve.tokenizer.accumulate import SampleAccumulator

logger = logging.getLogger("radixserve.engine")

Prompt = str | Sequence[str] | None
Pml = str | PmlPrompt | Sequence[str | PmlPrompt] | None
Params = dict[str, Any] | Sequence[dict[str, Any]] | None


def _salt(cache_salt: str | None) -> CacheSalt:
    if cache_salt is None:
        return SHARED
    if not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise ValueError(
            f"cache_salt: must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters"
        )
    return CacheSalt(salt=cache_salt)


class Engine:
    """Runs the scheduler in this process. Not thread-safe: one `generate` at a time."""

    def __init__(self, model: str | None = None, **config: Any) -> None:
        self.config = EngineConfig(model=model, **config)
        parts = load_parts(self.config)
        self.tokenizer, self.worker = parts.tokenizer, parts.worker
        self.scheduler = Scheduler(self.config, parts)
        self.schemas = SchemaRegistry(self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self,
        prompt: Prompt = None,
        sampling_params: Params = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        pml: Pml = None,
        module_reuse: bool = True,
        cache_salt: str | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generate for one prompt (a dict back, or a list of n dicts when n > 1) or a batch
        of prompts (a flat list: n results per prompt, prompt-major).

        `pml`: prompts importing prompt modules of a registered schema (PML text or
        `radixserve.prompt.prompt(...)` trees), instead of `prompt` / `input_ids`;
        `module_reuse=False` prefills their expanded text instead (the exact fallback).

        `cache_salt`: the prompts share cached K/V (and radix drafts) only with requests of
        the same salt (a non-empty string of at most MAX_CACHE_SALT_CHARS characters).

        meta_info["first_token_latency"]: seconds from the call to the sample's first token
        (its time to first token; None if it produced none).

        Raises ValueError naming the offending field for invalid input.
        """
        if pml is not None:
            if prompt is not None or input_ids is not None:
                raise ValueError("give exactly one of prompt, input_ids or pml")
            single, prompts = self._pml_prompts(pml, module_reuse)
        else:
            single, ids = self._prompts(prompt, input_ids)
            prompts = [(x, None) for x in ids]
        params = self._params(sampling_params, len(prompts))
        salt = _salt(cache_salt)
        reqs = [
            TokenizedRequest(
                rid=f"engine-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
                input_ids=ids,
                sampling=sp,
                return_logprob=return_logprob,
                logprob_start_len=logprob_start_len if return_logprob else -1,
                top_logprobs_num=top_logprobs_num,
                modules=use,
                salt=salt,
            )
            for (ids, use), sp in zip(prompts, params)
        ]
        results = self._run(reqs, return_logprob)
        return results[0] if single and len(results) == 1 else results

    def _prompts(self, prompt: Prompt, input_ids: Any) -> tuple[bool, list[list[int]]]:
        """(whether one prompt was given, the token ids of each); ValueError names the field."""
        single, batch = self._token_ids(prompt, input_ids)
        if not all(batch):
            raise ValueError("input_ids: the prompt is empty")
        return single, batch

    def _token_ids(self, prompt: Prompt, input_ids: Any) -> tuple[bool, list[list[int]]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if isinstance(prompt, str) else prompt
            if not isinstance(texts, list | tuple) or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt: must be a string or a list of strings")
            return single, [self.tokenizer.encode(t) for t in texts]  # as SGLang and our server
        single = not input_ids or isinstance(input_ids[0], int)
        batch = [input_ids] if single else list(input_ids)
        if not all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in batch):
            raise ValueError("input_ids: must be a list of ints or a list of lists of ints")
        return single, batch

    def _pml_prompts(
        self, pml: Pml, module_reuse: bool
    ) -> tuple[bool, list[tuple[list[int], ModuleUse | None]]]:
        single = isinstance(pml, str | PmlPrompt)
        batch = [pml] if isinstance(pml, str | PmlPrompt) else list(pml or [])
        return single, [self.schemas.token_ids(p, module_reuse) for p in batch]

    def register_schema(self, schema: str | Schema) -> list[str]:
        """Lay out `schema` (PML text or a `radixserve.prompt.schema(...)` tree), encode its
        modules' K/V once at their positions and pin it; returns the module names once it
        is usable. ValueError: malformed, a duplicate name, or it does not fit the context /
        pool. Drives the scheduler until the encoding is done (`begin_schema` does not)."""
        done: list[str | None] = []
        names = self.begin_schema(schema, done.append)
        while not done:
            self.scheduler.step()  # nothing else runs on this engine meanwhile
        if done[0] is not None:
            raise ValueError(done[0])
        return names

    def begin_schema(self, schema: str | Schema, on_done: SchemaDone) -> list[str]:
        """Start registering `schema`; returns its module names. The scheduler encodes it
        over its next steps, beside whatever else runs; then the schema is known here and
        `on_done(None)` runs (or `on_done(reason)` if it was removed first). Until then a
        prompt importing it is refused as "still being encoded". ValueError as
        `register_schema`, at once."""
        layout = self.schemas.compile(schema)
        self.schemas.begin(layout)

        def finished(error: str | None) -> None:
            (self.schemas.cancel if error else self.schemas.add)(layout)
            on_done(error)

        try:
            self.scheduler.register_schema(layout.compiled, finished)
        except ValueError:
            self.schemas.cancel(layout)
            raise
        return [n for n in layout.spans if n]

    def remove_schema(self, name: str) -> None:
        """Free a schema's pinned K/V. ValueError: unknown name."""
        self.scheduler.remove_schema(name)
        self.schemas.remove(name)

    @staticmethod
    def _params(sampling_params: Params, n: int) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, dict):
            return [SamplingParams.from_dict(sampling_params or {}) for _ in range(n)]
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {n} prompts")
        return [SamplingParams.from_dict(p) for p in sampling_params]

    def _run(self, reqs: list[TokenizedRequest], return_logprob: bool) -> list[dict[str, Any]]:
        """Drive the one `StepLoop` in this thread until every sample of `reqs` finished."""
        start = time.perf_counter()
        samples = {
            (r.rid, i): SampleAccumulator.for_sample(self.tokenizer, r, i, keep_result=True)
            for r in reqs
            for i in range(r.sampling.n)
        }
        unfinished = len(samples)
        first_token: dict[tuple[str, int], float] = {}  # seconds from the call to the first token

        def sink(outputs: list[TokenDelta]) -> None:
            nonlocal unfinished
            for out in outputs:
                key = (out.rid, out.index)
                if out.new_token_ids and key not in first_token:
                    first_token[key] = time.perf_counter() - start
                samples[key].push(out)
                unfinished -= out.finished
                _raise_if_failed(out.finish_reason)

        loop = StepLoop(self.scheduler, sink, _refused, backlog=True)
        try:
            for r in reqs:
                loop.add(r)
            while unfinished:
                ran = loop.step()
                assert ran, f"{unfinished} samples unfinished and nothing to run"
        except BaseException:
            loop.abort_all()
            loop.sink = _discard
            loop.step()  # the aborted samples' last outputs
            raise
        results = []
        for key, acc in samples.items():
            result = native_result(acc.kept, start, return_logprob)
            result["meta_info"]["first_token_latency"] = first_token.get(key)
            results.append(result)
        return results

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """The model's chat template applied, ending with the assistant's turn opener."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert isinstance(text, str)
        return text

    def shutdown(self) -> None:
        """Stop tensor-parallel follower ranks (if any); the engine is unusable afterwards."""
        self.worker.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def _refused(rid: str, status: int, message: str) -> None:
    """A request the scheduler can never run (the loop keeps a backlog, so never 503)."""
    raise ValueError(message)


def _discard(outputs: list[TokenDelta]) -> None:
    """The sink of a failed call: its aborted samples' outputs are not wanted."""


def _raise_if_failed(reason: FinishReason | None) -> None:
    """A request the scheduler failed (finish "error"): ValueError when it was the request's
    (a 4xx status, e.g. a pattern that does not compile), RuntimeError otherwise."""
    if reason is not None and reason.type == "error":
        status = reason.status or 500
        raise (ValueError if status < 500 else RuntimeError)(str(reason.matched))
