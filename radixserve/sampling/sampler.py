"""Batched next-token sampling, logprobs of the chosen tokens, and prompt logprobs.

Contract of `sample(logits, infos, generator)` (`infos`: a list of SamplingInfo, or a
`SamplingBatch` of them kept from an earlier call with the same rows):
  - reads `logits` (B, vocab) float32, one row per sample, and returns it as it was:
    penalties and masks are applied to it in place for the draw and undone before `sample`
    returns or raises (the entries they touch are saved first: no copy of the batch);
  - reads every `SamplingInfo` and mutates none of them (the caller appends the token and
    advances the grammar state; `allowed_tokens()` only reads it); advances `generator`;
  - raises AssertionError on shape/dtype mismatch (a programming error), and `BadRows` when
    some rows cannot be drawn from: NaN/inf in the model's logits, or no finite logit left
    after penalties and masks (e.g. a grammar allowing only tokens that stop_token_ids bans
    during min_new_tokens), leaving `generator` as it was. Rows are independent: the caller
    can drop the bad rows and sample the others again.

Per row, in this order (SGLang/HF/OpenAI semantics):
  1. repetition penalty over prompt+output tokens (HF: positive logits divided by the
     penalty, negative logits multiplied by it; each distinct token once);
  2. frequency/presence penalties over output tokens (OpenAI:
     l -= frequency_penalty * count + presence_penalty * (count > 0));
  2b. logit_bias: each row's {token id: bias} added to those logits (OpenAI: -100 all but
     bans a token, +100 all but forces it; greedy rows included);
  3. min_new_tokens: while len(output_ids) < min_new_tokens, eos ids and stop_token_ids get
     -inf (also with ignore_eos, which only means that eos does not stop);
  3b. grammar (regex / json_schema): tokens the row's grammar state does not allow get -inf
     (greedy rows included), so every later step only sees allowed tokens;
  4. temperature: 0 (or top_k == 1) -> exact argmax of the logits after 1-3b, no randomness;
     otherwise probs = softmax(l / T);
  5. top_k, 6. top_p (on the distribution left by top_k), 7. min_p (relative to the top
     probability). Each filter is a probability threshold and a token survives when its
     probability is >= the largest of the three thresholds, so tied tokens are kept or
     dropped together and the kept set never depends on tie-breaking order;
  8. draw by inverse CDF over the kept probabilities in vocabulary order with ONE uniform u.

On CPU with native ops, steps 4-8 of a batch without top_k / top_p / min_p run as one
native pass over the rows (`_pick_native`); `_pick_torch` is the reference path and picks
the same tokens.

Determinism: for a row with a seed, u for output token i (i = len(output_ids)) is a 64-bit
hash of (seed, sample_index, i) -- a pure function, and each row's draw path (native or
torch, `_draw`) follows from its own parameters, so the token depends only on that key and
the row's own logits and parameters: not on the other rows of the batch (their top_k /
top_p / min_p included) nor on retraction and resumption.
Rows without a seed take u from the caller's torch.Generator (the scheduler's, seeded with
EngineConfig.random_seed: the same seed and the same request stream give the same tokens).

Logprobs are always those of the RAW model distribution log_softmax(logits), before
penalties, masks, temperature and filters (what SGLang and OpenAI report).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import torch

from radixserve.constrained.mask import token_mask_bias
from radixserve.core.params import SamplingParams
from radixserve.core.request import TokenLogprob
from radixserve.isa import cpu_isa
from radixserve.native_build import CSRC, build, native_module

_MASK64 = (1 << 64) - 1
_TOP_P_TRY = 1024  # top_p looks for its cut among this many top tokens before a full sort


class BadRows(ValueError):
    """Rows of a `sample` batch that have nothing to draw from (see the contract above)."""

    def __init__(self, nonfinite: list[int], masked: list[int]) -> None:
        super().__init__(f"rows with NaN/inf logits {nonfinite}, with every token masked {masked}")
        self.nonfinite = nonfinite  # the model's logits hold NaN or +inf (or only -inf)
        self.masked = masked  # finite logits, but penalties and masks left no token


class AllowedTokens(Protocol):
    """What the sampler needs of a grammar state (radixserve.constrained.GrammarState)."""

    def allowed_tokens(self) -> torch.Tensor:
        """Packed mask (ceil(V / 8),) uint8: bit t % 8 of byte t // 8 set = token t allowed."""
        ...


