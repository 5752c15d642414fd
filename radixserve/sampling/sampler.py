"""Batched next-token sampling, logprobs of the chosen tokens, and prompt logprobs.

Contract of `sample(logits, infos)`:
  - reads `logits` (B, vocab) float32, one row per sample; never modifies it (penalties and
    masks are applied to a private copy, made only when some row needs one);
  - reads every `SamplingInfo` and mutates none of them (the caller appends the token);
  - raises AssertionError on shape/dtype mismatch or a row with no finite logit left.

Per row, in this order (SGLang/HF/OpenAI semantics):
  1. repetition penalty over prompt+output tokens (HF: positive logits divided by the
     penalty, negative logits multiplied by it; each distinct token once);
  2. frequency/presence penalties over output tokens (OpenAI:
     l -= frequency_penalty * count + presence_penalty * (count > 0));
  3. min_new_tokens: while len(output_ids) < min_new_tokens, eos ids and stop_token_ids get
     -inf (also with ignore_eos, which only means that eos does not stop);
  4. temperature: 0 (or top_k == 1) -> exact argmax of the logits after 1-3, no randomness;
     otherwise probs = softmax(l / T);
  5. top_k, 6. top_p (on the distribution left by top_k), 7. min_p (relative to the top
     probability). Each filter is a probability threshold and a token survives when its
     probability is >= the largest of the three thresholds, so tied tokens are kept or
     dropped together and the kept set never depends on tie-breaking order;
  8. draw by inverse CDF over the kept probabilities in vocabulary order with ONE uniform u.

Determinism: for a row with a seed, u for output token i (i = len(output_ids)) is a 64-bit
hash of (seed, sample_index, i) -- a pure function, so the token depends only on that key and
the row's own logits: not on the other rows of the batch nor on retraction and resumption.
Rows without a seed take u from a process-level torch.Generator (`seed_process_generator`).

Logprobs are always those of the RAW model distribution log_softmax(logits), before
penalties, masks, temperature and filters (what SGLang and OpenAI report).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.sampling.params import SamplingParams

TokenLogprob = tuple[float, int]  # (logprob, token_id), as radixserve.scheduler.io

_MASK64 = (1 << 64) - 1
_PROCESS_GENERATOR = torch.Generator().manual_seed(0)


def seed_process_generator(seed: int) -> None:
    """Reseed the generator used by rows without a seed (EngineConfig.random_seed)."""
    _PROCESS_GENERATOR.manual_seed(seed)


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

    @property
    def stream_key(self) -> tuple[int, int] | None:
        """Key of the seeded random stream; None: the process-level generator."""
        seed = self.params.seed
        return None if seed is None else (seed, self.sample_index)

    @property
    def masks_stop_tokens(self) -> bool:
        """True while min_new_tokens forbids eos and stop_token_ids."""
        return len(self.output_ids) < self.params.min_new_tokens


@dataclass
class SampleResult:
    next_ids: torch.Tensor  # (B,) int64
    logprobs: torch.Tensor  # (B,) float32, raw log_softmax(logits)[row, next_id]
    top_logprobs: list[list[TokenLogprob]]  # per row, best first; [] when not asked


def sample(
    logits: torch.Tensor, infos: list[SamplingInfo], generator: torch.Generator | None = None
) -> SampleResult:
    """Pick one token per row (see the module docstring for order and determinism).

    `generator` overrides the process-level generator for rows without a seed.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(infos), (
        f"logits {tuple(logits.shape)} vs {len(infos)} infos"
    )
    assert logits.dtype == torch.float32, f"sampler expects float32 logits, got {logits.dtype}"
    work = process_logits(logits, infos)  # (B, V); `logits` itself when nothing applies
    greedy = [i for i, info in enumerate(infos) if info.params.is_greedy]
    if len(greedy) == len(infos):
        next_ids = work.argmax(dim=-1)  # the common decode case: one kernel, no gathers
    else:
        next_ids = torch.empty(len(infos), dtype=torch.int64, device=logits.device)
        if greedy:
            rows = torch.tensor(greedy, dtype=torch.int64, device=logits.device)
            next_ids[rows] = work[rows].argmax(dim=-1)
        drawn = [i for i, info in enumerate(infos) if not info.params.is_greedy]
        rows = torch.tensor(drawn, dtype=torch.int64, device=logits.device)
        gen = _PROCESS_GENERATOR if generator is None else generator
        next_ids[rows] = _draw(work[rows], [infos[i] for i in drawn], gen)
    logprobs, top = _raw_logprobs(logits, next_ids, [info.need_top_logprobs for info in infos])
    return SampleResult(next_ids=next_ids, logprobs=logprobs, top_logprobs=top)


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
    lp, top = _raw_logprobs(logits.float(), next_ids.long(), [top_k] * logits.shape[0])
    return lp.tolist(), top


def _raw_logprobs(
    logits: torch.Tensor, ids: torch.Tensor, top_ks: list[int]
) -> tuple[torch.Tensor, list[list[TokenLogprob]]]:
    """Chosen-token logprobs (B,) and per-row top-k lists under log_softmax(logits)."""
    lse = torch.logsumexp(logits, dim=-1)  # (B,)
    chosen = logits.gather(1, ids.unsqueeze(1)).squeeze(1) - lse  # (B,)
    top: list[list[TokenLogprob]] = [[] for _ in top_ks]
    k_max = min(max(top_ks, default=0), logits.shape[1])
    if k_max > 0:
        rows = [i for i, k in enumerate(top_ks) if k > 0]
        row_t = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        vals, idx = logits[row_t].topk(k_max, dim=-1)  # (R, k_max), best first
        vals = (vals - lse[row_t].unsqueeze(1)).tolist()
        idx = idx.tolist()
        for r, i in enumerate(rows):
            top[i] = list(zip(vals[r][: top_ks[i]], idx[r][: top_ks[i]], strict=True))
    return chosen, top


