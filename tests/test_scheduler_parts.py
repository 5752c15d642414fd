"""A Scheduler built from parts in a test, without a model: a fake worker over a small pool.

The fake worker's "model" continues every sequence with (last token + 1): the scheduler's
batching, radix reuse, forking and KV accounting are checked exactly against that rule.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from radixserve.attention.flat import FlatBackend
from radixserve.config import EngineConfig
from radixserve.core.batch import ForwardBatch
from radixserve.core.params import SamplingParams
from radixserve.core.request import TokenDelta, TokenizedRequest
from radixserve.kvcache.pool import KVPool
from radixserve.models.config import ModelConfig
from radixserve.sampling.stop import StopChecker
from radixserve.scheduler.parts import build_parts
from radixserve.scheduler.policy import shares_uncached_prefix
from radixserve.scheduler.sample import Sample
from radixserve.scheduler.scheduler import Scheduler

VOCAB = 1000  # the fake's logits; token ids stay below every real special token


class CountingWorker:
    """Writes nothing real into the pool (zeros); logits put all mass on last id + 1."""

    def __init__(self, slots: int, context: int) -> None:
        self.model_config = ModelConfig(
            architecture="LlamaForCausalLM", hidden_size=8, num_layers=1, num_heads=1,
            num_kv_heads=1, head_dim=2, intermediate_size=8, vocab_size=VOCAB,
            rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
            max_position_embeddings=context, tie_word_embeddings=True, qkv_bias=False,
            o_bias=False, mlp_bias=False, eos_token_ids=(VOCAB - 1,),
        )  # fmt: skip
        self.pool = KVPool(slots, 1, 1, 2, torch.float32)
        self.dtype = torch.float32
        self.backend = FlatBackend()
        self.tokens_run = 0

    def forward(self, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        self.tokens_run += batch.input_ids.numel()
        nxt = (batch.input_ids[rows] + 1) % VOCAB
        logits = torch.full((rows.numel(), VOCAB), -30.0)
        logits[torch.arange(rows.numel()), nxt] = 30.0
        return logits

    def close(self) -> None:
        pass


def _scheduler(tokenizer: Any, **config: Any) -> tuple[Scheduler, CountingWorker]:
    cfg = EngineConfig(max_running_requests=8, **config)
    worker = CountingWorker(slots=257, context=128)
    return Scheduler(cfg, build_parts(cfg, "fake", tokenizer, worker)), worker


def _run(sched: Scheduler, *reqs: TokenizedRequest) -> dict[tuple[str, int], list[TokenDelta]]:
    outs: dict[tuple[str, int], list[TokenDelta]] = {}
    for r in reqs:
        sched.add_request(r)
    while sched.has_work():
        for o in sched.step():
            outs.setdefault((o.rid, o.index), []).append(o)
        sched.check_integrity()
    return outs


def _tokens(outs: list[TokenDelta]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def test_a_scheduler_runs_on_a_fake_worker_and_reuses_the_prefix(tokenizer: Any) -> None:
    sched, worker = _scheduler(tokenizer)
    assert sched.model_info.model_path == "fake" and sched.model_info.vocab_size == VOCAB
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    prompt = list(range(100, 140))
    first = _run(sched, TokenizedRequest("a", prompt, greedy))
    assert _tokens(first["a", 0]) == [140, 141, 142, 143, 144]
    assert first["a", 0][-1].finish_reason is not None
    assert first["a", 0][-1].finish_reason.type == "length"
    run_before = worker.tokens_run
    second = _run(sched, TokenizedRequest("b", [*prompt, 7], greedy))
    assert _tokens(second["b", 0]) == [8, 9, 10, 11, 12]
    assert second["b", 0][-1].cached_tokens == 40  # the whole first prompt came from the tree
    assert worker.tokens_run - run_before == 1 + 4  # one new prompt token, then 4 decodes
    assert sched.stats().kv_held_tokens == 0  # idle: nothing locked, nothing leaked


def test_fork_shares_the_prompt_and_each_sample_ends(tokenizer: Any) -> None:
    sched, worker = _scheduler(tokenizer)
    params = SamplingParams(temperature=0.0, max_new_tokens=3, n=4)
    outs = _run(sched, TokenizedRequest("f", list(range(10, 30)), params))
    assert sorted(outs) == [("f", i) for i in range(4)]
    assert all(_tokens(outs["f", i]) == [30, 31, 32] for i in range(4))
    assert worker.tokens_run == 20 + 4 * 2  # the prompt once, then 2 decodes per sample
    assert sched.stats().kv_held_tokens == 0


def test_eos_from_the_worker_ends_the_sample(tokenizer: Any) -> None:
    sched, _ = _scheduler(tokenizer)
    outs = _run(
        sched, TokenizedRequest("e", [VOCAB - 4], SamplingParams(temperature=0, max_new_tokens=9))
    )
    reason = outs["e", 0][-1].finish_reason
    assert reason is not None and (reason.type, reason.matched) == ("stop", VOCAB - 1)
    assert _tokens(outs["e", 0]) == [VOCAB - 3, VOCAB - 2, VOCAB - 1]  # the text hides eos


def test_a_running_samples_kept_path_follows_a_split(tokenizer: Any) -> None:
    """A sample keeps its radix path from step to step; when another request's match splits
    a node on it, the next batch carries the new path (and check_integrity compares every
    kept path with a fresh walk)."""
    sched, _ = _scheduler(tokenizer)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompt = list(range(100, 140))
    sched.add_request(TokenizedRequest("a", prompt, greedy))
    for _ in range(3):  # the prefill, then decode steps on the kept path
        sched.step()
        sched.check_integrity()
    (a,) = sched.running
    assert [n for _, n in sched.kv.path(a)] == [40]
    sched.add_request(TokenizedRequest("b", [*prompt[:20], 7, 8], greedy))
    sched.step()  # b's match splits a's node after 20 tokens
    sched.check_integrity()
    assert sched.last_batch is not None and sched.last_batch.paths[0] == sched.kv.path(a)
    assert sched.kv.path(a) == sched.cache.path(a.last_node)
    assert [n for _, n in sched.kv.path(a)] == [20, 20]
    outs = _run(sched)
    assert _tokens(outs["a", 0]) == list(range(144, 152))  # 140..143 came before


def _queued(ids: list[int], kv_len: int = 0) -> Sample:
    params = SamplingParams(max_new_tokens=4)
    return Sample(
        TokenizedRequest("r", ids, params), 0, StopChecker(params, [], None), kv_len=kv_len
    )


def test_a_sample_defers_only_behind_enough_shared_uncached_tokens() -> None:
    prefix = list(range(100, 164))  # 64 tokens
    first = _queued(prefix + [1, 2, 3])
    assert shares_uncached_prefix(_queued(prefix + [9]), [first], 32)
    assert shares_uncached_prefix(_queued(prefix[:32]), [first], 32)  # exactly 32 shared
    assert not shares_uncached_prefix(_queued(prefix[:31]), [first], 32)
    assert not shares_uncached_prefix(_queued([7] + prefix), [first], 32)  # differs at once
    # What the admitted sample already has cached does not count: 64 shared, 40 cached.
    cached = _queued(prefix + [1], kv_len=40)
    assert not shares_uncached_prefix(_queued(prefix + [5]), [cached], 32)
    assert shares_uncached_prefix(_queued(prefix + [5]), [cached], 24)
    assert not shares_uncached_prefix(_queued(prefix), [], 32)


@pytest.mark.parametrize("seed", range(6))
def test_sample_tables_hold_under_random_admit_finish_abort_retract(
    tokenizer: Any, seed: int
) -> None:
    """Random requests (shared prefixes, n up to 3, lengths that overflow a small pool so
    samples are retracted) and aborts at random steps: after every step the tables equal
    their recomputation from the queues (SampleTables.check, inside check_integrity) and
    the KV accounting holds; every sample ends exactly once, aborted ones as "abort", the
    others with all their tokens (the fake's rule: each token is the one before plus 1)."""
    rng = random.Random(seed)
    sched, _ = _scheduler(tokenizer, max_queued_requests=64)
    retracted = 0
    retract = sched.tables.retract

    def counting_retract(req: Sample) -> None:
        nonlocal retracted
        retracted += 1
        retract(req)

    sched.tables.retract = counting_retract  # type: ignore[method-assign]
    bases = [list(range(100 + 50 * b, 130 + 50 * b)) for b in range(3)]
    wanted: dict[str, tuple[list[int], int, int]] = {}  # prompt, max_new_tokens, n
    aborted: set[str] = set()
    outs: dict[tuple[str, int], list[TokenDelta]] = {}
    for step in range(300):
        if len(wanted) < 30 and rng.random() < 0.5:
            rid = f"r{len(wanted)}"
            prompt = rng.choice(bases)[: rng.randint(5, 30)] + [rng.randint(400, 600)]
            sp = SamplingParams(
                temperature=0, max_new_tokens=rng.randint(1, 90), n=rng.randint(1, 3)
            )
            sched.add_request(TokenizedRequest(rid, prompt, sp))
            wanted[rid] = (prompt, sp.max_new_tokens, sp.n)
        if wanted and rng.random() < 0.05:
            rid = rng.choice(sorted(wanted))
            sched.abort_request(rid)
            aborted.add(rid)
        for o in sched.step():
            outs.setdefault((o.rid, o.index), []).append(o)
        sched.check_integrity()
        if step > 200 and not sched.has_work():
            break
    outs_left = _run(sched)
    for key, deltas in outs_left.items():
        outs.setdefault(key, []).extend(deltas)
    assert not sched.tables.by_rid and not sched.waiting and not sched.running
    ends = {key: [d for d in deltas if d.finish_reason is not None] for key, deltas in outs.items()}
    assert all(len(e) == 1 for e in ends.values()), "a sample ended twice or never"
    for (rid, index), deltas in outs.items():
        prompt, max_new, _ = wanted[rid]
        reason = ends[rid, index][0].finish_reason
        assert reason is not None
        if reason.type == "abort":
            assert rid in aborted
            continue
        assert reason.type == "length", reason
        assert _tokens(deltas) == [prompt[-1] + 1 + i for i in range(max_new)]
    assert sorted(outs) == sorted((rid, i) for rid, (_, _, n) in wanted.items() for i in range(n))
    assert retracted > 0, "the pool never filled: no sample was retracted"


def test_a_split_off_the_running_paths_keeps_them_and_the_decode_run(tokenizer: Any) -> None:
    """Paths are invalidated per node: a split of a node no running sample's path lists
    leaves every kept path (the same list) and the decode batch continues
    (ForwardBatch.follows); a split on a path ends both."""
    sched, _ = _scheduler(tokenizer)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    for rid, start in (("a", 100), ("b", 200)):
        sched.add_request(TokenizedRequest(rid, list(range(start, start + 40)), greedy))
    for _ in range(3):  # the prefills, then decode steps
        sched.step()
    a, b = sched.running
    kept = (sched.kv.path(a), sched.kv.path(b))

    def insert(key: list[int]) -> None:
        slots = sched.kv.pool.alloc(len(key))
        assert slots is not None
        sched.cache.insert(key, slots)

    insert(list(range(300, 320)))
    version = sched.cache.path_version
    insert([*range(300, 310), 999])  # splits the node of 300..319, on no running path
    assert sched.cache.path_version == version + 1
    sched.step()
    sched.check_integrity()
    assert sched.last_batch is not None and sched.last_batch.follows is not None
    assert sched.kv.path(a) is kept[0] and sched.kv.path(b) is kept[1]
    insert([*range(100, 120), 999])  # splits a's prompt node
    sched.step()
    sched.check_integrity()
    assert sched.last_batch is not None and sched.last_batch.follows is None
    assert [n for _, n in sched.kv.path(a)] == [20, 20] and sched.kv.path(b) is kept[1]