@dataclass
class SamplingInfo:
    """What the sampler reads about one sample. Nothing here is written by the sampler.

    The scheduler may keep one SamplingInfo per sample for its whole life and let
    `output_ids` be the sample's live output list: its length is the index of the token
    being drawn, which keys the seeded random stream.
    """

    params: SamplingParams
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    eos_token_ids: set[int] | frozenset[int] = frozenset()
    sample_index: int = 0  # which of the request's n samples (n > 1 samples must differ)
    need_top_logprobs: int = 0  # top-k raw logprobs to report for this row; 0: none
    # False skips this row's log-sum-exp (a full pass over the vocabulary): its entry in
    # SampledTokens.logprobs is then NaN. The scheduler sets it from return_logprob.
    return_logprob: bool = True
    grammar: AllowedTokens | None = None  # regex / json_schema / ebnf state; None: free

    @property
    def stream_key(self) -> tuple[int, int] | None:
        """Key of the seeded random stream; None: the caller's generator."""
        seed = self.params.seed
        return None if seed is None else (seed, self.sample_index)

    @property
    def masks_stop_tokens(self) -> bool:
        """True while min_new_tokens forbids eos and stop_token_ids."""
        return len(self.output_ids) < self.params.min_new_tokens


@dataclass
class SampledTokens:
    next_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor  # (B,) float32, raw log_softmax(logits)[row, next_id]; NaN for
    # rows with return_logprob False and need_top_logprobs 0
    top_logprobs: list[list[TokenLogprob]]  # per row, best first; [] when not asked


class PenaltyPairs:
    """The (row, token) pairs a penalty reads for `rows`: the repetition penalty's
    (`with_prompt`) each distinct token of a row's prompt and output once; frequency and
    presence, each output token as often as it occurs. Kept from call to call: `pairs`
    adds only the tokens a row's output gained since (outputs only grow while a
    SamplingBatch lives). `before`, `moved`: the pairs of an earlier batch whose row
    moved[j] is row j here (None: a new row); its rows' pairs are carried over, renumbered,
    and only new rows read their prompts."""

    r: torch.Tensor  # (N,) int64 rows
    t: torch.Tensor  # (N,) int64 tokens

    def __init__(
        self,
        infos: list[SamplingInfo],
        rows: list[int],
        with_prompt: bool,
        before: PenaltyPairs | None = None,
        moved: list[int | None] | None = None,
    ) -> None:
        self.infos, self.rows, self.distinct = infos, rows, with_prompt
        self.seen: dict[int, int] = {}  # output tokens taken in, per row
        self.tokens: dict[int, set[int]] = {}  # the distinct tokens of each row
        fresh = rows
        carried_r = carried_t = torch.zeros(0, dtype=torch.int64)
        if before is not None and moved is not None:
            renumber = torch.full((len(before.infos),), -1, dtype=torch.int64)
            fresh = []
            for j in rows:
                i = moved[j]
                if i is None or i not in before.seen:
                    fresh.append(j)
                    continue
                renumber[i] = j
                self.seen[j] = before.seen[i]
                if with_prompt:
                    self.tokens[j] = before.tokens[i]
            now = renumber[before.r]
            kept = now >= 0  # the pairs of rows still here, in their order
            carried_r, carried_t = now[kept], before.t[kept]
        r: list[int] = []
        t: list[int] = []
        for i in fresh:
            self.seen[i] = 0
            if with_prompt:
                prompt = dict.fromkeys(infos[i].prompt_ids)  # distinct, in order
                self.tokens[i] = set(prompt)
                r += [i] * len(prompt)
                t += prompt
        self.r = torch.cat([carried_r, torch.tensor(r, dtype=torch.int64)])
        self.t = torch.cat([carried_t, torch.tensor(t, dtype=torch.int64)])

    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(N,) rows and (N,) tokens, as of the infos' outputs now."""
        r: list[int] = []
        t: list[int] = []
        for i in self.rows:
            out, seen = self.infos[i].output_ids, self.seen[i]
            assert len(out) >= seen, f"row {i}: its output shrank from {seen} to {len(out)}"
            for token in out[seen:]:
                if self.distinct:
                    if token in self.tokens[i]:
                        continue
                    self.tokens[i].add(token)
                r.append(i)
                t.append(token)
            self.seen[i] = len(out)
        if r:
            self.r = torch.cat([self.r, torch.tensor(r, dtype=torch.int64)])
            self.t = torch.cat([self.t, torch.tensor(t, dtype=torch.int64)])
        return self.r, self.t


