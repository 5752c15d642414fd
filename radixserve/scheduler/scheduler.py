"""Continuous-batching scheduler: receive -> schedule -> forward -> process results.

Each step builds ONE batch: every running sample contributes its next input (a single token
when decoding, a prompt chunk while prefilling), then waiting samples are admitted in policy
order while the prefill budget, free rows and KV slots allow. Under KV pressure the cache
evicts unlocked leaves first; if decoding still cannot proceed, the most recently admitted
samples are retracted (their K/V goes to the radix cache, they re-queue at their original
arrival key and resume later with identical results).

Isolation: whatever goes wrong with ONE request while it is served (its pattern will not
compile, its logits hold NaN/inf, its masks leave no token, an exception on its path after
the forward pass) ends all its samples with finish "error" (status 400 when the request
asked for it, 500 otherwise); the batch and every other request go on. An exception that
cannot be pinned on one request (the forward pass raised) fails the requests of that step
(500 naming it); the scheduler goes on. Only an AssertionError, a broken invariant of the
cache or pool, propagates and ends the process.

Public surface (the in-process Engine and the scheduler process use nothing else):

    sched = Scheduler(config, load_parts(config))  # parts: model worker, tokenizer, cache
    sched.add_request(TokenizedRequest)   # ValueError (-> HTTP 400) if it can never run;
                                          # rid unique, prompt non-empty (the caller's part)
    outputs = sched.step()                # one schedule + forward; list[TokenDelta] deltas
    sched.abort_request(rid)              # frees its KV; a final TokenDelta(abort) follows
    sched.flush_cache() -> bool           # False while requests are running or queued
    sched.has_work() -> bool
    sched.stats() -> SchedulerStats
    sched.cache_tree(max_nodes, max_depth, tenant) -> CacheTreeView  # the console's tree view
    sched.register_schema(CompiledSchema, on_done)  # prompt modules: pin, encode over the
                                          # next steps, then on_done(None); ValueError
    sched.remove_schema(name)             # ValueError: unknown, or requests use it
    sched.schemas() -> list[dict]         # the registered schemas
    sched.model_info -> ModelInfo
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.attention.tree_plan import batched_nodes
from radixserve.config import DECODE_RESERVE, EngineConfig
from radixserve.constrained.backend import CompiledGrammar, UnservablePattern
from radixserve.core.batch import BatchBuilder, ForwardBatch, TableRows
from radixserve.core.info import CacheTreeView, ModelInfo, SchedulerStats
from radixserve.core.modules import CompiledSchema
from radixserve.core.request import FinishReason, TokenDelta, TokenizedRequest, TokenLogprob
from radixserve.kvcache.pool import ReqToTokenPool
from radixserve.kvcache.tree_view import snapshot
from radixserve.sampling.stop import StopChecker
from radixserve.scheduler.compiling import PendingCompiles
from radixserve.scheduler.draft_model import DraftModel
from radixserve.scheduler.draft_tree import ROOT, Draft
from radixserve.scheduler.kv import KVManager
from radixserve.scheduler.modules import EncodeChunk, SchemaDone
from radixserve.scheduler.outputs import OutputProcessor
from radixserve.scheduler.parts import SchedulerParts
from radixserve.scheduler.policy import order_waiting, shares_uncached_prefix
from radixserve.scheduler.sample import Sample
from radixserve.scheduler.speculative import MAX_ROWS, Speculator
from radixserve.scheduler.tables import SampleTables

logger = logging.getLogger("radixserve.scheduler")

DEFER_SHARED_TOKENS = 32  # see policy.shares_uncached_prefix
COMPILE_POLL_S = 0.05  # an otherwise idle step waits this long for a pattern to compile


class QueueFullError(RuntimeError):
    """The waiting queue has no room: --max-queued-requests samples or --max-queued-tokens
    prompt tokens (HTTP 503, retry later)."""


@dataclass
class Work:
    """One sample's share of a step: `n` new positions starting at req.kv_len."""

    req: Sample
    n: int


@dataclass
class DecodeRun:
    """The last step, when it was a plain decode step (each sample one token on, no draft,
    no encode chunk) over a pool without sliding rows: the next step, if it decodes the
    same samples in the same order on the same paths, updates its batch instead of building
    one (ForwardBatch.follows)."""

    reqs: list[Sample]
    batch: ForwardBatch
    table_rows: list[int]  # each sample's row of the request-to-token table
    table_rows_t: torch.Tensor  # the same, (B,) int64
    logits_rows: torch.Tensor  # arange(B): every row's logits
    first_row: list[int]  # range(B)
    path_version: int
    nodes: set[int]  # every node on the samples' paths


