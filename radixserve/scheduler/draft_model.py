"""Drafts from a smaller model of the same vocabulary (`--speculative-algorithm draft-model`).

The draft model keeps the K/V of each drafting sample's sequence in a pool of its own; a
sample's sequence starts with the K/V of the longest start it shares with another sample of
its request (the prompt of n samples is computed once), held by both. Drafting for a batch
of samples takes up to k steps of the draft model: the first feeds each sample the tokens
it has not seen yet (at most CATCH_UP of them: a sample further behind gets no draft this
step and catches up over the next ones), each later one feeds the token just drafted, the
draft model's likeliest.

A draft is a token tree of k nodes (draft_tree.py): the greedy chain, and beside each of
its tokens the draft model's next likeliest ones (up to topk in all), as leaves. A node's
chance of being kept is its parent's times: for a chain token, the share of draft tokens
the model has kept lately (measured, not the draft model's probability: a draft model that
agrees with the model has its likeliest token kept even where it hesitates); for a leaf,
the rest, times the draft model's probability of the leaf's token among all but the
chain's. The tree keeps the k likeliest nodes: the chain where the model keeps most draft
tokens, the runners-up of the first tokens where it keeps few. Drafting stops once the next
chain token could no longer be among the k likeliest. The K/V of draft tokens the target
did not keep goes back to the pool on the next call, where the draft model's sequence and
the sample's part ways.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.core.batch import BatchBuilder
from radixserve.scheduler.draft_tree import ROOT, Draft, likeliest
from radixserve.scheduler.sample import Sample

if TYPE_CHECKING:
    from radixserve.scheduler.parts import StepWorker

CATCH_UP = 512  # tokens a sample's draft sequence advances by at most in one step
EMA_WEIGHT = 0.2  # of a step's time in the running averages of step times
AGREE_PRIOR = 0.5  # the share of draft tokens kept assumed before any was verified
AGREE_WINDOW = 256  # draft positions verified that the share kept is measured over, about


def ema(average: float | None, sample: float) -> float:
    """A running average of step times: each new sample weighs EMA_WEIGHT."""
    return sample if average is None else average + EMA_WEIGHT * (sample - average)


@dataclass
class DraftSeq:
    """What the draft model holds of one sample: the tokens whose K/V is in its pool."""

    ids: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    known: int = 0  # ids[:known] are the sample's own tokens (so they stay its)


@dataclass
class Growing:
    """A draft tree being grown along the draft model's greedy chain, given the share of
    the draft model's likeliest tokens that the model keeps (`agree`)."""

    agree: float
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    chances: list[float] = field(default_factory=list)  # of each node being kept
    tail: int = ROOT  # the chain's last node
    chance: float = 1.0  # the tail's
    steps: int = 0  # chain tokens

    def add(self, likeliest: list[tuple[int, float]]) -> None:
        """The draft model's likeliest tokens after the tail (with their probabilities,
        likeliest first): the first continues the chain, kept with chance `agree`; the
        others are leaves, each kept with the rest times the draft model's probability of
        it among the tokens but the first."""
        parent, chance = self.tail, self.chance
        self.tail = len(self.tokens)
        self.steps += 1
        others = 1 - likeliest[0][1]
        for j, (token, p) in enumerate(likeliest):
            self.tokens.append(token)
            self.parents.append(parent)
            if j == 0:
                share = self.agree
            else:
                share = (1 - self.agree) * p / others if others > 0 else 0.0
            self.chances.append(chance * share)
        self.chance = self.chances[self.tail]

    def grows(self, k: int) -> bool:
        """Whether a next chain token could be among the k likeliest nodes."""
        if self.steps >= k:
            return False
        return len(self.tokens) < k or sorted(self.chances, reverse=True)[k - 1] < self.chance

    def tree(self, k: int, topk: int) -> Draft:
        return likeliest(self.tokens, self.parents, [-c for c in self.chances], k, topk)


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
        self.max_positions = worker.model_config.max_position_embeddings
        self.seqs: dict[Sample, DraftSeq] = {}
        self.refs = torch.zeros(worker.pool.num_slots, dtype=torch.int32)  # seqs holding a slot
        self.step_s: float | None = None  # seconds a step feeding one token a sample takes
        # of the draft positions verified lately, those the model kept (AGREE_PRIOR at start)
        self.kept, self.tried = AGREE_PRIOR, 1.0

    @property
    def agree(self) -> float:
        """The share of verified draft positions the model kept, lately."""
        return self.kept / self.tried

    def learn(self, kept: int, missed: bool) -> None:
        """A draft had `kept` tokens kept, and then (`missed`) one position not."""
        self.kept += kept
        self.tried += kept + missed
        if self.tried > AGREE_WINDOW:  # older positions count half
            self.kept, self.tried = self.kept / 2, self.tried / 2

    def keep_only(self, samples: Iterable[Sample]) -> None:
        """Free the sequences of samples not among `samples` (ended, retracted)."""
        live = set(samples)
        for req in [r for r in self.seqs if r not in live]:
            self._trim(self.seqs.pop(req), 0)

    def draft(self, wants: list[tuple[Sample, int]], topk: int) -> list[Draft]:
        """For each (sample, k): a tree of up to k nodes, at most `topk` under one, of what
        the draft model expects after the sample's sequence (empty when k is 0, the sample
        is more than CATCH_UP tokens behind, another sample of its request starts its
        sequence in this call, or the pool has no room); fewer nodes where the draft
        model's context ends (max_position_embeddings), none past it."""
        # positions past the draft model's context have no RoPE row: a draft of k tokens
        # feeds the sample's tokens and k - 1 drafted ones, up to position seq_len + k - 2
        wants = [(req, min(k, self.max_positions + 1 - req.seq_len)) for req, k in wants]
        growing = [Growing(self.agree) for _ in wants]
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
            tops = self._step(wants, feeds, caught_up, topk)
            feeds = {}
            for i, top in zip(caught_up, tops):
                if top is not None:
                    growing[i].add(top)
                    if growing[i].grows(wants[i][1]):
                        feeds[i] = [top[0][0]]
            caught_up = list(feeds)
        return [g.tree(k, topk) for g, (_, k) in zip(growing, wants)]

    def _step(
        self,
        wants: list[tuple[Sample, int]],
        feeds: dict[int, list[int]],
        caught_up: list[int],
        topk: int,
    ) -> list[list[tuple[int, float]] | None]:
        """One step of the draft model over `feeds`; for each sample in `caught_up`, its
        `topk` likeliest next tokens and their probabilities, likeliest first (None for one
        the pool had no room for)."""
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
        logits = self.worker.forward(batch, torch.tensor(rows))
        probs, tokens = torch.softmax(logits.float(), dim=-1).topk(topk, dim=-1)
        if batch.is_decode:  # a step of drafted tokens, no catching up
            self.step_s = ema(self.step_s, time.perf_counter() - began)
        top = {i: list(zip(t, p)) for i, t, p in zip(wanted, tokens.tolist(), probs.tolist())}
        return [top.get(i) for i in caught_up]

    def _start(self, req: Sample) -> None:
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