class SamplingBatch:
    """What `sample` derives from its rows' SamplingInfo once, for as long as the rows stay
    the same: which rows are greedy or draw, and which use each of steps 1-3b. A caller
    that samples the same rows step after step (the scheduler's decode batch) keeps one
    and, when rows join or leave, builds the next from it (`before`); what changes with
    every token (output lengths: penalties, min_new_tokens, the seeded streams; grammar
    masks) is read from the infos at each `sample`. Reads the infos, writes none of them."""

    rep_pairs: PenaltyPairs
    occ_pairs: PenaltyPairs

    def __init__(
        self,
        infos: list[SamplingInfo],
        before: SamplingBatch | None = None,
        moved: list[int | None] | None = None,
    ) -> None:
        """`before`, `moved`: an earlier batch whose row moved[j] is row j here (None: a
        new row), whose penalty pairs are carried over (PenaltyPairs)."""
        self.infos = infos
        params = [f.params for f in infos]
        self.greedy = [i for i, p in enumerate(params) if p.is_greedy]
        self.drawn = [i for i, p in enumerate(params) if not p.is_greedy]
        self.drawn_infos = [infos[i] for i in self.drawn]
        self.rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        self.occ = [  # with output tokens only (read per step)
            i
            for i, p in enumerate(params)
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        ]
        self.min_new = [i for i, p in enumerate(params) if p.min_new_tokens > 0]  # ditto
        self.bias = [i for i, p in enumerate(params) if p.logit_bias]
        self.con = [i for i, f in enumerate(infos) if f.grammar is not None]
        self.filters = any(infos[i].params.has_filters for i in self.drawn)
        self.all_seeded = all(f.stream_key is not None for f in self.drawn_infos)
        self.top_ks = [f.need_top_logprobs for f in infos]
        self.want = [f.return_logprob for f in infos]
        # (B,) float32: each drawn row's temperature, 0 on greedy rows (the native pass's)
        temps = [0.0 if p.is_greedy else p.temperature for p in params]
        self.temps = torch.tensor(temps, dtype=torch.float32)
        self._rows: dict[str, torch.Tensor] = {}  # (n,) int64 row tensors, by device
        # The penalties' (row, token) pairs, grown by each row's new output tokens
        rep, occ = (None, None) if before is None else (before.rep_pairs, before.occ_pairs)
        self.rep_pairs = PenaltyPairs(infos, self.rep, True, rep, moved)
        self.occ_pairs = PenaltyPairs(infos, self.occ, False, occ, moved)
        per_row = {
            "repetition": [p.repetition_penalty for p in params],
            "frequency": [p.frequency_penalty for p in params],
            "presence": [p.presence_penalty for p in params],
        }
        self.penalty = {k: torch.tensor(v, dtype=torch.float32) for k, v in per_row.items()}
        self.touched: dict[tuple[tuple[int, ...], tuple[int, ...], str], torch.Tensor | None] = {}

    def rows(self, which: str, device: torch.device) -> torch.Tensor:
        """self.greedy or self.drawn as an int64 tensor on `device`, made once."""
        key = f"{which}@{device}"
        if key not in self._rows:
            self._rows[key] = torch.tensor(getattr(self, which), dtype=torch.int64, device=device)
        return self._rows[key]