class Scheduler:
    def __init__(self, config: EngineConfig, parts: SchedulerParts) -> None:
        self.config = config
        self.tokenizer, self.worker = parts.tokenizer, parts.worker
        mc = self.worker.model_config
        self.context_len = mc.max_position_embeddings
        self.eos_ids = frozenset(mc.eos_token_ids)
        self.cache = parts.cache
        req_pool = ReqToTokenPool(config.max_running_requests, self.context_len + 1)
        self.kv = KVManager(self.worker.pool, req_pool, self.cache)
        pool = self.worker.pool
        need = config.swa_rows_needed(pool.window)
        if pool.window and pool.swa_capacity < min(need, pool.capacity):
            raise ValueError(
                f"max_swa_tokens: {pool.swa_capacity} tokens of sliding-window K/V, a running "
                f"sample may hold {need} (window {pool.window}, chunked_prefill_size "
                f"{config.chunked_prefill_size}); raise it"
            )
        self.max_queued_tokens = config.max_queued_tokens or 4 * self.worker.pool.capacity
        self.out = OutputProcessor(mc.vocab_size, config.random_seed)
        self.speculator = Speculator(
            config.speculative_algorithm,
            config.speculative_num_draft_tokens,
            config.speculative_topk,
            self.cache,
            None if parts.drafter is None else DraftModel(parts.drafter),
        )
        self.grammars = parts.grammars
        self.compiling = PendingCompiles()  # requests whose pattern builds off this thread
        self.tables = SampleTables()  # waiting, running, each request's samples
        self.waiting, self.running = self.tables.waiting, self.tables.running
        self.finished_outputs: list[TokenDelta] = []
        self._arrival = itertools.count()
        self.prompt_tokens_total = self.cached_tokens_total = self.generation_tokens_total = 0
        self.computed_tokens_total = 0
        self.last_batch: ForwardBatch | None = None  # the tree view marks what it batched
        self._decode: DecodeRun | None = None
        self._new_slots: torch.Tensor | None = None  # a decode step's, from extend_each
        self._same_samples = False  # this step runs the last decode step's samples, in order
        served = config.served_model_name or config.model or Path(parts.model_path).name
        self.model_info = ModelInfo(
            model_path=config.model or parts.model_path,
            tokenizer_path=parts.model_path,
            served_model_name=served,
            context_len=self.context_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=tuple(sorted(self.eos_ids)),
            dtype=str(self.worker.dtype).removeprefix("torch."),
            kv_capacity_tokens=self.worker.pool.capacity,
            attention_backend=config.attention_backend,
        )

    # ---- receive -------------------------------------------------------------------
    def add_request(self, request: TokenizedRequest) -> None:
        """Queue a request. ValueError: it can never run; QueueFullError: try later.

        A pattern not compiled yet is built off this thread: the request waits in
        `compiling` and is queued later, or ends with finish "error" (400) if it fails.
        """
        self._validate(request)
        self._check_queue_room(request)
        grammar = self.grammars.compile_async(request.sampling)
        if grammar.done():  # nothing to build: queued now, or refused at once
            self._enqueue(request, grammar.result())
        else:
            self.compiling.add(request, grammar)

    def _check_queue_room(self, request: TokenizedRequest) -> None:
        """QueueFullError unless the queue (waiting + compiling) has room for all the
        request's samples and its prompt. A family waiting to fork counts n samples and one
        prompt; a retracted sample counts its prompt and its output so far."""
        queued = [(r.sampling.n if r.fork_pending else 1, r.seq_len) for r in self.waiting]
        queued += [(q.sampling.n, len(q.input_ids)) for q in self.compiling.requests]
        samples = request.sampling.n + sum(s for s, _ in queued)
        tokens = len(request.input_ids) + sum(t for _, t in queued)
        if samples > self.config.max_queued_requests or tokens > self.max_queued_tokens:
            raise QueueFullError(
                f"queue full: {samples} samples / {tokens} tokens with this request, at most "
                f"{self.config.max_queued_requests} / {self.max_queued_tokens}"
            )

    def _enqueue(self, request: TokenizedRequest, grammar: CompiledGrammar | None) -> None:
        req = self._new_req(request, 0, grammar)
        req.fork_pending = request.sampling.n > 1
        self.tables.queue(req)

    def _validate(self, request: TokenizedRequest) -> None:
        """What only the scheduler knows: the model's vocabulary, context and KV capacity,
        and the queue limits. The parameters themselves were checked where they were parsed."""
        ids, sp = request.input_ids, request.sampling
        assert ids, f"{request.rid}: an empty prompt is refused where it is tokenized"
        vocab = self.model_info.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"input_ids: token ids must be in [0, {vocab})")
        sp.validate(vocab)
        if request.modules is not None:
            self._validate_modules(request)
        span = request.num_positions
        if span + sp.max_new_tokens > self.context_len:
            raise ValueError(
                f"max_new_tokens: prompt ({span} positions) + max_new_tokens "
                f"({sp.max_new_tokens}) exceeds the context length {self.context_len}"
            )
        own = len(ids) - request.module_tokens  # slots of its own
        if own + sp.max_new_tokens > self.kv.pool.capacity - self.kv.modules.num_slots:
            raise ValueError(
                f"prompt + max_new_tokens ({own + sp.max_new_tokens}) exceeds the KV "
                f"pool ({self.kv.pool.capacity} tokens, {self.kv.modules.num_slots} pinned by "
                "prompt modules); raise --max-total-tokens"
            )
        if request.logprob_start_len >= len(ids):
            raise ValueError(f"logprob_start_len must be < prompt length {len(ids)}")
        if sp.n > self.config.max_queued_requests:
            raise ValueError(
                f"n: {sp.n} samples can never queue (--max-queued-requests "
                f"{self.config.max_queued_requests})"
            )
        if len(ids) > self.max_queued_tokens:
            raise ValueError(
                f"input_ids: the prompt ({len(ids)} tokens) can never queue "
                f"(--max-queued-tokens {self.max_queued_tokens})"
            )

    def _validate_modules(self, request: TokenizedRequest) -> None:
        self.kv.modules.check(request)
        if request.logprob_start_len >= 0:
            raise ValueError("logprob_start_len: no prompt logprobs with prompt modules")

    def _new_req(
        self, request: TokenizedRequest, index: int, grammar: CompiledGrammar | None
    ) -> Sample:
        stop = StopChecker(request.sampling, set(self.eos_ids), self.tokenizer)
        state = None if grammar is None else grammar.new_state()  # own state per sample
        return Sample(
            request=request,
            index=index,
            stop=stop,
            grammar=state,
            arrival=next(self._arrival),
            eos_ids=self.eos_ids,
        )

    def abort_request(self, rid: str) -> None:
        """Drop every sample of `rid` (compiling, queued or running); each reports finish
        'abort'."""
        self._end(rid, FinishReason("abort", "aborted by the client"))

    def _end(self, rid: str, reason: FinishReason) -> None:
        """Finish every sample of `rid` with `reason`, wherever it is."""
        for request in self.compiling.remove(rid):
            self._end_unqueued(request, reason)
        for req in self.tables.samples(rid):
            self._finish(req, reason)

    def _fail(self, rid: str, status: int, message: str) -> None:
        """Isolation (module docstring): end `rid` with finish "error"."""
        logger.warning("request %s failed (HTTP %d): %s", rid, status, message)
        self._end(rid, FinishReason("error", message, status))

    def _end_unqueued(self, request: TokenizedRequest, reason: FinishReason) -> None:
        """The n outputs of a request that never got a sample (its pattern was compiling)."""
        prompt = len(request.input_ids)
        self.finished_outputs.extend(
            TokenDelta(request.rid, i, [], reason, prompt_tokens=prompt)
            for i in range(request.sampling.n)
        )

    def _poll_compiles(self) -> None:
        built, failed = self.compiling.poll()
        for request, grammar in built:
            self._enqueue(request, grammar)
        for request, message in failed:
            logger.warning("request %s refused: %s", request.rid, message)
            self._end_unqueued(request, FinishReason("error", message, 400))

    # ---- schedule ------------------------------------------------------------------
    def _schedule(self) -> tuple[list[Work], list[EncodeChunk]]:
        """The running samples' next inputs, a chunk of a schema being encoded (its slots
        are pinned already), then admissions, within the step's prefill budget."""
        self.kv.trim_swa()
        retracted, lens = self._make_room()
        work = [Work(r, n) for r, n in zip(self.running, lens)]
        run = self._decode
        self._same_samples = run is not None and self._same(run, work)
        rows = run.table_rows_t if run is not None and self._same_samples else None
        self._new_slots = self.kv.extend_each([(w.req, w.n) for w in work], rows)
        budget = self.config.max_prefill_tokens - sum(w.n for w in work if w.n > 1)
        chunks = self.kv.modules.next_chunks(min(self.config.chunked_prefill_size, budget))
        encoded = sum(c.n for c in chunks)
        # admitting now would undo a retraction at once
        admitted = [] if retracted else self._admit(budget - encoded)
        if self.speculator.enabled:
            self._draft_all(work, admitted, sum(w.n for w in work + admitted) + encoded)
        return work + admitted, chunks

    def _next_lens(self) -> list[int]:
        """Each running sample's next input length: its prompt's next chunk, or 1."""
        chunk = self.config.chunked_prefill_size
        return [min(r.seq_len - r.kv_len, chunk) for r in self.running]

    def _draft_all(self, work: list[Work], admitted: list[Work], rows: int) -> None:
        """Drafts for the running samples' `work`, in order, while the step (`rows` rows so
        far, the `admitted` samples and encode chunks included) has fewer than MAX_ROWS
        rows; none for a sample whose prefix the attention backend attends as a segment
        shared with other samples of the step: its draft positions would each read that
        prefix again (the sample alone is one row of the segment), and round otherwise than
        the plain steps that attend it as a segment."""
        self.speculator.next_step(rows)
        if rows >= MAX_ROWS:
            return
        paths = {
            w.req: self.kv.path(w.req) for w in work + admitted if w.req.request.modules is None
        }
        sharing = Counter(node for path in paths.values() for node, _ in path)
        decoding = []
        for w in work:
            if not w.req.output_ids or w.req.seq_len - w.req.kv_len != 1:
                continue  # not decoding
            path = paths.get(w.req, [])
            shared = sum(tokens for node, tokens in path if sharing[node] > 1)
            if path and self.worker.backend.keeps(sharing[path[0][0]], shared, 1):
                continue
            decoding.append(w)
        drafts = self.speculator.propose([w.req for w in decoding], MAX_ROWS - rows)
        for w, draft in zip(decoding, drafts):
            # the pool frees slots for a draft by eviction, never by retracting
            if draft and self.kv.reserve(len(draft)):
                self.kv.extend(w.req, len(draft), skip=1)  # after the last token's slot
                w.req.draft = draft
                w.n += len(draft)

    def _make_room(self) -> tuple[bool, list[int]]:
        """Free slots for every running sample's next input; retract newest samples until
        that fits. Returns whether anything was retracted, and each running sample's next
        input length."""
        retracted = False
        while not self.kv.reserve(sum(lens := self._next_lens())) and self.running:
            victim = max(self.running, key=lambda r: r.arrival)
            logger.info("KV full: retracting %s (%d tokens)", victim.rid, victim.seq_len)
            self.tables.retract(victim)
            self.kv.release(victim)
            retracted = True
        return retracted, lens

    def _admit(self, budget: int) -> list[Work]:
        admitted: list[Work] = []
        order = order_waiting(list(self.waiting), self.cache, self.config.schedule_policy)
        # look ahead: the cache starts moving their KV up its tiers and spares it in evict
        prefixed = (r for r in order if r.request.modules is None)  # stops at the window
        ahead = itertools.islice(prefixed, self.config.hicache_prefetch_window)
        self.cache.prefetch([(r.all_ids[: r.reuse_limit()], r.salt) for r in ahead])
        for req in order:
            if budget <= 0 or len(self.running) >= self.config.max_running_requests:
                break
            if req.request.modules is None and shares_uncached_prefix(
                req, [w.req for w in admitted], DEFER_SHARED_TOKENS
            ):
                continue
            if not self.kv.admit(req):
                break
            n = min(req.seq_len - req.kv_len, self.config.chunked_prefill_size, budget)
            # room for its next decode steps too (all n samples' for a family about to fork);
            # alone, it takes what there is: it fits by itself (_validate), so it must run
            want = n + DECODE_RESERVE * (req.sampling.n if req.fork_pending else 1)
            if not self.kv.reserve(want if self.running else min(want, self.kv.available)):
                self.kv.unadmit(req)
                break
            self.kv.extend(req, n)
            self.tables.start(req)
            admitted.append(Work(req, n))
            budget -= n
        return admitted

    # ---- forward -------------------------------------------------------------------
    def _build_batch(
        self, work: list[Work], chunks: list[EncodeChunk]
    ) -> tuple[ForwardBatch, torch.Tensor, list[int]]:
        """The step's batch (the work, then the encode chunks: their logits are not used),
        the token rows needing logits, and each work's first such row.

        A sample drafted a tree of k nodes enters as 1 + k decode entries: its last token,
        then each node as the sequence up to it (the sample's sequence, the node's ancestors,
        the node: the K/V of every entry is written before any attends). Each row attends as
        a plain decode step of that sequence would, so its logits are those plain decoding
        computes. The first entry has the sample's radix path; the others none, so that the
        tree backend does not group a sample's entries with one another."""
        decode = not chunks and all(w.n == 1 and not w.req.draft and w.req.output_ids for w in work)
        run = self._decode
        if decode and run is not None and self._continues(run, work):
            return self._next_decode(run)
        self._decode = None
        taken = self._new_slots  # the running samples' (an admission takes its own)
        if decode and work and self.kv.pool.swa_of is None and taken is not None:
            if taken.numel() == len(work):
                return self._decode_batch([w.req for w in work], taken, run)
        entries = BatchBuilder()
        rows: list[int] = []
        first_row: list[int] = []
        for w in work:
            r, start, end = w.req, w.req.kv_len, w.req.kv_len + w.n
            t = entries.num_tokens
            slots = self.kv.slots(r, end)
            path = self.kv.path(r)
            first_row.append(len(rows))
            if r.draft:
                tree = r.draft
                pos = r.positions(start, start + 1 + tree.depth)
                entries.add(r.all_ids[start:], pos[:1], slots[: start + 1], path)
                for node, token in enumerate(tree.tokens):
                    up = [start + 1 + i for i in tree.path(node)]
                    entries.add(
                        [token], [pos[len(up)]], torch.cat([slots[: start + 1], slots[up]]), []
                    )
                rows.extend(range(t, t + w.n))
                continue
            entries.add(r.all_ids[start:end], r.positions(start, end), slots, path)
            rows.extend(range(t, t + w.n) if self._wants_all_logits(w) else [t + w.n - 1])
        for c in chunks:  # a module is its own sequence: no path, nothing shared
            chunk_ids, chunk_pos, slots = self.kv.modules.chunk_inputs(c)
            entries.add(chunk_ids, chunk_pos, slots, [])
        if not rows:  # only encoding: the worker computes some logits, never used
            rows.append(entries.num_tokens - 1)
        batch = entries.build(self.kv.pool)
        return batch, torch.tensor(rows, dtype=torch.int64), first_row

    def _decode_batch(
        self, reqs: list[Sample], new_slots: torch.Tensor, before: DecodeRun | None
    ) -> tuple[ForwardBatch, torch.Tensor, list[int]]:
        """A plain decode step's batch made from its samples, each one token on: their
        kept radix paths, their table rows (`TableRows`: nothing copied), the slots
        `KVManager.extend_each` took. Samples that joined or left since the step before
        cost only their own entries; the step becomes the decode run the next continues.
        `new_slots`: each sample's slot for its token; `before`: the last run, whose
        logits rows are reused when the size is the same."""
        kv_lens = [r.kv_len for r in reqs]
        seq_lens = [n + 1 for n in kv_lens]
        table_rows = [r.row for r in reqs if r.row is not None]
        assert len(table_rows) == len(reqs), "a decode step of a sample not admitted"
        rows_t = torch.tensor(table_rows, dtype=torch.int64)
        positions = [p for r, n in zip(reqs, kv_lens) for p in r.positions(n, n + 1)]
        batch = ForwardBatch(
            input_ids=torch.tensor([r.all_ids[n] for r, n in zip(reqs, kv_lens)]),
            positions=torch.tensor(positions, dtype=torch.int64),
            out_cache_loc=new_slots,
            seq_lens=seq_lens,
            extend_lens=[1] * len(reqs),
            kv_indices=TableRows(self.kv.req_pool.table, table_rows, seq_lens, rows_t),
            paths=[self.kv.path(r) for r in reqs],
            kv_pool=self.kv.pool,
        )
        if before is not None and len(before.reqs) == len(reqs):
            logits_rows, first_row = before.logits_rows, before.first_row
        else:
            logits_rows, first_row = torch.arange(len(reqs)), list(range(len(reqs)))
        self._decode = DecodeRun(
            reqs,
            batch,
            table_rows,
            rows_t,
            logits_rows,
            first_row,
            self.cache.path_version,
            {node for path in batch.paths for node, _ in path},
        )
        return batch, logits_rows, first_row

    @staticmethod
    def _same(run: DecodeRun, work: list[Work]) -> bool:
        """Whether `work` is `run`'s samples, in order."""
        return len(work) == len(run.reqs) and all(w.req is r for w, r in zip(work, run.reqs))

    def _continues(self, run: DecodeRun, work: list[Work]) -> bool:
        """Whether this decode step's `work` is `run`'s samples, in order (as the running
        ones were when scheduled, and none admitted), on the same paths: a sample's path
        changes only when it is admitted, caches a prefill (neither while it decodes) or a
        node on it is split."""
        if not self._same_samples or len(work) != len(run.reqs):
            return False
        version = self.cache.path_version
        if version != run.path_version:
            split = self.cache.split_since(run.path_version)
            if split is None or not split.isdisjoint(run.nodes):
                return False
            run.path_version = version
        return True

    def _next_decode(self, run: DecodeRun) -> tuple[ForwardBatch, torch.Tensor, list[int]]:
        """`run`'s batch one token further: each sample's next token, at the next position,
        in the slot `KVManager.extend_each` took for it this step."""
        before, new_slots = run.batch, self._new_slots
        assert new_slots is not None, "a decode step's slots were taken one by one"
        kv_lens = [r.kv_len for r in run.reqs]
        table = self.kv.req_pool.table
        seq_lens = [n + 1 for n in kv_lens]
        batch = ForwardBatch(
            input_ids=torch.tensor([r.all_ids[n] for r, n in zip(run.reqs, kv_lens)]),
            positions=before.positions + 1,
            out_cache_loc=new_slots,
            seq_lens=seq_lens,
            extend_lens=before.extend_lens,
            kv_indices=TableRows(table, run.table_rows, seq_lens, run.table_rows_t),
            paths=before.paths,
            kv_pool=self.kv.pool,
            follows=before,
        )
        before.follows = None  # only the step before is kept
        run.batch = batch
        return batch, run.logits_rows, run.first_row

    @staticmethod
    def _wants_all_logits(w: Work) -> bool:
        return w.req.wants_prompt_logprobs and not w.req.output_ids

    # ---- process results -----------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """Run one scheduling step; return the deltas of every sample that progressed."""
        self._poll_compiles()
        if not (self.waiting or self.running or self.finished_outputs or self.kv.modules.encoding):
            self.compiling.wait(COMPILE_POLL_S)  # only compiles pending: do not spin
        chunks: list[EncodeChunk] = []
        try:
            work, chunks = self._schedule()
            if work or chunks:
                self._forward(work, chunks)
        except AssertionError:  # a broken invariant of the cache or pool: the process ends
            raise
        except Exception as e:
            self._fail_step(e, chunks)
        self.speculator.keep_only(self.running)
        outputs, self.finished_outputs = self.finished_outputs, []
        outputs.extend(self.out.collect(r) for r in self.running if r.new_ids)
        return outputs

    def _forward(self, work: list[Work], chunks: list[EncodeChunk]) -> None:
        batch, rows, first_row = self._build_batch(work, chunks)
        start = time.perf_counter()
        logits = self.worker.forward(batch, rows)
        self.speculator.timed(time.perf_counter() - start, batch.input_ids.numel())
        self.last_batch = batch
        self.computed_tokens_total += batch.input_ids.numel()
        run = self._decode
        if run is not None and run.batch is batch:  # a plain decode step: one token each
            for req in run.reqs:
                req.kv_len += 1
            self._draw(list(zip(run.reqs, first_row)), logits)
        else:
            self._process(work, logits, first_row)
        self.kv.modules.encoded(chunks)

    def _fail_step(self, error: Exception, chunks: list[EncodeChunk]) -> None:
        """Isolation for a step that raised (the model's forward, the draft model's, a bug
        on the step's path): every running sample was in its batch, so each one's request
        ends with finish "error" (500), its slots and table row returned (`KVManager.release`
        frees those of the failed step too); a schema whose chunks the step encoded is
        dropped. The scheduler goes on with the next step (with TP ranks, whose collectives
        may be half done, the model worker refuses that step: the process ends)."""
        logger.exception("step failed: its requests end with an error")
        message = f"internal error: {type(error).__name__}: {error}"
        for rid in dict.fromkeys(r.rid for r in self.running):
            self._fail(rid, 500, message)
        for name in dict.fromkeys(c.schema for c in chunks):
            self.kv.pool.free(self.kv.modules.remove(name, message))

    def _process(self, work: list[Work], logits: torch.Tensor, first_row: list[int]) -> None:
        sampled: list[tuple[Sample, int]] = []  # (sample, logits row) to draw a token for
        drafted: list[tuple[Sample, int]] = []  # (sample, its first logits row) to verify
        for w, row0 in zip(work, first_row):
            if w.req.draft:  # the last token's K/V; the draft's is kept as it is accepted
                w.req.kv_len += 1
                drafted.append((w.req, row0))
                continue
            req, extended = w.req, w.n
            prompt_done_before = req.kv_len >= len(req.prompt_ids)
            req.kv_len += extended
            if self._wants_all_logits(w):
                self.out.prompt_logprobs(req, logits[row0 : row0 + extended], req.kv_len - extended)
            last = row0 + (extended - 1 if self._wants_all_logits(w) else 0)
            if extended > 1 or not prompt_done_before:
                self.kv.cache_prefix(req)  # a prefill (chunk): share it with later requests
            if req.kv_len < req.seq_len:
                continue  # more prompt chunks to go
            if not prompt_done_before and req.cached_tokens >= 0 and not req.output_ids:
                self.prompt_tokens_total += len(req.prompt_ids)
                self.cached_tokens_total += req.cached_tokens
            sampled.append((req, last))
            if req.fork_pending:
                sampled.extend((child, last) for child in self._fork(req))
        self._verify(drafted, logits)  # first: a failure in _sample may end a drafted sibling
        self._sample(sampled, logits)

    def _fork(self, parent: Sample) -> list[Sample]:
        """Create samples 1..n-1 of `parent`'s request sharing its prompt K/V."""
        parent.fork_pending = False
        children = []
        for i in range(1, parent.sampling.n):
            grammar = None if parent.grammar is None else parent.grammar.grammar
            child = self._new_req(parent.request, i, grammar)
            if self.kv.fork(parent, child):
                self.tables.run(child)
                children.append(child)
            else:  # the cache holds no prompt K/V (NoPrefixCache) or no free row: prefill later
                self.tables.queue(child)
        return children

    def _sample(self, sampled: list[tuple[Sample, int]], logits: torch.Tensor) -> None:
        draw = [(r, row) for r, row in sampled if r.sampling.max_new_tokens > 0]
        for req, _ in sampled:
            if req.sampling.max_new_tokens == 0:  # prefill only: the prompt is now cached
                self._finish(req, FinishReason("length"))
        if draw:
            self._draw(draw, logits)

    def _draw(self, draw: list[tuple[Sample, int]], logits: torch.Tensor) -> None:
        """A token for each (sample, logits row) of `draw`; end the samples that finish."""
        drawn, failures = self.out.draw(draw, logits)
        for req, status, message in failures:
            self._fail(req.rid, status, message)
        for req, token, lp, top in drawn:
            if not req.finished:  # else a sibling sample failed this step
                self._end_if(req, self._take(req, token, lp, top))

    def _verify(self, drafted: list[tuple[Sample, int]], logits: torch.Tensor) -> None:
        """Draw each drafted sample's tokens one position at a time, from its last token's
        logits, then from those of the tree node holding the token just drawn, for as long as
        one does (speculative.py); then keep the K/V of the nodes kept in their positions,
        free the others', and end the samples that finished."""
        start = {req: req.kv_len for req, _ in drafted}
        first_row = dict(drafted)
        kept: dict[Sample, list[int]] = {req: [] for req, _ in drafted}
        ends: list[tuple[Sample, FinishReason]] = []
        live = [(req, row, ROOT) for req, row in drafted]  # (sample, logits row, its node)
        while live:
            drawn, failures = self.out.draw([(r, row) for r, row, _ in live], logits)
            ends += [(r, FinishReason("error", message, status)) for r, status, message in failures]
            at = {r: node for r, _, node in live}
            going = []
            for req, token, lp, top in drawn:
                reason = self._take(req, token, lp, top)
                node = req.draft.child(at[req], token)
                if reason is not None:
                    ends.append((req, reason))
                elif node is not None:
                    kept[req].append(node)  # its K/V, computed this step, is kept
                    going.append((req, first_row[req] + 1 + node, node))
            live = going
        for req, _ in drafted:
            self.kv.settle_draft(req, start[req], len(req.draft), kept[req])
            req.kv_len += len(kept[req])
            self.speculator.record(req, req.draft, kept[req])
            req.draft = Draft()
        for req, reason in ends:
            if not req.finished:
                self._end_if(req, reason)

    def _take(
        self, req: Sample, token: int, logprob: float, top: list[TokenLogprob]
    ) -> FinishReason | None:
        """Append a drawn token to `req`; why it finishes, if it does. A failure on this
        request's path is an "error" reason with its HTTP status: it alone fails."""
        try:
            self.out.append_token(req, token, logprob, top)
            self.generation_tokens_total += 1
            reason = req.stop.check(req.output_ids)
            if req.grammar is not None and req.grammar.terminated:
                reason = self._grammar_finish(token, reason)
            return reason
        except UnservablePattern as e:  # the pattern, not a bug
            return FinishReason("error", str(e), 422)
        except Exception as e:  # a bug on this request's path
            logger.exception("request %s: error after sampling", req.rid)
            return FinishReason("error", f"internal error: {type(e).__name__}: {e}", 500)

    def _end_if(self, req: Sample, reason: FinishReason | None) -> None:
        """End `req` for `reason` (an error ends every sample of its request)."""
        if reason is None:
            return
        if reason.type == "error":
            assert reason.status is not None and isinstance(reason.matched, str)
            self._fail(req.rid, reason.status, reason.matched)
        else:
            self._finish(req, reason)

    def _grammar_finish(self, token: int, reason: FinishReason | None) -> FinishReason:
        """The pattern is complete (eos taken, or nothing but eos may follow): "stop", unless
        a stop token or string already stopped it. Overrides "length" and ignore_eos."""
        if reason is not None and reason.type == "stop":
            return reason
        return FinishReason("stop", matched=token if token in self.eos_ids else None)

    def _finish(self, req: Sample, reason: FinishReason) -> None:
        req.finish_reason = reason
        if self.tables.drop(req):
            self.kv.release(req)
        self.finished_outputs.append(self.out.collect(req))
        if req.fork_pending:  # ended before its prompt was done: samples 1..n-1 never began
            req.fork_pending = False
            self.finished_outputs.extend(
                TokenDelta(req.rid, i, [], reason, prompt_tokens=len(req.prompt_ids))
                for i in range(1, req.sampling.n)
            )

    # ---- management ----------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.running
            or self.finished_outputs
            or self.compiling
            or self.kv.modules.encoding
        )

    def flush_cache(self) -> bool:
        if self.waiting or self.running:
            return False
        self.cache.flush()
        return True

    def check_integrity(self) -> None:
        """The KV accounting and cached paths (KVManager), the sample tables, and each queued
        or running sample's token list."""
        self.tables.check()
        self.kv.check_integrity(list(self.running))
        for r in itertools.chain(self.waiting, self.running):
            assert r.all_ids == r.prompt_ids + r.output_ids, f"{r.rid}: all_ids out of step"

    # ---- prompt modules --------------------------------------------------------------
    def register_schema(self, schema: CompiledSchema, on_done: SchemaDone) -> None:
        """Pin slots for every module of `schema` (evicting unlocked cache entries for room)
        and start encoding it: the next steps compute it beside their other work, and
        `on_done(None)` runs once it is usable (see ModuleStore). ValueError, at once: the
        name is taken, the schema does not fit the context, or the pool cannot hold it."""
        self.kv.modules.register(schema, on_done, self.context_len, self.kv)

    def remove_schema(self, name: str) -> None:
        """Free schema `name`'s K/V (one still being encoded stops: its registration hears
        why). ValueError: unknown, or a request still imports it."""
        queued = [r.request for r in itertools.chain(self.waiting, self.running)]
        self.kv.pool.free(self.kv.modules.unregister(name, queued + self.compiling.requests))

    def schemas(self) -> list[dict[str, object]]:
        """Every registered schema: name, each module's tokens, positions it spans, and
        whether it is "ready" or still "encoding"."""
        return self.kv.modules.describe()

    def stats(self) -> SchedulerStats:
        pool, modules = self.kv.pool, self.kv.modules.num_slots
        return SchedulerStats(
            num_running=len(self.running),
            num_queued=len(self.waiting) + len(self.compiling),
            kv_used_tokens=pool.capacity - pool.num_free,
            kv_capacity_tokens=pool.capacity,
            kv_held_tokens=pool.capacity - pool.num_free - self.cache.evictable_size - modules,
            kv_module_tokens=modules,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_tokens_total=self.cached_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            computed_tokens_total=self.computed_tokens_total,
            draft_tokens_total=self.speculator.stats.proposed,
            accepted_draft_tokens_total=self.speculator.stats.accepted,
            tiers=self.cache.tier_stats(),
        )

    def cache_tree(
        self, max_nodes: int, max_depth: int, tenant: str | None = None
    ) -> CacheTreeView:
        """A bounded snapshot of the prefix cache's tree (`kvcache/tree_view.py`), with the
        running samples' paths and the nodes the last step's tree attention batched; only
        the parts of `tenant`'s salts when it is set."""
        running = [r.last_node for r in self.running if r.last_node is not None]
        batched = batched_nodes(self.last_batch) if self.last_batch is not None else set()
        backend = self.config.attention_backend
        return snapshot(
            self.cache, max_nodes, max_depth, running, batched, self.stats(), backend, tenant
        )

    def run_until_idle(self) -> Iterable[TokenDelta]:
        while self.has_work():
            yield from self.step()
