"""Speculative decoding: drafts of a decoding sample's next tokens, verified in one step.

A drafter proposes a token tree of what may follow a sample's sequence (draft_tree.py). The
step feeds the sample's last token and the tree's nodes together (1 + k rows, every row's
logits kept; the scheduler lays them out), then draws the sample's tokens one position at a
time, exactly as plain decoding would: from the last token's logits, then from those of the
node holding the token just drawn, for as long as a node holds it. The first drawn token no
node holds, or that ends the sample, is the last one of the step; the K/V of the nodes kept
moves into the sample's next positions and the rest goes back to the pool.

Every token kept is the one plain decoding draws from the same logits with the same random
number (a seeded sample's uniform is keyed by its output index), so greedy output is
unchanged, and sampled output follows the model's distribution: every token is drawn from
the model's own probabilities, and the tree only decides which logits are ready (for a
chain, this is the speculative-sampling rule for a deterministic draft: drawing from p and
going on while the draw equals the draft token d accepts d with probability p(d)).
Penalties, grammars (a draft token the grammar forbids is never drawn), stop conditions and
logprobs apply per position as in plain decoding.

Drafters (`--speculative-algorithm`), each merging what it finds into a tree of at most
`--speculative-topk` branches under a node (draft_tree.weighted_tree):
- `ngram`: the sample's own prompt and output (prompt lookup, ngram.py): the tokens that
  followed earlier occurrences of its last tokens, the longest matches among the latest;
- `radix`: the prefix cache, in the sample's salt only (kvcache/radix.py: a draft never
  proposes what only requests of another salt sent): the cached sequences that extend the
  sample's whole sequence (other samples of the same prompt, a repeated request), one a
  branch; else the tokens that followed the sample's last tokens anywhere in its part of
  the cache (its suffix index, kvcache/suffix_index.py: another request's answer, the same
  text under another prefix, such as a system prompt that names the date);
- `draft-model`: the cached sequences that extend the sample's, else a smaller model of the
  same vocabulary (draft_model.py: its greedy chain and its runners-up);
- `auto` (the default): radix's extending sequences, else the longer match of the cache's
  suffix index and ngram (ngram on a tie); `none`: no speculation.

Adaptive, per request (its samples together): a draft holds at most the request's pace,
which starts at `--speculative-num-draft-tokens`, doubles (up to it) after a draft whose
longest branch was kept whole, and falls to one more than the tokens kept otherwise, never below
MIN_DRAFT: a long draft where drafts keep being kept, a short one where they fail early
(each draft row costs a fraction of a step, so a short draft that often fails costs
little). A step costs about as much as STEP_ROWS extra rows, so in a step of w rows
without drafts a kept draft token saves about (w + STEP_ROWS) / w rows' time and a draft
row costs one: a MIN_DRAFT draft of which less than w / (w + STEP_ROWS) was kept (alone:
none; beside 7 other rows: at most one of two) pauses the request's samples 2^misses steps
(up to MAX_PAUSE), so a workload with nothing to draft runs as without speculation.

A draft model's drafts cost its steps too. The scheduler times every step; a draft model
step, in rows of the model's step (seconds a row, STEP_ROWS included, against the draft
model's seconds a step, both running averages), is shared by the samples it drafts for,
and that share is added to the row each draft position costs: where it reaches
STEP_ROWS / w, not even a draft kept whole pays, and the draft model does not run (an
expensive draft model drafts for a sample alone, not for a wide batch); the pause rule
counts it too.

A step with drafts holds at most MAX_ROWS token rows, drafts, admissions and encode chunks
included: the quantized linears' weight-streaming regime (a row there costs a fraction of a
pass over the weights, and each row's result does not depend on the rows beside it), below
the rows from which a bf16 model's linears take bf16 tiles, which round otherwise. A wider
step is compute-bound, and verifying drafts there costs more than it saves: 16 samples of
one GSM8K question decoding together draft nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from radixserve.config import SPECULATIVE_ALGORITHMS
from radixserve.kvcache.prefix_cache import PrefixCache
from radixserve.scheduler.draft_model import DraftModel, ema
from radixserve.scheduler.draft_tree import ROOT, Draft, weighted_tree
from radixserve.scheduler.sample import Sample

MAX_PAUSE = 64  # steps a request whose drafts miss waits at most before drafting again
MIN_DRAFT = 2  # tokens a request's pace never falls below
# What a step costs beyond its rows, in rows: SmolLM2-135M in bf16, Zen 4, ~600 keys: one
# row 11.6 ms, 9 rows 25.4 ms (1.7 ms a row, the step's own ~10 ms = ~6 rows).
STEP_ROWS = 6
MAX_ROWS = 16  # token rows a step with drafts holds at most (within every Format.small_m)


@dataclass
class DraftStats:
    proposed: int = 0  # draft tokens fed to the model
    accepted: int = 0  # of those, tokens kept


@dataclass
class Pace:
    """How one running request drafts."""

    length: int  # tokens its next draft holds at most
    misses: int = 0  # MIN_DRAFT drafts in a row that kept too little to pay
    resume: int = 0  # the step from which its samples draft again


class Speculator:
    """Proposes drafts for decoding samples and learns, per request, how long they pay."""

    def __init__(
        self,
        algorithm: str,
        num_draft_tokens: int,
        topk: int,
        cache: PrefixCache,
        drafter: DraftModel | None = None,
    ) -> None:
        assert algorithm in SPECULATIVE_ALGORITHMS, algorithm
        assert (algorithm == "draft-model") == (drafter is not None), algorithm
        self.algorithm = algorithm
        self.num_draft_tokens = num_draft_tokens
        self.topk = topk  # branches under one node of a draft tree at most
        self.cache = cache
        self.drafter = drafter
        self.stats = DraftStats()
        self.steps = 0  # steps scheduled so far
        self.rows = 1  # the current step's rows without drafts
        self.paces: dict[str, Pace] = {}  # by rid, the running requests asked for drafts
        self.row_s: float | None = None  # a model step's seconds per row, STEP_ROWS included
        self.draft_rows = 0.0  # a draft model step's share of a draft position, in rows
        self.modelled: set[Sample] = set()  # the samples whose draft the draft model made

    def next_step(self, rows: int) -> None:
        """A step of `rows` rows (before drafts) is being scheduled."""
        self.steps += 1
        self.rows = rows
        self.modelled = set()

    def timed(self, seconds: float, rows: int) -> None:
        """The model's step of `rows` rows (drafts included) took `seconds`."""
        self.row_s = ema(self.row_s, seconds / (rows + STEP_ROWS))

    def keep_only(self, running: Collection[Sample]) -> None:
        """Forget the samples not `running` (ended, aborted, retracted): their requests'
        paces, their draft model K/V."""
        if self.paces:
            for rid in self.paces.keys() - {r.request.rid for r in running}:
                del self.paces[rid]
        if self.drafter is not None:
            self.drafter.keep_only(running)

    @property
    def enabled(self) -> bool:
        return self.algorithm != "none" and self.num_draft_tokens > 0

    def _pace(self, rid: str) -> Pace:
        return self.paces.setdefault(rid, Pace(self.num_draft_tokens))

    def propose(self, samples: list[Sample], room: int) -> list[Draft]:
        """A token tree for each of the decoding `samples` (empty for none), at most `room`
        tokens in all, given out in order. A sample's last token's K/V is what the step
        computes."""
        if self.drafter is not None:  # the radix cache's drafts cost no draft model steps
            cached: list[Draft] = []
            wants = []
            for req in samples:
                k = self._budget(req, room)
                found = self.cache.continuations(req.all_ids, k, salt=req.salt)
                cached.append(weighted_tree(found, k, self.topk))
                wants.append((req, 0 if cached[-1] else k))
                room -= k
            drafting = sum(k > 0 for _, k in wants)
            self.draft_rows = 0.0  # a draft model step's share of each draft position, in rows
            if drafting and self.row_s is not None and self.drafter.step_s is not None:
                self.draft_rows = self.drafter.step_s / self.row_s / drafting
            if self.draft_rows * self.rows >= STEP_ROWS:  # would not pay even kept whole
                wants = [(req, 0) for req, _ in wants]
            modelled = self.drafter.draft(wants, self.topk)
            self.modelled = {req for (req, k), m in zip(wants, modelled) if k > 0 and m}
            return [c or m for c, m in zip(cached, modelled)]
        drafts = []
        for req in samples:
            k = self._budget(req, room)
            draft = weighted_tree(self._lookup(req, k), k, self.topk)
            drafts.append(draft)
            room -= len(draft)
        return drafts

    def _lookup(self, req: Sample, k: int) -> list[list[int]]:
        """The continuations of up to `k` tokens the model-free drafters find for `req`
        (module docstring)."""
        if k <= 0:
            return []
        match = 0
        found: list[list[int]] = []
        if self.algorithm in ("auto", "radix"):
            extends = self.cache.continuations(req.all_ids, k, salt=req.salt)
            if extends:
                return extends
            match, found = self.cache.suffix_continuations(req.all_ids, k, salt=req.salt)
        if self.algorithm in ("auto", "ngram"):
            own_match, own = req.ngrams.draft(req.all_ids, k)
            if own_match >= match:
                found = own
        return found

    def _budget(self, req: Sample, room: int) -> int:
        """The most tokens `req`'s draft may hold this step (0: no draft)."""
        pace = self._pace(req.request.rid)
        if self.steps < pace.resume or req.request.modules is not None:
            return 0
        # each step yields at most 1 + k tokens, and the last one needs no K/V
        left = req.sampling.max_new_tokens - len(req.output_ids) - 1
        return max(0, min(pace.length, left, room))

    def record(self, req: Sample, draft: Draft, kept: list[int]) -> None:
        """The nodes `kept` (a path) of `req`'s `draft` were kept this step."""
        proposed, accepted = len(draft), len(kept)
        if self.drafter is not None and req in self.modelled:
            last = kept[-1] if kept else ROOT
            self.drafter.learn(accepted, missed=last in draft.parents)
        self.stats.proposed += proposed
        self.stats.accepted += accepted
        pace = self._pace(req.request.rid)
        if accepted == draft.depth:
            pace.length = min(self.num_draft_tokens, 2 * pace.length)
        else:
            pace.length = min(self.num_draft_tokens, max(MIN_DRAFT, accepted + 1))
        w = self.rows
        per_token = 1 + (self.draft_rows if req in self.modelled else 0)  # rows a draft token costs
        if proposed > MIN_DRAFT or accepted * (w + STEP_ROWS) >= per_token * proposed * w:
            pace.misses = 0
        else:
            pace.misses += 1
            pace.resume = self.steps + min(2**pace.misses, MAX_PAUSE)