def sample(
    logits: torch.Tensor,
    infos: list[SamplingInfo] | SamplingBatch,
    generator: torch.Generator | None = None,
) -> SampledTokens:
    """Pick one token per row (see the module docstring for order and determinism).

    `infos`: one SamplingInfo per row, or a SamplingBatch made of them earlier (the same
    draws, without deriving it again). `generator` (CPU) gives the uniforms of rows without
    a seed; it may be None only when no such row draws (AssertionError otherwise).
    """
    batch = infos if isinstance(infos, SamplingBatch) else SamplingBatch(infos)
    B = len(batch.infos)
    assert logits.dim() == 2 and logits.shape[0] == B, f"logits {tuple(logits.shape)} vs {B} infos"
    assert logits.dtype == torch.float32, f"sampler expects float32 logits, got {logits.dtype}"
    occ, ban = _steps(batch)
    touched = _touched_rows(batch, occ, ban, logits.device)
    # the model's own maxima of the rows steps 1-3b change, for the check of its logits
    raw = None if touched is None else (touched, logits[touched].amax(dim=-1))
    undo = Undo()
    # the model worker's logits are inference tensors: written in place only in that mode
    with torch.inference_mode(logits.is_inference()):
        try:
            _apply(logits, batch, occ, ban, undo)  # steps 1-3b in place
            native = native_ops() if logits.device.type == "cpu" and logits.stride(1) == 1 else None
            if (
                native is not None
                and not batch.filters
                and (generator is not None or batch.all_seeded)
            ):
                next_ids = _pick_native(native, logits, raw, batch, generator)
            else:
                next_ids = _pick_torch(logits, raw, batch, generator)
        finally:
            undo.restore(logits)
    logprobs, top = _raw_logprobs(logits, next_ids, batch.top_ks, batch.want)
    return SampledTokens(next_ids=next_ids, logprobs=logprobs, top_logprobs=top)


def _pick_native(
    native: ModuleType,
    work: torch.Tensor,
    raw: RawMaxima,
    batch: SamplingBatch,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Steps 4-8 and the row check, every row in one native pass (CPU, no top_k / top_p /
    min_p): its maximum (NaN-propagating, as amax), then its first maximal index (greedy) or
    its draw, the same as `_draw`'s native one. The same tokens as `_pick_torch`; 256 x
    49152 logits, half greedy, 1 thread (Zen 5): 17.9 -> 8.8 ms. Returns (B,) int64."""
    saved = generator.get_state() if generator is not None and batch.drawn else None
    u = [0.0] * len(batch.infos)  # read on drawn rows only
    if batch.drawn:
        for row, drawn in zip(batch.drawn, _uniforms(batch.drawn_infos, generator)):
            u[row] = drawn
    next_ids, work_max = native.decode_rows(work, batch.temps, torch.tensor(u, dtype=torch.float64))
    try:
        _check_rows(work_max, raw)
    except BadRows:  # the check comes before the draw: a failed batch draws no uniforms
        if generator is not None and saved is not None:
            generator.set_state(saved)
        raise
    return next_ids


def _pick_torch(
    work: torch.Tensor,
    raw: RawMaxima,
    batch: SamplingBatch,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Steps 4-8 and the row check in torch ops (the reference path). One pass gives the
    greedy rows' tokens and the check's maxima: max().indices is the first maximal index
    like argmax, ~3x faster on CPU (165 vs 500 us at 16 x 49152), and its values propagate
    NaN like amax; a batch that only draws needs the maxima alone. Returns (B,) int64."""
    best = work.max(dim=-1) if batch.greedy else None  # (B,) values and indices
    work_max = best.values if best is not None else work.amax(dim=-1)  # (B,)
    _check_rows(work_max, raw)
    if not batch.drawn:
        assert best is not None
        return best.indices
    next_ids = torch.empty(len(batch.infos), dtype=torch.int64, device=work.device)
    rows = batch.rows("drawn", work.device)
    if best is not None:
        greedy = batch.rows("greedy", work.device)
        next_ids[greedy] = best.indices[greedy]
    sub = work if best is None else work[rows]  # (S, V); no copy when every row draws
    next_ids[rows] = _draw(sub, batch.drawn_infos, generator)
    return next_ids


# The rows steps 1-3b change ((R,) int64) and their maxima in the model's logits (R,).
RawMaxima = tuple[torch.Tensor, torch.Tensor] | None


def _check_rows(work_max: torch.Tensor, raw: RawMaxima) -> None:
    """BadRows unless every row keeps a finite maximum, in the model's logits (NaN, +inf or
    nothing but -inf there is the model's failure) and after penalties and masks (`work_max`
    (B,): -inf everywhere means no token is allowed). A row's maximum in the model's logits
    is its `raw` one where steps 1-3b changed it, else its `work_max`. The maxima propagate
    NaN; a -inf entry beside finite ones is harmless (probability 0)."""
    after = work_max.tolist()
    model = list(after)
    if raw is not None:
        for row, m in zip(raw[0].tolist(), raw[1].tolist()):
            model[row] = m
    if all(map(math.isfinite, after)) and (raw is None or all(map(math.isfinite, model))):
        return
    nonfinite = [i for i, m in enumerate(model) if not math.isfinite(m)]
    masked = [
        i for i, (m, a) in enumerate(zip(model, after)) if math.isfinite(m) and not math.isfinite(a)
    ]
    raise BadRows(nonfinite, masked)


def prompt_logprobs(
    logits: torch.Tensor, next_ids: torch.Tensor, top_k: int
) -> tuple[list[float], list[list[TokenLogprob]]]:
    """Raw logprob of next_ids[t] under logits[t] (T, vocab), and the top_k raw entries per t.

    Row t of `logits` is the model output at prompt position t, which predicts prompt token
    t + 1 = next_ids[t]. Returns ([T floats], [T lists of top_k (logprob, id)], [] each when
    top_k == 0). Does not modify its inputs.
    """
    assert logits.dim() == 2 and next_ids.shape == (logits.shape[0],), (
        f"logits {tuple(logits.shape)} vs next_ids {tuple(next_ids.shape)}"
    )
    assert top_k >= 0, f"top_k must be >= 0, got {top_k}"
    T = logits.shape[0]
    lp, top = _raw_logprobs(logits.float(), next_ids.long(), [top_k] * T, [True] * T)
    return lp.tolist(), top


def _raw_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, top_ks: list[int], want: list[bool]
) -> tuple[torch.Tensor, list[list[TokenLogprob]]]:
    """Chosen-token logprobs (B,) and per-row top-k lists under log_softmax(logits).

    Rows with want[i] False and top_ks[i] == 0 skip the log-sum-exp and get NaN.
    """
    B = logits.shape[0]
    rows = [i for i in range(B) if want[i] or top_ks[i] > 0]
    chosen = torch.full((B,), float("nan"), dtype=logits.dtype, device=logits.device)
    top: list[list[TokenLogprob]] = [[] for _ in range(B)]
    if not rows:
        return chosen, top
    row_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)  # (R,)
    sub = logits if len(rows) == B else logits[row_t]  # (R, V)
    lse = torch.logsumexp(sub, dim=-1)  # (R,)
    chosen[row_t] = sub.gather(1, ids[row_t].unsqueeze(1)).squeeze(1) - lse
    k_max = min(max(top_ks), logits.shape[1])
    if k_max > 0:
        vals, idx = sub.topk(k_max, dim=-1)  # (R, k_max), best first
        vals_l = (vals - lse.unsqueeze(1)).tolist()
        idx_l = idx.tolist()
        for r, i in enumerate(rows):
            k = top_ks[i]
            top[i] = list(zip(vals_l[r][:k], idx_l[r][:k], strict=True))
    return chosen, top


