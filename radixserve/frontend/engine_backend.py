"""In-process backend: programs run on a radixserve.Engine in this process.

The Engine is not thread-safe, and programs call the backend from many threads (fork
children, run_batch). So ONE dispatcher thread owns the engine's scheduler, driving its one
`StepLoop` (as the scheduler process and `Engine.generate` do):

    program threads ──put job──> inbox ──> dispatcher: loop.add(each queued job), step(),
          ^                                            each TokenDelta to its job's
          |                                            SampleAccumulator
          └──────────── job.done (result or error) ──────────┘

Jobs arriving while others run join the running batch at the next step (continuous
batching), so a fork's children, submitted together, are prefilled in one batch and then
decode together. When the dispatcher wakes from idle it waits GATHER_S for more jobs, so a
burst of submissions lands in the same first step.

Contract: while programs run on this backend, nothing else may use the engine (no direct
`engine.generate`); reading `engine.scheduler.stats()` between runs is fine.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.params import SamplingParams
from radixserve.core.request import PromptLogprob, TokenDelta, TokenizedRequest
from radixserve.core.result import native_result
from radixserve.engine.engine import Engine
from radixserve.frontend.backend import Backend, BackendError, GenRequest, GenResult, TextCallback
from radixserve.prompt.pml import Schema
from radixserve.prompt.roles import RoleTemplate, template_for
from radixserve.scheduler.loop import StepLoop
from radixserve.tokenizer.accumulate import SampleAccumulator

GATHER_S = 0.002  # see the module docstring


@dataclass
class _Job:
    """One request (n == 1) in flight, accumulating its outputs like a /generate result."""

    request: TokenizedRequest
    acc: SampleAccumulator
    on_text: TextCallback | None = None
    start: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    error: BaseException | None = None

    def add(self, out: TokenDelta) -> None:
        """One output (caller holds the tokenizer lock); the last one wakes the waiter."""
        text = self.acc.push(out).text
        if text and self.on_text is not None:
            self.on_text(text)
        if out.finished:
            self.result = native_result(self.acc.kept, self.start, self.request.return_logprob)
            self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


@dataclass
class _Call:
    """A function to run on the dispatcher thread (it owns the scheduler)."""

    fn: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None


class EngineBackend(Backend):
    def __init__(self, engine: Engine | None = None, **engine_kwargs: Any) -> None:
        """Wrap `engine`, or build `Engine(**engine_kwargs)` (the embedded model by default)."""
        if engine is None:
            engine = Engine(**engine_kwargs)
        else:
            assert not engine_kwargs, f"engine given: unexpected {sorted(engine_kwargs)}"
        self.engine = engine
        self._tok_lock = threading.Lock()  # the HF tokenizer is shared with program threads
        self._inbox: queue.SimpleQueue[_Job | _Call | None] = queue.SimpleQueue()
        self._start_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._template: RoleTemplate | None = None
        # The dispatcher's: jobs by rid (accepted or in the loop's backlog), and the one loop.
        self._jobs: dict[str, _Job] = {}
        self._loop = StepLoop(engine.scheduler, self._deliver, self._refused, backlog=True)
        self.peak_running = 0  # most requests running in one step (how well jobs batched)

    # ---------------------------------------------------------------- Backend API
    def generate(self, req: GenRequest, on_text: TextCallback | None = None) -> GenResult:
        ids, use = self.encode(req.prompt), None
        if req.modules is not None:
            with self._tok_lock:
                try:
                    ids, use = self.engine.schemas.token_ids(req.pml(), module_reuse=True)
                except ValueError as e:
                    raise BackendError(str(e)) from e
        request = self._request(
            ids,
            req.sampling,
            req.return_logprob,
            req.logprob_start_len if req.return_logprob else -1,
            req.top_logprobs_num if req.return_logprob else 0,
        )
        request.modules = use
        out = self._run(
            request,
            on_text,
            req.return_text_in_logprobs,
        )
        return GenResult(out["text"], out["meta_info"])

    def commit(self, prompt: str) -> None:
        if prompt:
            self._run(self._request(self.encode(prompt), {"max_new_tokens": 0}))

    def role_template(self) -> RoleTemplate:
        with self._tok_lock:
            if self._template is None:
                self._template = template_for(self.engine.tokenizer)
            return self._template

    def encode(self, text: str) -> list[int]:
        with self._tok_lock:  # exactly as Engine.generate (and the server) tokenize text
            return list(self.engine.tokenizer.encode(text))

    def prompt_logprobs(self, reqs: list[tuple[list[int], int]]) -> list[list[PromptLogprob]]:
        jobs = [
            self._job(self._request(ids, {"max_new_tokens": 0}, True, start, 0), None)
            for ids, start in reqs
        ]
        for job in jobs:
            self._put(job)
        outs = [self._wait(job) for job in jobs]
        return [[(e[0], e[1]) for e in o["meta_info"]["input_token_logprobs"]] for o in outs]

    def flush_cache(self) -> bool:
        return bool(self.call(self.engine.scheduler.flush_cache))

    def register_schema(self, schema: Schema) -> list[str]:
        """Start the encoding on the dispatcher thread; its steps then encode the schema
        beside the running jobs, and this returns once it is usable."""
        done = threading.Event()
        errors: list[str | None] = []

        def finished(error: str | None) -> None:
            errors.append(error)
            done.set()

        try:
            names = list(self.call(lambda: self.engine.begin_schema(schema, finished)))
        except ValueError as e:
            raise BackendError(str(e)) from e
        done.wait()
        if errors[0] is not None:
            raise BackendError(errors[0])
        return names

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the dispatcher thread (between steps) and return its result."""
        c = _Call(fn)
        self._put(c)
        c.done.wait()
        if c.error is not None:
            raise c.error
        return c.result

    def close(self) -> None:
        """Stop the dispatcher thread once the jobs already queued have finished. The
        backend stays usable: the next request starts a new dispatcher."""
        with self._start_lock:  # a concurrent request waits, then starts a new dispatcher
            if self._thread is not None:
                self._inbox.put(None)
                self._thread.join()
                self._thread = None

    # ---------------------------------------------------------------- program side
    def _request(
        self,
        ids: list[int],
        sampling: dict[str, Any],
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
    ) -> TokenizedRequest:
        """The request, its parameters parsed once here (BackendError names the field)."""
        if not ids:
            raise BackendError("input_ids: the prompt is empty")
        try:
            params = SamplingParams.from_dict(sampling)
        except ValueError as e:
            raise BackendError(f"sampling_params: {e}") from e
        return TokenizedRequest(
            rid=f"program-{uuid.uuid4().hex}",
            input_ids=ids,
            sampling=params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )

    def _job(
        self, request: TokenizedRequest, on_text: TextCallback | None, texts: bool = False
    ) -> _Job:
        acc = SampleAccumulator.for_sample(
            self.engine.tokenizer, request, 0, texts_in_logprobs=texts, keep_result=True
        )
        return _Job(request, acc, on_text)

    def _run(
        self, request: TokenizedRequest, on_text: TextCallback | None = None, texts: bool = False
    ) -> dict[str, Any]:
        job = self._job(request, on_text, texts)
        self._put(job)
        return self._wait(job)

    def _put(self, item: _Job | _Call) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop_thread, name="radixserve-engine-backend", daemon=True
                )
                self._thread.start()
        self._inbox.put(item)

    @staticmethod
    def _wait(job: _Job) -> dict[str, Any]:
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    # ---------------------------------------------------------------- dispatcher thread
    def _loop_thread(self) -> None:
        closing = False
        try:  # busy: jobs, or a schema being encoded (`begin_schema`)
            while not (closing and not self._busy()):
                closing = self._take(block=not self._busy() and not closing) or closing
                self._step()
        except BaseException as e:  # a bug here must not leave program threads waiting
            for job in self._jobs.values():
                job.fail(BackendError(f"engine backend dispatcher failed: {e!r}"))
            self._jobs.clear()
            raise

    def _take(self, block: bool) -> bool:
        """Admit queued jobs and run queued calls (waiting for one item if `block`).
        Returns whether the close sentinel was among them."""
        items: list[_Job | _Call | None] = []
        if block:
            items.append(self._inbox.get())
            deadline = time.monotonic() + GATHER_S
            while (left := deadline - time.monotonic()) > 0:
                try:
                    items.append(self._inbox.get(timeout=left))
                except queue.Empty:
                    break
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if isinstance(item, _Call):
                self._do_call(item)
            elif item is not None:
                self._jobs[item.request.rid] = item
                self._loop.add(item.request)
        return None in items

    def _busy(self) -> bool:
        return bool(self._jobs) or self._loop.has_work()

    @staticmethod
    def _do_call(c: _Call) -> None:
        try:
            c.result = c.fn()
        except BaseException as e:
            c.error = e
        c.done.set()

    def _refused(self, rid: str, status: int, message: str) -> None:
        self._jobs.pop(rid).fail(BackendError(message))

    def _step(self) -> None:
        try:
            self._loop.step()
        except Exception as e:  # every job but the backlog's fails (its outputs may be lost)
            waiting = {r.rid for r in self._loop.backlog}
            for rid in [rid for rid in self._jobs if rid not in waiting]:
                self._loop.abort(rid)
                self._jobs.pop(rid).fail(BackendError(f"engine step failed: {e!r}"))
            return
        self.peak_running = max(self.peak_running, len(self.engine.scheduler.running))

    def _deliver(self, outputs: list[TokenDelta]) -> None:
        """The loop's sink: each output to its job (none for a job failed already)."""
        with self._tok_lock:  # detokenizers decode with the shared tokenizer
            for out in outputs:
                job = self._jobs.get(out.rid)
                if job is not None:
                    job.add(out)
                    if out.finished:
                        del self._jobs[out.rid]