def process_logits(logits: torch.Tensor, infos: list[SamplingInfo]) -> torch.Tensor:
    """Steps 1-3 (penalties, min_new_tokens mask) of the module docstring, per row.

    Returns a modified copy of `logits` (B, V), or `logits` itself (not a copy) when no row
    needs a change; `logits` is never written.
    """
    todo = [
        i for i, info in enumerate(infos) if info.params.has_penalties or info.masks_stop_tokens
    ]
    if not todo:
        return logits
    work = logits.clone()
    vocab = logits.shape[1]
    for i in todo:
        info, row = infos[i], work[i]  # row: (V,) view into `work`
        p = info.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(info.prompt_ids + info.output_ids, dtype=torch.int64)
            # Duplicate indices all write the same value (computed from the original), so
            # each distinct token is penalised exactly once.
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and info.output_ids:
            out = torch.tensor(info.output_ids, dtype=torch.int64)
            counts = torch.bincount(out, minlength=vocab).to(row.dtype)  # (V,)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if info.masks_stop_tokens:
            banned = sorted(set(info.eos_token_ids) | set(p.stop_token_ids))
            assert all(0 <= t < vocab for t in banned), f"stop ids {banned} vs vocab {vocab}"
            row[banned] = float("-inf")
    return work


def _draw(logits: torch.Tensor, infos: list[SamplingInfo], gen: torch.Generator) -> torch.Tensor:
    """Steps 4-8 for non-greedy rows: logits (S, V) -> token ids (S,) int64."""
    temps = torch.tensor([info.params.temperature for info in infos], dtype=logits.dtype)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)  # (S, V)
    if any(info.params.has_filters for info in infos):
        probs = _filter(probs, [info.params for info in infos])
    cdf = probs.double().cumsum(dim=-1)  # (S, V), float64 so the tail keeps its mass
    total = cdf[:, -1]  # (S,)
    assert bool((total > 0).all()) and bool(total.isfinite().all()), (
        f"rows with no finite logit left: {total.tolist()}"
    )
    u = _uniforms(infos, gen)  # (S,) float64 in [0, 1)
    # First index whose cumulative mass exceeds u * total: always a kept (p > 0) token.
    idx = torch.searchsorted(cdf, (u * total).unsqueeze(1), right=True).squeeze(1)  # (S,)
    # u * total can round up to total (probability ~2^-53): take the top token then.
    return torch.where(idx >= probs.shape[1], probs.argmax(dim=-1), idx)


def _filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities below each row's top_k/top_p/min_p threshold (S, V)."""
    S, V = probs.shape
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params]).clamp(max=V)  # (S,)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)  # (S,)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)  # (S,)
    need_sorted = (top_k < V) | (top_p < 1.0)  # (S,)
    # Thresholds depend only on sorted VALUES, so how many we sort does not change them.
    if bool((need_sorted & (top_k == V)).any()):
        k_max = V  # some row needs top_p over the whole vocabulary
    else:
        k_max = int(top_k[need_sorted].max()) if bool(need_sorted.any()) else 1
    vals = probs.topk(k_max, dim=-1).values  # (S, k_max), descending
    t_k = torch.where(top_k < V, vals.gather(1, (top_k.clamp(max=k_max) - 1).unsqueeze(1))[:, 0], 0)
    # top_p acts on the distribution left by top_k (renormalised by its mass z).
    z = (probs * (probs >= t_k.unsqueeze(1))).sum(dim=-1)  # (S,)
    kept_vals = vals * (vals >= t_k.unsqueeze(1))  # (S, k_max)
    mass_before = kept_vals.cumsum(dim=-1) - kept_vals  # (S, k_max), exclusive prefix sums
    n_top_p = (mass_before < (top_p * z).unsqueeze(1)).sum(dim=-1)  # (S,)
    n_top_p = torch.minimum(n_top_p, (kept_vals > 0).sum(dim=-1)).clamp(min=1)
    t_p = torch.where(top_p < 1.0, vals.gather(1, (n_top_p - 1).unsqueeze(1))[:, 0], 0)
    t_m = min_p * vals[:, 0]  # (S,), vals[:, 0] is the top probability
    threshold = torch.maximum(torch.maximum(t_k, t_p), t_m)  # (S,)
    return probs * (probs >= threshold.unsqueeze(1))


def _uniforms(infos: list[SamplingInfo], gen: torch.Generator) -> torch.Tensor:
    """One uniform in [0, 1) per row: hashed from the seed stream, else from `gen`."""
    u = torch.rand(len(infos), generator=gen, dtype=torch.float64)  # (S,)
    for r, info in enumerate(infos):
        key = info.stream_key
        if key is not None:
            h = _hash64(key[0], key[1], len(info.output_ids))
            u[r] = (h >> 11) * 2.0**-53  # top 53 bits -> a float64 in [0, 1)
    return u


def _hash64(*parts: int) -> int:
    """Deterministic 64-bit hash of integers (splitmix64 finaliser, chained)."""
    h = 0x243F6A8885A308D3  # arbitrary non-zero start
    for part in parts:
        h = ((h ^ (part & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h