def process_logits(logits: torch.Tensor, infos: list[SamplingInfo] | SamplingBatch) -> torch.Tensor:
    """Steps 1-3b (penalties, logit_bias, min_new_tokens, grammar masks) of the module docstring.

    Returns a modified copy of `logits` (B, V), or `logits` itself (not a copy) when no row
    needs a change; `logits` is never written.
    """
    batch = infos if isinstance(infos, SamplingBatch) else SamplingBatch(infos)
    occ, ban = _steps(batch)
    if _touched_rows(batch, occ, ban, logits.device) is None:
        return logits
    work = logits.clone()
    _apply(work, batch, occ, ban, Undo())
    return work


def _steps(batch: SamplingBatch) -> tuple[list[int], list[int]]:
    """The rows of steps 2 (with output tokens) and 3 (min_new_tokens still on) now."""
    infos = batch.infos
    occ = [i for i in batch.occ if infos[i].output_ids]
    ban = [i for i in batch.min_new if infos[i].masks_stop_tokens]
    return occ, ban


def _touched_rows(
    batch: SamplingBatch, occ: list[int], ban: list[int], device: torch.device
) -> torch.Tensor | None:
    """(R,) int64: the rows steps 1-3b change now (`occ`, `ban`: `_steps`), ascending; None
    when none."""
    key = (tuple(occ), tuple(ban), str(device))
    if key not in batch.touched:  # rows join occ and leave ban once each: a few keys
        rows = set(batch.rep) | set(occ) | set(batch.bias) | set(ban) | set(batch.con)
        t = torch.tensor(sorted(rows), dtype=torch.int64, device=device) if rows else None
        batch.touched = {key: t}
    return batch.touched[key]


