"""The parts a Scheduler runs on, built beside it and handed in.

`load_parts(config)` loads the real ones (tokenizer, model worker with its KV pool, radix
cache, grammar compiler); a test may hand a Scheduler its own (a fake worker over a small
pool), so no scheduler needs a model to exist. The caller keeps the parts: it closes the
worker and reads the tokenizer itself, not through the scheduler.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixserve.attention.base import AttentionBackend
from radixserve.config import EngineConfig
from radixserve.constrained.grammar import GrammarCompiler
from radixserve.core.batch import ForwardBatch
from radixserve.kvcache.hicache import pool_layout
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.prefix_cache import PrefixCache, make_prefix_cache
from radixserve.models.config import ModelConfig
from radixserve.models.identity import model_identity
from radixserve.models.loader import load_tokenizer
from radixserve.models.resolve import resolve_model_path
from radixserve.models.rope import inv_freq
from radixserve.worker.model_worker import ModelWorker

logger = logging.getLogger("radixserve.scheduler.parts")


class StepWorker(Protocol):
    """What the scheduler needs of a model worker (radixserve.worker.ModelWorker).

    `forward(batch, rows)` writes the batch's new K/V into `pool` and returns float32 logits
    (len(rows), vocab) for the flattened token rows `rows`.
    """

    pool: KVPool
    model_config: ModelConfig
    dtype: torch.dtype
    backend: AttentionBackend

    def forward(self, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass
class SchedulerParts:
    model_path: str
    tokenizer: Any  # a transformers fast tokenizer
    worker: StepWorker
    cache: PrefixCache  # over worker.pool
    grammars: GrammarCompiler
    drafter: StepWorker | None = None  # the draft model (speculative_algorithm draft-model)


def build_parts(
    config: EngineConfig, model_path: str, tokenizer: Any, worker: StepWorker
) -> SchedulerParts:
    """The cache and grammar compiler that go with a worker and tokenizer."""
    mc = worker.model_config
    identity = tier_identity(config, model_path, worker) if config.hicache_enabled else ""
    freqs = inv_freq(mc.rope) if mc.uniform_rope else None
    cache = make_prefix_cache(config, worker.pool, identity, freqs)
    grammars = GrammarCompiler(
        tokenizer, mc.eos_token_ids, mc.vocab_size, backend=config.grammar_backend
    )
    return SchedulerParts(model_path, tokenizer, worker, cache, grammars)


def tier_identity(config: EngineConfig, model_path: str, worker: StepWorker) -> str:
    """The namespace of this server's K/V in the shared tiers: the model's files and how this
    server runs them (models/identity.py)."""
    runtime = {
        "quantization": config.quantization,
        "native_ops": config.native_ops,
        "dtype": str(worker.dtype),
        "kv_layout": str(pool_layout(worker.pool)),
        "tp_size": config.tp_size,
    }
    return model_identity(model_path, runtime)


def load_parts(config: EngineConfig) -> SchedulerParts:
    """Load the model named by the config (its tokenizer, weights, KV pool) and build the rest."""
    path = resolve_model_path(config.model, config.revision)
    tokenizer = load_tokenizer(path)
    parts = build_parts(config, str(path), tokenizer, ModelWorker(config, str(path)))
    if config.speculative_draft_model_path is not None:
        try:
            parts.drafter = load_drafter(config, parts.worker, tokenizer)
        except BaseException:
            parts.worker.close()
            raise
    return parts


def load_drafter(config: EngineConfig, target: StepWorker, tokenizer: Any) -> ModelWorker:
    """The draft model: its own worker (one rank, flat attention, its file's weight format,
    the model's dtype) over a KV pool of as many tokens as the target's. Raises ValueError
    when its vocabulary or tokenizer (`tokenizer` is the model's) is not the model's. A
    shorter context than the model's is logged: drafts stop where it ends."""
    assert config.speculative_draft_model_path is not None
    path = resolve_model_path(config.speculative_draft_model_path, None)
    draft_config = dataclasses.replace(
        config,
        model=str(path),
        tp_size=1,
        quantization="auto",
        attention_backend="flat",
        max_total_tokens=target.pool.capacity,
    )
    worker = ModelWorker(draft_config, str(path))
    try:
        check_draft_model(worker.model_config, target.model_config)
        check_same_tokens(load_tokenizer(path), tokenizer)
    except BaseException:
        worker.close()
        raise
    return worker


def check_draft_model(draft: ModelConfig, model: ModelConfig) -> None:
    """ValueError unless the draft model's vocabulary is the model's size; a warning when
    its context is shorter than the model's."""
    if draft.vocab_size != model.vocab_size:
        raise ValueError(
            f"speculative_draft_model_path: the draft model's vocabulary has "
            f"{draft.vocab_size} tokens, the model's {model.vocab_size}: a draft model must "
            "share the model's tokenizer"
        )
    if draft.max_position_embeddings < model.max_position_embeddings:
        logger.warning(
            "the draft model's context is %d positions, the model's %d: no drafts past position %d",
            draft.max_position_embeddings,
            model.max_position_embeddings,
            draft.max_position_embeddings,
        )


def check_same_tokens(draft: Any, model: Any) -> None:
    """ValueError unless the draft model's tokenizer gives each token id the model's token
    string (a vocabulary of the same size can still number its tokens otherwise)."""
    ids = list(range(max(len(draft), len(model))))
    pairs = zip(draft.convert_ids_to_tokens(ids), model.convert_ids_to_tokens(ids))
    for i, (got, want) in enumerate(pairs):
        if got != want:
            raise ValueError(
                f"speculative_draft_model_path: token id {i} is {got!r} in the draft model's "
                f"tokenizer, {want!r} in the model's: a draft model must share the model's "
                "tokenizer"
            )
