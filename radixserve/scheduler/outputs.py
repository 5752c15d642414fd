"""Turning logits into tokens, logprobs and per-step deltas of each sample."""

from __future__ import annotations

import logging

import torch

from radixserve.core.request import TokenDelta, TokenLogprob
from radixserve.sampling.sampler import BadRows, SamplingBatch, prompt_logprobs, sample
from radixserve.scheduler.sample import Sample

logger = logging.getLogger("radixserve.scheduler")

Drawn = tuple[Sample, int, float, list[TokenLogprob]]  # sample, token, its logprob, top logprobs
NO_TOKEN_ALLOWED = (
    "no token is allowed: the regex / json_schema together with min_new_tokens and "
    "stop_token_ids (or eos) exclude every token"
)


class OutputProcessor:
    """Owns the random stream of samples without a seed: `seed` (EngineConfig.random_seed)
    starts it, so the same seed and the same sequence of steps draw the same tokens."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)  # CPU: the sampler's uniforms
        # The last rows sampled and what the sampler derived from them: a decode batch's
        # rows stay the same from step to step until samples join or leave, and the next
        # batch is then made from this one (the rows that stay keep their penalty pairs).
        self._rows: list[Sample] = []
        self._batch = SamplingBatch([])

    def sample(self, reqs: list[Sample], logits: torch.Tensor) -> list[Drawn]:
        """Draw one token per sample from logits (len(reqs), vocab) float32."""
        if reqs != self._rows:  # Sample compares by identity: one C-level pass over the list
            before = {r: i for i, r in enumerate(self._rows)}
            moved = [before.get(r) for r in reqs]  # each row's row in the last batch
            self._rows = list(reqs)
            self._batch = SamplingBatch([r.sampling_info for r in reqs], self._batch, moved)
        res = sample(logits[:, : self.vocab_size], self._batch, self.generator)
        tokens, logprobs = res.next_ids.tolist(), res.logprobs.tolist()
        return list(zip(reqs, tokens, logprobs, res.top_logprobs, strict=True))

    def draw(
        self, draw: list[tuple[Sample, int]], logits: torch.Tensor
    ) -> tuple[list[Drawn], list[tuple[Sample, int, str]]]:
        """A token for each (sample, logits row) of `draw`, isolating failures: returns the
        drawn samples and the failed ones as (sample, HTTP status, message). Rows that
        cannot be drawn from are left out and the others drawn again; any other error is
        pinned on its row by drawing the rows one by one."""
        failed: list[tuple[Sample, int, str]] = []
        while draw:
            rows = [row for _, row in draw]
            # Every row in order (a decode batch): no copy of the (B, vocab) logits.
            picked = logits if rows == list(range(len(logits))) else logits[torch.tensor(rows)]
            try:
                return self.sample([r for r, _ in draw], picked), failed
            except BadRows as e:
                failed += [
                    (draw[i][0], 500, "the model's logits hold NaN or inf") for i in e.nonfinite
                ]
                failed += [(draw[i][0], 400, NO_TOKEN_ALLOWED) for i in e.masked]
                bad = set(e.nonfinite) | set(e.masked)
                draw = [d for i, d in enumerate(draw) if i not in bad]
            except Exception:
                logger.exception("sampling failed: drawing the rows one by one")
                break
        drawn: list[Drawn] = []
        for req, row in draw:
            try:
                drawn += self.sample([req], logits[row : row + 1])
            except Exception as e:
                failed.append((req, 500, f"internal error while sampling: {type(e).__name__}: {e}"))
        return drawn, failed

    def append_token(
        self, req: Sample, token: int, logprob: float, top: list[TokenLogprob]
    ) -> None:
        req.append_output(token)
        req.new_ids.append(token)
        if req.grammar is not None:
            req.grammar.advance(token)
        if req.request.return_logprob:
            req.new_logprobs.append((logprob, token))
            if req.request.top_logprobs_num > 0:
                req.new_top_logprobs.append(top)

    def prompt_logprobs(self, req: Sample, logits: torch.Tensor, start: int) -> None:
        """Record logprobs of prompt tokens predicted by positions start .. start+len(logits)-1.

        Position p predicts prompt token p + 1. Reported tokens are those at positions
        logprob_start_len .. len(prompt)-1; token 0 has no logprob (None).
        """
        prompt, first = req.prompt_ids, req.request.logprob_start_len
        if start <= first == 0:
            req.input_logprobs.append((None, prompt[0]))
            if req.request.top_logprobs_num > 0:
                req.input_top_logprobs.append([])
        # Predicting tokens lo+1 .. hi: rows (lo - start) .. (hi - 1 - start).
        lo, hi = max(start, first - 1, 0), min(start + logits.shape[0], len(prompt) - 1)
        if hi <= lo:
            return
        rows = logits[lo - start : hi - start, : self.vocab_size]
        targets = torch.tensor(prompt[lo + 1 : hi + 1], dtype=torch.int64)
        lps, tops = prompt_logprobs(rows, targets, req.request.top_logprobs_num)
        req.input_logprobs.extend(zip(lps, prompt[lo + 1 : hi + 1]))
        req.input_top_logprobs.extend(tops)

    @staticmethod
    def collect(req: Sample) -> TokenDelta:
        """The sample's progress since the last collect; clears the pending deltas."""
        out = TokenDelta(  # positional: a delta per sample per step
            req.rid,
            req.index,
            req.new_ids,
            req.finish_reason,
            len(req.request.input_ids),
            len(req.output_ids),
            max(req.cached_tokens, 0),
            req.cached_tiers,
            req.new_logprobs,
            req.new_top_logprobs,
            req.input_logprobs,
            req.input_top_logprobs,
        )
        req.new_ids, req.new_logprobs, req.new_top_logprobs = [], [], []
        req.input_logprobs, req.input_top_logprobs = [], []
        return out