class Undo:
    """What steps 1-3b overwrote, to put back in reverse order: (rows, tokens, values) of
    the entries a step changed, or (rows, None, the rows' values) for a grammar mask."""

    def __init__(self) -> None:
        self.saved: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []

    def restore(self, work: torch.Tensor) -> None:
        for r, t, values in reversed(self.saved):
            if t is None:
                work[r] = values
            else:
                work[r, t] = values
        self.saved.clear()


def _apply(
    work: torch.Tensor, batch: SamplingBatch, occ: list[int], ban: list[int], undo: Undo
) -> None:
    """Steps 1-3b on `work` (B, V) in place (`occ`, `ban`: `_steps`), each one batched
    scatter over the (row, token) pairs of all rows that use it; `undo` is told what each
    overwrites before it does."""
    infos = batch.infos
    rep, bias, con = batch.rep, batch.bias, batch.con
    dev = work.device
    if rep:
        r, t = (x.to(dev) for x in batch.rep_pairs.pairs())  # each distinct token once
        pen = batch.penalty["repetition"].to(dev)[r]  # (N,)
        vals = work[r, t]  # (N,)
        undo.saved.append((r, t, vals))
        work[r, t] = torch.where(vals > 0, vals / pen, vals * pen)
    if occ:
        r, t = (x.to(dev) for x in batch.occ_pairs.pairs())  # each occurrence
        vals = work[r, t]
        undo.saved.append((r, t, vals))
        # duplicate pairs all write the same value: presence once per distinct token
        work[r, t] = vals - batch.penalty["presence"].to(dev)[r]
        freq = batch.penalty["frequency"].to(dev)[r]  # (N,)
        work.index_put_((r, t), -freq, accumulate=True)  # once per occurrence
    if bias:
        biases = [infos[i].params.logit_bias for i in bias]
        r, t = _pairs(bias, [(list(b),) for b in biases], work)
        assert int(t.max()) < work.shape[1], f"logit_bias ids {t.max()} vs vocab {work.shape[1]}"
        added = [v for b in biases for v in b.values()]  # in the order _pairs flattened them
        vals = work[r, t]
        undo.saved.append((r, t, vals))
        work[r, t] = vals + torch.tensor(added, dtype=work.dtype, device=work.device)
    if ban:
        banned = [
            (sorted(set(infos[i].eos_token_ids) | set(infos[i].params.stop_token_ids)),)
            for i in ban
        ]
        r, t = _pairs(ban, banned, work)
        assert t.numel() == 0 or int(t.max()) < work.shape[1], f"stop ids {banned} vs vocab"
        undo.saved.append((r, t, work[r, t]))
        work[r, t] = float("-inf")
    if con:
        rows = torch.tensor(con, dtype=torch.int64, device=work.device)
        undo.saved.append((rows, None, work[rows]))
        _mask_grammar(work, con, infos)


def _mask_grammar(work: torch.Tensor, rows: list[int], infos: list[SamplingInfo]) -> None:
    """Step 3b in place: -inf on the tokens each constrained row's grammar forbids."""
    masks = [infos[i].grammar.allowed_tokens() for i in rows]  # type: ignore[union-attr]
    apply_token_masks(work, rows, torch.stack(masks))


def apply_token_masks(work: torch.Tensor, rows: list[int], packed: torch.Tensor) -> None:
    """work[rows[i]] += 0 / -inf as packed[i] (R, ceil(V / 8)) uint8 allows / forbids each
    token (constrained/mask.py), in place; allowed logits stay bit-exact. On CPU one native
    pass over the packed bytes (radixserve/csrc/sample_cpu.cpp), else a (R, V) bias tensor
    added."""
    packed = packed.to(work.device)
    native = native_ops() if work.device.type == "cpu" and work.dtype == torch.float32 else None
    if native is not None and work.stride(1) == 1:
        native.mask_logits_(work, torch.tensor(rows, dtype=torch.int64), packed)
        return
    bias = token_mask_bias(packed, work.shape[1], work.dtype)  # (R, V)
    if len(rows) == work.shape[0]:
        work.add_(bias)
    else:
        r = torch.tensor(rows, dtype=torch.int64, device=work.device)  # (R,)
        work[r] += bias


