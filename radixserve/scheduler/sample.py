"""One sample's state inside the scheduler.

Region table for a running sample (positions into all_ids = prompt_ids + output_ids):

    |<--------------------------- len(all_ids) --------------------------->|
    |<------------------- kv_len ------------------->|<-- next input ---->|
    |<------ tree_len ------>|<- owned by the req ->|                     |
    |  radix path of         |  slots the request    |  tokens whose K/V   |
    |  last_node (locked)    |  allocated itself     |  is not computed    |
    req_to_token[row, 0:kv_len] holds the slot of every position < kv_len.

With prompt modules (request.modules) positions 0 .. module_tokens-1 hold the imported
modules' slots, owned by the ModuleStore: tree_len = module_tokens, last_node = the root,
and nothing of the request goes into the prefix cache. Such a sample's token i sits at
`positions(i, i + 1)`, not at position i.

While a step computes, req_to_token[row, kv_len:alloc_end] holds the slots allocated for
its new inputs (and draft); processing the step moves kv_len up to alloc_end, and a sample
ended by a failed step frees them (`KVManager.release`).

Invariants: tree_len <= kv_len < len(all_ids) while running (the last token's K/V is
computed by the step that consumes it); alloc_end <= kv_len between steps; a waiting sample
has row None and kv_len 0.

State kept across steps, never rebuilt per step: `all_ids` (the prompt copied once, each
output token appended beside output_ids by `append_output`), `path` (the shared segments
of last_node, read again only when last_node changes or a split moved some node: see
`KVManager.path`) and `sampling_info` (what the sampler reads, over the live output_ids).
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field

from radixserve.constrained.backend import GrammarState
from radixserve.core.params import SamplingParams
from radixserve.core.request import (
    CacheSalt,
    FinishReason,
    PromptLogprob,
    TokenizedRequest,
    TokenLogprob,
)
from radixserve.kvcache.radix import TreeNode
from radixserve.sampling.sampler import SamplingInfo
from radixserve.sampling.stop import StopChecker
from radixserve.scheduler.draft_tree import Draft
from radixserve.scheduler.ngram import NgramIndex


@dataclass(eq=False)
class Sample:
    request: TokenizedRequest
    index: int  # sample index within the request (0..n-1)
    stop: StopChecker
    output_ids: list[int] = field(default_factory=list)
    row: int | None = None  # req_to_token row while admitted
    kv_len: int = 0
    tree_len: int = 0
    alloc_end: int = 0  # end of the slots allocated for the step being computed
    last_node: TreeNode | None = None  # locked while admitted
    swa_from: int = 0  # own positions before it have no sliding-window K/V (KVManager.trim_swa)
    cached_tokens: int = -1  # prompt tokens found in the cache at first admission
    cached_tiers: dict[str, int] = field(default_factory=dict)  # those tokens by KV tier
    fork_pending: bool = False  # n > 1: fork the other samples once the prompt is done
    finish_reason: FinishReason | None = None
    arrival: int = 0  # admission order key for fcfs
    # regex / json_schema: this sample's own automaton state, advanced with every output
    # token; kept across retraction (like output_ids). None: unconstrained.
    grammar: GrammarState | None = None
    # Deltas not yet reported (cleared by the scheduler each step).
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    new_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    input_logprobs: list[PromptLogprob] = field(default_factory=list)
    input_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    # Speculative decoding (speculative.py): this step's token tree, fed after the last
    # token.
    draft: Draft = field(default_factory=Draft)
    ngrams: NgramIndex = field(default_factory=NgramIndex)  # its own tokens, for ngram drafts
    # Kept across steps (module docstring).
    all_ids: list[int] = field(init=False)  # prompt_ids + output_ids
    path: list[tuple[int, int]] | None = None  # last_node's shared segments; None: unread
    path_version: int = -1  # the cache's path_version when `path` was read
    sampling_info: SamplingInfo = field(init=False)
    eos_ids: InitVar[frozenset[int]] = frozenset()  # the model's, for the sampler

    def __post_init__(self, eos_ids: frozenset[int]) -> None:
        self.all_ids = self.request.input_ids + self.output_ids
        self.sampling_info = SamplingInfo(
            params=self.request.sampling,
            prompt_ids=self.request.input_ids,
            output_ids=self.output_ids,  # the live list: its length keys the seeded draws
            eos_token_ids=eos_ids,
            sample_index=self.index,
            return_logprob=self.request.return_logprob,
            need_top_logprobs=self.request.top_logprobs_num if self.request.return_logprob else 0,
            grammar=self.grammar,
        )

    @property
    def rid(self) -> str:
        return self.request.rid

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def salt(self) -> CacheSalt:
        """The part of the prefix cache it reads and writes."""
        return self.request.salt

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.input_ids

    @property
    def seq_len(self) -> int:
        return len(self.all_ids)

    def append_output(self, token: int) -> None:
        """A new output token, in output_ids and all_ids alike."""
        self.output_ids.append(token)
        self.all_ids.append(token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.request.return_logprob and self.request.logprob_start_len >= 0

    def positions(self, start: int, end: int) -> list[int]:
        """The positions of tokens start .. end-1 of all_ids (computed ones only: with
        modules, start >= module_tokens)."""
        use = self.request.modules
        if use is None:
            return list(range(start, end))
        head = self.request.module_tokens
        assert start >= head, f"{self.rid}: token {start} is a module's, not computed here"
        own, n = use.positions, len(self.request.input_ids)
        outputs = [own[-1] + 1 + i - n for i in range(max(start, n), end)]  # after the prompt
        return own[start - head : end - head] + outputs

    def reuse_limit(self) -> int:
        """How many leading tokens may come from the cache: all but the last token (its
        logits are needed); with prompt logprobs from position k, the logits of position
        k - 1 (which score token k) are needed too."""
        limit = self.seq_len - 1
        if self.wants_prompt_logprobs and not self.output_ids:
            limit = min(limit, self.request.logprob_start_len - 1)
        return max(limit, 0)
