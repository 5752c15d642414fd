"""`select`: scoring the options by the model's log-likelihood, and choosing one.

The backend scores every option in one batch of prefill-only requests: option c is scored on
the tokens of `encode(prompt + c)` after its common prefix with `encode(prompt)`. The cut is
made in token space, not at the character boundary, because BPE may merge the last prompt
characters with the first option characters; the merged token then belongs to the option.

    encode(prompt)      [ t0 t1 ... t_{k-1} | t_k ... ]        (prompt tokens)
    encode(prompt + c)  [ t0 t1 ... t_{k-1} | u_k ... u_{m-1} ] (k = common prefix)
                                              ^ scored: log p(u_j | u_<j), j = k .. m-1

Choice methods (SGLang's names) turn the scores into a decision:
- `token_length_normalized` (default): the highest mean token logprob.
- `greedy_token_selection`: the option greedy decoding would follow token by token.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.core.request import PromptLogprob


@dataclass(frozen=True)
class ChoiceScores:
    """The model's scores of each option given the prompt (index-aligned with `choices`)."""

    choices: list[str]
    token_ids: list[list[int]]  # the scored tokens of each option
    token_logprobs: list[list[float]]  # log p(token | everything before it), same shape

    @property
    def normalized(self) -> list[float]:
        """Mean token logprob of each option (token-length normalised log-likelihood)."""
        return [sum(lp) / len(lp) for lp in self.token_logprobs]

    def meta_info(self, method: ChoicesMethod) -> dict[str, Any]:
        return {
            "choices_method": method.name,
            "normalized_prompt_logprobs": self.normalized,
            "input_token_logprobs": [
                [[lp, t] for lp, t in zip(lps, ids)]
                for lps, ids in zip(self.token_logprobs, self.token_ids)
            ],
        }


class ChoicesMethod(ABC):
    name: str

    @abstractmethod
    def decide(self, scores: ChoiceScores) -> int:
        """Index of the chosen option (ties: the first)."""


class TokenLengthNormalized(ChoicesMethod):
    name = "token_length_normalized"

    def decide(self, scores: ChoiceScores) -> int:
        norm = scores.normalized
        return max(range(len(norm)), key=lambda i: (norm[i], -i))


class GreedyTokenSelection(ChoicesMethod):
    """Follow the greedy path: at token j keep the options whose token j is the most likely
    one among the remaining options; an option that already ended competes with its mean
    logprob against that best token (SGLang's rule for an option that prefixes another)."""

    name = "greedy_token_selection"

    def decide(self, scores: ChoiceScores) -> int:
        ids, lps = scores.token_ids, scores.token_logprobs
        mean = scores.normalized
        cand, j = list(range(len(ids))), 0
        while len(cand) > 1:
            alive = [c for c in cand if len(ids[c]) > j]
            ended = [c for c in cand if len(ids[c]) <= j]
            if not alive:
                return max(ended, key=lambda c: (mean[c], -c))
            best = max(alive, key=lambda c: (lps[c][j], -c))
            if ended:
                top = max(ended, key=lambda c: (mean[c], -c))
                if mean[top] >= lps[best][j]:
                    return top
            cand = [c for c in alive if ids[c][j] == ids[best][j]]
            j += 1
        return cand[0]


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()


def choose(
    scores: ChoiceScores, method: ChoicesMethod, temperature: float, rng: random.Random
) -> int:
    """The decision: `method`'s at temperature 0; otherwise a draw from
    softmax(normalized / temperature) (the method is then not used)."""
    assert temperature >= 0, f"select temperature must be >= 0, got {temperature}"
    if temperature == 0:
        return method.decide(scores)
    norm = scores.normalized
    top = max(norm)
    weights = [math.exp((x - top) / temperature) for x in norm]
    return rng.choices(range(len(norm)), weights=weights)[0]


# A batch of prefill-only scoring requests: (input ids, first position to score) -> the
# logprobs of ids[start:], one list per request.
ScoreFn = Callable[[list[tuple[list[int], int]]], list[list[PromptLogprob]]]


def score_choices(
    encode: Callable[[str], list[int]], score: ScoreFn, prompt: str, choices: Sequence[str]
) -> ChoiceScores:
    """Score every option of a select in one batch (see the module docstring).

    Raises ValueError for an empty option list, an empty option, or an option that adds no
    token with a logprob (an empty prompt leaves the first token unscored).
    """
    if not choices:
        raise ValueError("select needs at least one choice")
    base = encode(prompt)
    reqs, spans = [], []
    for c in choices:
        if not c:
            raise ValueError(f"select choices must be non-empty strings, got {list(choices)!r}")
        full = encode(prompt + c)
        k = _common_prefix(base, full)
        assert k < len(full), f"choice {c!r} added no token to the prompt"
        reqs.append((full, k))
        spans.append(full[k:])
    results = score(reqs)
    ids, lps = [], []
    for c, span, entries in zip(choices, spans, results):
        assert [t for _, t in entries] == span, f"choice {c!r}: scored {entries} for {span}"
        scored = [(lp, t) for lp, t in entries if lp is not None]
        if not scored:
            raise ValueError(f"select choice {c!r} has no scored token (is the prompt empty?)")
        lps.append([lp for lp, _ in scored])
        ids.append([t for _, t in scored])
    return ChoiceScores(list(choices), ids, lps)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