def _pairs(
    rows: list[int], id_lists: Sequence[Sequence[Sequence[int]]], like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten (row, token) pairs: rows[j] paired with every id of the lists id_lists[j]."""
    lens = torch.tensor([sum(len(x) for x in lists) for lists in id_lists])  # (R,)
    row_idx = torch.repeat_interleave(torch.tensor(rows), lens)  # (N,)
    flat = [t for lists in id_lists for ids in lists for t in ids]
    tok_idx = torch.tensor(flat, dtype=torch.int64)  # (N,)
    return row_idx.to(like.device), tok_idx.to(like.device)


def _per_row(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device)  # (B,)


@native_module
def native_ops() -> ModuleType | None:
    """radixserve/csrc/sample_cpu.cpp (steps 4 and 8 fused for rows without filters), or None
    where it does not build or native ops are off."""
    return build("radixserve_sample", CSRC / "sample_cpu.cpp", cpu_isa())


def _draw(
    logits: torch.Tensor, infos: list[SamplingInfo], gen: torch.Generator | None
) -> torch.Tensor:
    """Steps 4-8 for non-greedy rows: logits (S, V) -> token ids (S,) int64.

    Each row's path is its own, whatever the others use: on CPU a row without top_k / top_p /
    min_p is drawn by one native pass (the same draw as `_draw_torch`: same u, weights
    exp((l - max) / T) in float32, so the same token unless u falls within float32 rounding
    of a CDF step), the others by `_draw_torch`; so a seeded row draws the same token beside
    any neighbours. The native pass skips the (S, V) temporaries: 64 x 49152 logits 4.5 ->
    1.2-1.7 ms (Zen 4 EPYC, 2 threads, native and AVX2 settings).
    """
    params = [info.params for info in infos]
    temps = _per_row([p.temperature for p in params], logits)  # (S,)
    u = torch.tensor(_uniforms(infos, gen), dtype=torch.float64)  # (S,) in [0, 1)
    native = native_ops() if logits.device.type == "cpu" and logits.stride(1) == 1 else None
    filtered = [r for r, p in enumerate(params) if p.has_filters]
    if native is None or len(filtered) == len(params):
        return _draw_torch(logits, temps, u, params)
    if not filtered:
        return native.sample_softmax(logits, temps, u)
    plain = [r for r, p in enumerate(params) if not p.has_filters]
    f, n = torch.tensor(filtered), torch.tensor(plain)  # (F,), (S - F,) row indices
    out = torch.empty(len(params), dtype=torch.int64)  # (S,)
    out[f] = _draw_torch(logits[f], temps[f], u[f], [params[r] for r in filtered])
    out[n] = native.sample_softmax(logits[n], temps[n], u[n])
    return out


def _draw_torch(
    logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor, params: list[SamplingParams]
) -> torch.Tensor:
    """Steps 4-8 in torch ops (the reference draw): logits (S, V), temperatures (S,) and
    uniforms (S,) float64 -> token ids (S,) int64."""
    scaled = logits if bool((temps == 1.0).all()) else logits / temps.unsqueeze(1)  # (S, V)
    probs = torch.softmax(scaled, dim=-1)  # (S, V)
    if any(p.has_filters for p in params):
        probs = _filter(probs, params)
    # Inverse CDF uses only differences of neighbouring cdf entries, so float32 rounding
    # errors do not accumulate: each token's probability is off by <= ~2 ulp(1) = 1.2e-7.
    cdf = probs.cumsum(dim=-1)  # (S, V)
    total = cdf[:, -1]  # (S,) > 0: every row has a finite maximum (_check_rows)
    target = (u.to(logits.device) * total.double()).to(cdf.dtype)  # (S,)
    # First index whose cumulative mass exceeds the target: always a kept (p > 0) token.
    idx = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)  # (S,)
    over = idx >= probs.shape[1]  # (S,)
    if bool(over.any()):  # the target rounded up to the total (probability ~1e-7)
        idx = torch.where(over, probs.argmax(dim=-1), idx)
    return idx


def _filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities below each row's top_k/top_p/min_p threshold: (S, V) -> (S, V)."""
    V = probs.shape[1]
    dev = probs.device
    top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in params], device=dev)  # (S,)
    top_p = _per_row([p.top_p for p in params], probs)  # (S,)
    min_p = _per_row([p.min_p for p in params], probs)  # (S,)
    threshold = min_p * probs.amax(dim=-1) if bool((min_p > 0).any()) else min_p  # (S,)
    if bool(((top_k < V) | (top_p < 1.0)).any()):
        threshold = torch.maximum(threshold, _top_k_top_p_threshold(probs, top_k, top_p))
    return probs.masked_fill(probs < threshold.unsqueeze(1), 0.0)


