"""In-process backend: programs run on a radixserve.Engine in this process.

The Engine is not thread-safe, and programs call the backend from many threads (fork
children, run_batch). So ONE dispatcher thread owns the engine's scheduler:

    program threads ──put job──> inbox ──> dispatcher: admit all queued jobs, step(),
          ^                                            route each SampleOutput to its job
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

from radixserve.frontend.backend import Backend, BackendError, GenRequest, GenResult, TextCallback
from radixserve.frontend.chat import RoleTemplate, template_for

from radixserve.core.params import SamplingParams
from radixserve.core.request import PromptLogprob, SampleOutput, TokenizedRequest
from radixserve.engine.engine import Engine
from radixserve.message.messages import SampleDelta
from radixserve.scheduler.scheduler import QueueFullError
from radixserve.server.results import SampleResult, native_result
from radixserve.tokenizer.detokenize import IncrementalDetokenizer

GATHER_S = 0.002  # see the module docstring


@dataclass
class _Job:
    """One request (n == 1) in flight, accumulating its outputs like a /generate result."""

    request: TokenizedRequest
    detok: IncrementalDetokenizer
    on_text: TextCallback | None = None
    texts_in_logprobs: bool = False  # return_text_in_logprobs
    start: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    error: BaseException | None = None
    acc: SampleResult | None = None

    def add(self, out: SampleOutput) -> None:
        if self.acc is None:
            self.acc = SampleResult(out.rid, out.index)
        delta = SampleDelta.from_output(out)
        delta.text = self.detok.push(delta.token_ids, delta.finish_reason)
        if delta.text and self.on_text is not None:
            self.on_text(delta.text)
        self.acc.apply(delta)

    def finish(self, decode: Callable[[int], str] | None) -> None:
        """Build the result and wake the waiter. `decode` (token -> text) fills logprob
        texts when return_text_in_logprobs was asked."""
        assert self.acc is not None and self.acc.finish_reason is not None, self.request.rid
        if decode is not None:
            for entries in (self.acc.input_logprobs, self.acc.output_logprobs):
                entries[:] = [(lp, t, decode(t)) for lp, t, _ in entries]
            for tops in (self.acc.input_top_logprobs, self.acc.output_top_logprobs):
                tops[:] = [[(lp, t, decode(t)) for lp, t, _ in top] for top in tops]
        self.result = native_result(self.acc, self.start, self.request.return_logprob)
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
        self._backlog: list[_Job] = []  # jobs refused with QueueFullError, retried each step
        self.peak_running = 0  # most requests running in one step (how well jobs batched)

    # ---------------------------------------------------------------- Backend API
    def generate(self, req: GenRequest, on_text: TextCallback | None = None) -> GenResult:
        out = self._run(
            self._request(
                self.encode(req.prompt),
                req.sampling,
                req.return_logprob,
                req.logprob_start_len if req.return_logprob else -1,
                req.top_logprobs_num if req.return_logprob else 0,
            ),
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

    def _job(self, request: TokenizedRequest, on_text: TextCallback | None) -> _Job:
        detok = IncrementalDetokenizer.for_sample(
            self.engine.tokenizer, request.input_ids, request.sampling
        )
        return _Job(request, detok, on_text)

    def _run(
        self, request: TokenizedRequest, on_text: TextCallback | None = None, texts: bool = False
    ) -> dict[str, Any]:
        job = self._job(request, on_text)
        job.texts_in_logprobs = texts
        self._put(job)
        return self._wait(job)

    def _put(self, item: _Job | _Call) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="radixserve-engine-backend", daemon=True
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
    def _loop(self) -> None:
        active: dict[str, _Job] = {}
        closing = False
        try:
            while not (closing and not active and not self._backlog):
                idle = not active and not self._backlog and not closing
                closing = self._take(active, block=idle) or closing
                self._step(active)
        except BaseException as e:  # a bug here must not leave program threads waiting
            for job in [*active.values(), *self._backlog]:
                job.fail(BackendError(f"engine backend dispatcher failed: {e!r}"))
            raise

    def _take(self, active: dict[str, _Job], block: bool) -> bool:
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
        pending, self._backlog = [*self._backlog, *items], []
        for item in pending:
            if isinstance(item, _Call):
                self._do_call(item)
            elif item is not None:
                self._admit(item, active)
        return None in pending

    @staticmethod
    def _do_call(c: _Call) -> None:
        try:
            c.result = c.fn()
        except BaseException as e:
            c.error = e
        c.done.set()

    def _admit(self, job: _Job, active: dict[str, _Job]) -> None:
        try:
            self.engine.scheduler.add_request(job.request)
        except QueueFullError:
            self._backlog.append(job)
            return
        except ValueError as e:
            job.fail(BackendError(str(e)))
            return
        active[job.request.rid] = job

    def _step(self, active: dict[str, _Job]) -> None:
        sched = self.engine.scheduler
        if not active and not sched.has_work():
            return
        try:
            outputs = sched.step()
        except Exception as e:
            for rid, failed in list(active.items()):
                sched.abort_request(rid)
                failed.fail(BackendError(f"engine step failed: {e!r}"))
            active.clear()
            return
        self.peak_running = max(self.peak_running, len(sched.running))
        with self._tok_lock:  # detokenizers decode with the shared tokenizer
            for out in outputs:
                job = active.get(out.rid)
                if job is None:
                    continue  # a request aborted after its job failed
                job.add(out)
                if out.finished:
                    del active[out.rid]
                    job.finish(self._decode_one if job.texts_in_logprobs else None)

    def _decode_one(self, token: int) -> str:
        return str(self.engine.tokenizer.decode([token]))  # caller holds _tok_lock
