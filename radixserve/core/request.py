"""What goes into the scheduler and what comes out of it (in-process and over IPC alike).

A request with `sampling.n > 1` is prefilled once and forked into n samples that share the
prompt's KV; each sample reports under the same `rid` with its own `index` (0..n-1).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from radixserve.core.modules import ModuleUse
from radixserve.core.params import SamplingParams


@dataclass(frozen=True)
class CacheSalt:
    """The part of the prefix cache a request reads and writes: requests share cached K/V
    (radix nodes, lower-tier records, radix drafts) only when their salts are equal.

    `tenant`: the tenant's name under `--cache-isolation tenant`, else ""; `salt`: the
    request's own `cache_salt` ("" for none). Both empty: the shared part, the default."""

    tenant: str = ""
    salt: str = ""

    @property
    def shared(self) -> bool:
        return not (self.tenant or self.salt)

    def digest(self) -> str:
        """A fixed-length name of the salt (64 hex digits): what other key text may follow."""
        return hashlib.sha256(json.dumps([self.tenant, self.salt]).encode()).hexdigest()


SHARED = CacheSalt()


@dataclass
class TokenizedRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs; k >= 0: prompt positions k.. onward
    top_logprobs_num: int = 0
    # Prompt modules: input_ids open with these modules' tokens, whose K/V is registered
    # (see core/modules.py); None: an ordinary prompt at positions 0 .. len - 1.
    modules: ModuleUse | None = None
    salt: CacheSalt = SHARED  # the part of the prefix cache it shares (CacheSalt)

    @property
    def module_tokens(self) -> int:
        """Leading input_ids whose K/V comes from registered modules."""
        return 0 if self.modules is None else len(self.input_ids) - len(self.modules.positions)

    @property
    def num_positions(self) -> int:
        """Positions the prompt spans: its last token's position + 1."""
        return len(self.input_ids) if self.modules is None else self.modules.positions[-1] + 1


@dataclass
class FinishReason:
    type: str  # "stop" | "length" | "abort" | "error"
    matched: int | str | None = None  # stop token id or stop string; abort, error: message
    status: int | None = None  # "error": the HTTP status (4xx the request's fault, 500 ours)

    def to_dict(self) -> dict[str, object]:
        return {"type": self.type, "matched": self.matched}


# One logprob entry: (logprob, token_id). Top-k entries are lists of those.
TokenLogprob = tuple[float, int]
# A prompt token's entry: the very first token of a sequence has no logprob (None).
PromptLogprob = tuple[float | None, int]


@dataclass
class TokenDelta:
    """Progress of one sample since its previous TokenDelta (not cumulative).

    `new_token_ids` includes the token that ended the sample when it is a stop token (eos or
    `stop_token_ids`); the detokenizer keeps such an id out of the text and cuts a matched
    stop string from the text using `finish_reason.matched`.
    """

    rid: str
    index: int
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None  # set on the last output of a sample
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] = field(default_factory=dict)  # by KV tier
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    # Prompt logprobs arrive once, with the first output: entry i is for prompt token
    # logprob_start_len + i; the very first prompt token has no logprob (None).
    input_logprobs: list[PromptLogprob] = field(default_factory=list)
    input_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# A logprob entry as clients get it: (logprob or None for the first prompt token, token id,
# token text or None when the client did not ask for texts).
TextLogprob = tuple[float | None, int, str | None]


@dataclass
class TextDelta:
    """A `TokenDelta` with its text (deltas): `text` is the output text that became stable
    with it (stop strings cut); the logprob entries carry their token texts when asked for.
    Made by `tokenizer.accumulate.SampleAccumulator`; what the api server receives."""

    rid: str
    index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: dict[str, int] = field(default_factory=dict)  # by KV tier
    text: str = ""
    output_logprobs: list[TextLogprob] = field(default_factory=list)
    output_top_logprobs: list[list[TextLogprob]] = field(default_factory=list)
    input_logprobs: list[TextLogprob] = field(default_factory=list)
    input_top_logprobs: list[list[TextLogprob]] = field(default_factory=list)