def _top_k_top_p_threshold(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per row, the smallest probability that survives top_k then top_p (0: no limit).

    Depends only on the row's sorted probability VALUES, never on tie order, so it is the
    same whichever path below computes it. top_p keeps the shortest prefix (by descending
    probability) of the top_k distribution whose mass reaches top_p of that distribution's
    mass z. The prefix is first sought among the top _TOP_P_TRY probabilities (cheap); rows
    whose nucleus is longer are sorted in full.
    """
    S, V = probs.shape
    use_k, use_p = top_k < V, top_p < 1.0  # (S,) each
    k_try = int(top_k[use_k].max()) if bool(use_k.any()) else 1
    k_try = min(V, max(k_try, _TOP_P_TRY if bool(use_p.any()) else 1))
    vals = probs.topk(k_try, dim=-1).values  # (S, k_try), descending
    t_k = torch.where(use_k, vals.gather(1, (top_k.clamp(max=k_try) - 1).unsqueeze(1))[:, 0], 0)
    if not bool(use_p.any()):
        return t_k
    z = torch.ones_like(top_p)  # (S,), softmax mass without top_k
    both = use_k & use_p
    if bool(both.any()):
        mass_k = probs.masked_fill(probs < t_k.unsqueeze(1), 0.0).sum(dim=-1)  # (S,)
        z = torch.where(both, mass_k, z)
    n_p = _nucleus_size(vals, t_k, top_p * z)  # (S,) in [1, k_try]
    t_p = vals.gather(1, (n_p - 1).unsqueeze(1))[:, 0]  # (S,)
    # Rows with top_k end inside `vals`; others are resolved when the cut fell inside it.
    longer = use_p & ~use_k & (n_p >= k_try) & (k_try < V)  # (S,)
    if bool(longer.any()):
        rows = longer.nonzero()[:, 0]  # (L,)
        full = probs[rows].sort(dim=-1, descending=True).values  # (L, V)
        n_full = _nucleus_size(full, t_k[rows], top_p[rows] * z[rows])  # (L,)
        t_p[rows] = full.gather(1, (n_full - 1).unsqueeze(1))[:, 0]
    return torch.maximum(t_k, torch.where(use_p, t_p, 0))


def _nucleus_size(vals: torch.Tensor, t_k: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Count of leading entries of `vals` (R, K) descending, >= t_k, whose preceding mass is
    below `mass` (R,): the top_p prefix length, clamped to [1, entries >= t_k]."""
    kept = vals.masked_fill(vals < t_k.unsqueeze(1), 0.0)  # (R, K), top_k survivors
    mass_before = kept.cumsum(dim=-1) - kept  # (R, K), exclusive prefix sums
    n = (mass_before < mass.unsqueeze(1)).sum(dim=-1)  # (R,)
    return torch.minimum(n, (kept > 0).sum(dim=-1)).clamp(min=1)


def _uniforms(infos: list[SamplingInfo], gen: torch.Generator | None) -> list[float]:
    """One uniform in [0, 1) per row: hashed from the seed stream, else from `gen`."""
    if gen is None:
        unseeded = [r for r, info in enumerate(infos) if info.stream_key is None]
        assert not unseeded, f"rows {unseeded} have no seed and sample() got no generator"
        drawn: list[float] = [0.0] * len(infos)  # every entry set below
    else:
        drawn = torch.rand(len(infos), generator=gen, dtype=torch.float64).tolist()  # (S,)
    for r, info in enumerate(infos):
        key = info.stream_key
        if key is not None:
            h = _hash64(key[0], key[1], len(info.output_ids))
            drawn[r] = (h >> 11) * 2.0**-53  # top 53 bits -> a float64 in [0, 1)
    return drawn


def _hash64(*parts: int) -> int:
    """Deterministic 64-bit hash of integers (splitmix64 finaliser, chained)."""
    h = 0x243F6A8885A308D3  # arbitrary non-zero start
    for part in parts:
        h = ((h ^ (part & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h
