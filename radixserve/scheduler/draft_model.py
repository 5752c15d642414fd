"""Drafts from a smaller model of the same vocabulary (`--speculative-algorithm draft-model`).

The draft model keeps the K/V of each drafting sample's sequence in a pool of its own; a
sample's sequence starts with the K/V of the longest start it shares with another sample of
its request (the prompt of n samples is computed once), held by both. Drafting k tokens for
a batch of samples takes k steps of the draft model: the first feeds each sample the tokens
it has not seen yet (at most CATCH_UP of them: a sample further behind gets no draft this
step and catches up over the next ones), each later one feeds the token just drafted.
Drafts are greedy. The K/V of draft tokens the target did not keep goes back to the pool on the next
call, where the draft model's sequence and the sample's part ways.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.core.batch import BatchBuilder
from radixserve.scheduler.req import Req

if TYPE_CHECKING:
    from radixserve.scheduler.parts import StepWorker

CATCH_UP = 512  # tokens a sample's draft sequence advances by at most in one step
EMA_WEIGHT = 0.2  # of a step's time in the running averages of step times


def ema(average: float | None, sample: float) -> float:
    """A running average of step times: each new sample weighs EMA_WEIGHT."""
    return sample if average is None else average + EMA_WEIGHT * (sample - average)


@dataclass
class DraftSeq:
    """What the draft model holds of one sample: the tokens whose K/V is in its pool."""

    ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    known: int = 0  # ids[:known] are the sample's own tokens (so they stay its)


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """The length of a's and b's common start, given that their first `start` agree."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModel:
    """Greedy drafts from `worker` (a model worker over its own KV pool)."""

    def __init__(self, worker: StepWorker) -> None:
        self.worker = worker
        self.seqs: dict[Req, DraftSeq] = {}
        self.refs = torch.zeros(worker.pool.num_slots, dtype=torch.int32)  # seqs holding a slot
        self.step_s: float | None = None  # seconds a step feeding one token a sample takes

    def keep_only(self, samples: Iterable[Req]) -> None:
        """Free the sequences of samples not among `samples` (ended, retracted)."""
        live = set(samples)
        for req in [r for r in self.seqs if r not in live]:
            self._trim(self.seqs.pop(req), 0)

    def draft(self, wants: list[tuple[Req, int]]) -> list[list[int]]:
        """For each (sample, k): up to k tokens the draft model expects after the sample's
        sequence ([] when k is 0, the sample is more than CATCH_UP tokens behind, another
        sample of its request starts its sequence in this call, or the pool has no room)."""
        drafts: list[list[int]] = [[] for _ in wants]
        feeds: dict[int, list[int]] = {}  # by index into wants: the tokens to feed next
        started: set[int] = set()  # the requests (ids) a sample started a sequence of
        for i, (req, k) in enumerate(wants):
            if k <= 0 or (req not in self.seqs and id(req.request) in started):
                continue  # (the second starts next step, from the K/V the first computes)
            if req not in self.seqs:
                started.add(id(req.request))
                self._start(req)
            seq = self.seqs[req]
            # the sample's last token is always fed: its logits give the first draft token
            same = common_prefix(seq.ids, req.all_ids, seq.known)
            self._trim(seq, min(same, len(req.all_ids) - 1))
            seq.known = len(seq.ids)
            feeds[i] = req.all_ids[len(seq.ids) : len(seq.ids) + CATCH_UP]
        caught_up = [
            i for i, feed in feeds.items()
            if len(self.seqs[wants[i][0]].ids) + len(feed) == len(wants[i][0].all_ids)
        ]  # fmt: skip
        while feeds:
            tokens = self._step(wants, feeds, caught_up)
            feeds = {}
            for i, token in zip(caught_up, tokens):
                if token is not None:
                    drafts[i].append(token)
                    if len(drafts[i]) < wants[i][1]:
                        feeds[i] = [token]
            caught_up = list(feeds)
        return drafts

    def _step(
        self, wants: list[tuple[Req, int]], feeds: dict[int, list[int]], caught_up: list[int]
    ) -> list[int | None]:
        """One step of the draft model over `feeds`; the greedy next token of each sample in
        `caught_up` (None for one the pool had no room for)."""
        entries = BatchBuilder()
        last_row: dict[int, int] = {}
        for i, feed in feeds.items():
            req = wants[i][0]
            seq = self.seqs[req]
            slots = self.worker.pool.alloc(len(feed))
            if slots is None:  # the pool is full: this sample drafts nothing, and frees room
                self._trim(self.seqs.pop(req), 0)
                continue
            start = len(seq.ids)
            self.refs[slots] = 1
            seq.ids += feed
            seq.slots += slots.tolist()
            entries.add(feed, list(range(start, len(seq.ids))), torch.tensor(seq.slots), [])
            last_row[i] = entries.num_tokens - 1
        if not last_row:
            return [None] * len(caught_up)
        wanted = [i for i in caught_up if i in last_row]
        batch = entries.build(self.worker.pool)
        rows = [last_row[i] for i in wanted] or [entries.num_tokens - 1]
        began = time.perf_counter()
        best = self.worker.forward(batch, torch.tensor(rows)).argmax(dim=-1).tolist()
        if batch.is_decode:  # a step of drafted tokens, no catching up
            self.step_s = ema(self.step_s, time.perf_counter() - began)
        token = dict(zip(wanted, best))
        return [token.get(i) for i in caught_up]

    def _start(self, req: Req) -> None:
        """A sequence for `req`: the K/V of the longest start it shares with another sample
        of its request, held by both."""
        seq = DraftSeq()
        for other, held in self.seqs.items():
            if other.request is req.request:
                n = min(common_prefix(held.ids, req.all_ids), len(req.all_ids) - 1)
                if n > len(seq.ids):
                    seq = DraftSeq(held.ids[:n], held.slots[:n], n)
        self.refs[torch.tensor(seq.slots, dtype=torch.int64)] += 1
        self.seqs[req] = seq

    def _trim(self, seq: DraftSeq, n: int) -> None:
        """Keep the first `n` tokens of `seq`; the slots after that that no other sequence
        holds go back to the pool."""
        if len(seq.slots) > n:
            dropped = torch.tensor(seq.slots[n:], dtype=torch.int64)
            self.refs[dropped] -= 1
            self.worker.pool.free(dropped[self.refs[dropped] == 0])
        del seq.ids[n:], seq.slots[n:]
        seq.known = min(seq.known, n)
