"""Scheduler + Engine behaviour on a tiny random Llama (fp32): the same greedy output alone,
in a mixed continuous batch, after a radix hit, after retraction, chunked, cache disabled
(which reuses and leaks nothing); KV accounting exact after every run."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_all_free

from radixserve import Engine

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def make_engine(model_dir: Path, **kw: Any) -> Engine:
    cfg: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 4096}
    cfg.update(kw)
    return Engine(str(model_dir), **cfg)


def prompts(n: int, length: int = 20, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 20000, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def run_alone(engine: Engine, ids: list[int], params: dict[str, Any] = GREEDY) -> list[int]:
    out = engine.generate(input_ids=ids, sampling_params=params)
    assert isinstance(out, dict)
    return out["output_ids"]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return make_engine(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(engine: Engine) -> list[list[int]]:
    """Greedy outputs of 8 prompts, each run alone on an empty cache."""
    outs = []
    for ids in prompts(8):
        engine.flush_cache()
        outs.append(run_alone(engine, ids))
    assert_all_free(engine)
    return outs


def test_batch_equals_alone(engine: Engine, reference: list[list[int]]) -> None:
    outs = engine.generate(input_ids=prompts(8), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "matched": None} for o in outs)
    assert_all_free(engine)


def test_radix_hit_same_output(engine: Engine, reference: list[list[int]]) -> None:
    ids = prompts(8)[3]
    first = engine.generate(input_ids=ids, sampling_params=GREEDY)
    second = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert first["output_ids"] == second["output_ids"] == reference[3]
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == len(ids) - 1  # all but the last token
    engine.check_integrity()
    # A continuation shares prompt + output: the whole first sequence is cached.
    cont = ids + first["output_ids"] + [42]
    third = engine.generate(input_ids=cont, sampling_params=GREEDY)
    assert third["meta_info"]["cached_tokens"] == len(ids) + len(first["output_ids"]) - 1
    assert_all_free(engine)


@pytest.mark.parametrize(
    "kw",
    [
        {"max_total_tokens": 160},  # forces eviction and retraction
        {"chunked_prefill_size": 16},
        {"disable_radix_cache": True},
        {"schedule_policy": "fcfs"},
        {"attention_backend": "flat"},
        {"max_running_requests": 3},
    ],
    ids=["retract", "chunked", "no-cache", "fcfs", "flat", "max-running-3"],
)
def test_configs_same_output(tiny_model_dir: Path, reference: list[list[int]], kw: dict) -> None:
    eng = make_engine(tiny_model_dir, **kw)
    outs = eng.generate(input_ids=prompts(8), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference
    if kw.get("disable_radix_cache"):
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    assert_all_free(eng)


def test_retraction_happens(tiny_model_dir: Path, reference: list[list[int]]) -> None:
    eng = make_engine(tiny_model_dir, max_total_tokens=160)
    computed_alone = sum(len(p) + len(r) - 1 for p, r in zip(prompts(8), reference))
    eng.generate(input_ids=prompts(8), sampling_params=GREEDY)
    # Retraction re-queues samples; any evicted K/V they had is computed again.
    assert eng.scheduler.stats().computed_tokens_total > computed_alone


@pytest.mark.timeout(60)  # the samples used to wait for one another forever
def test_samples_that_together_overflow_the_pool_all_finish(
    tiny_model_dir: Path, engine: Engine
) -> None:
    """A 120-token prompt and 8 samples of 8 tokens need 184 slots of a 160-slot pool: the
    newest samples are retracted and come back one by one while the rest finish."""
    ids = prompts(1, length=120, seed=3)[0]
    params = {"temperature": 1.0, "max_new_tokens": 8, "n": 8, "seed": 11, "ignore_eos": True}
    small = make_engine(tiny_model_dir, max_total_tokens=160)
    outs = small.generate(input_ids=ids, sampling_params=params)
    roomy = engine.generate(input_ids=ids, sampling_params=params)
    assert isinstance(outs, list) and isinstance(roomy, list)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in roomy]
    assert small.scheduler.stats().computed_tokens_total > len(ids) + 8 * 7  # it retracted
    assert_all_free(small)
    assert_all_free(engine)


def test_fork_shares_prompt(engine: Engine) -> None:
    ids = prompts(1, length=60, seed=5)[0]
    engine.flush_cache()
    before = engine.scheduler.stats().computed_tokens_total
    params = {"temperature": 1.0, "max_new_tokens": 8, "n": 6, "seed": 7, "ignore_eos": True}
    outs = engine.generate(input_ids=ids, sampling_params=params)
    assert isinstance(outs, list) and len(outs) == 6
    computed = engine.scheduler.stats().computed_tokens_total - before
    # Prompt once, then 7 decode inputs per sample (the 8th token needs no forward).
    assert computed == len(ids) + 6 * 7
    assert len({tuple(o["output_ids"]) for o in outs}) > 1, "samples of a fork must differ"
    again = engine.generate(input_ids=ids, sampling_params=params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]  # seeded
    assert_all_free(engine)


def fail_forward(engine: Engine, monkeypatch: pytest.MonkeyPatch, nth: int) -> None:
    """From now on, the `nth` call of the engine's model forward raises (once)."""
    forward = engine.worker.forward
    calls = itertools.count(1)

    def faulty(batch: Any, rows: torch.Tensor) -> torch.Tensor:
        if next(calls) == nth:
            raise RuntimeError("injected fault")
        return forward(batch, rows)

    monkeypatch.setattr(engine.worker, "forward", faulty)


@pytest.mark.parametrize("nth", [1, 4])  # a prefill, a decode step
def test_a_step_that_raises_fails_its_requests_and_the_engine_goes_on(
    engine: Engine, reference: list[list[int]], monkeypatch: pytest.MonkeyPatch, nth: int
) -> None:
    """The forward of a step raises: the requests of that step end with an error naming it
    (500: a RuntimeError from the engine), every slot and table row they held comes back,
    and the next request is served."""
    fail_forward(engine, monkeypatch, nth)
    with pytest.raises(RuntimeError, match="internal error: RuntimeError: injected fault"):
        engine.generate(input_ids=prompts(3, seed=9), sampling_params=GREEDY)
    assert engine.scheduler.kv.req_pool.num_free == engine.config.max_running_requests
    assert_all_free(engine)
    assert run_alone(engine, prompts(1)[0]) == reference[0]
    assert_all_free(engine)


def test_no_cache_reuses_nothing_and_leaks_nothing(
    tiny_model_dir: Path,
    engine: Engine,
    reference: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--disable-radix-cache: no sample ever holds cache slots (tree_len 0 at every step,
    integrity checked after every step), a repeated prompt and the samples of a fork compute
    their whole prompt again, and every slot is free once idle without a flush."""
    eng = make_engine(tiny_model_dir, disable_radix_cache=True)
    sched, pool = eng.scheduler, eng.scheduler.kv.pool
    step = sched.step

    def checked_step() -> list[Any]:
        outs = step()
        sched.check_integrity()
        assert [r.tree_len for r in sched.running] == [0] * len(sched.running)
        return outs

    monkeypatch.setattr(sched, "step", checked_step)
    ids = prompts(8)[3]
    for _ in range(2):
        before = sched.stats().computed_tokens_total
        out = eng.generate(input_ids=ids, sampling_params=GREEDY)
        assert out["output_ids"] == reference[3] and out["meta_info"]["cached_tokens"] == 0
        assert sched.stats().computed_tokens_total - before == len(ids) + 11  # no reuse
        assert pool.num_free == pool.capacity  # nothing kept: no flush needed
    fork_ids = prompts(1, length=60, seed=5)[0]
    params = {"temperature": 1.0, "max_new_tokens": 8, "n": 6, "seed": 7, "ignore_eos": True}
    before = sched.stats().computed_tokens_total
    outs = eng.generate(input_ids=fork_ids, sampling_params=params)
    assert isinstance(outs, list)
    # Samples 1..5 cannot share sample 0's prompt K/V: each prefills the prompt itself.
    assert sched.stats().computed_tokens_total - before == 6 * len(fork_ids) + 6 * 7
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0] * 6
    engine.flush_cache()
    shared = engine.generate(input_ids=fork_ids, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in shared]  # seeded
    stats = sched.stats()
    assert (stats.cached_tokens_total, stats.kv_used_tokens, stats.kv_held_tokens) == (0, 0, 0)
    assert pool.num_free == pool.capacity and eng.flush_cache()
    assert pool.num_free == pool.capacity
    assert_all_free(engine)


def test_seed_independent_of_batch(engine: Engine) -> None:
    sampled = {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 10, "seed": 123}
    ids = prompts(4)
    alone = run_alone(engine, ids[2], sampled)
    batch = engine.generate(input_ids=ids, sampling_params=[GREEDY, GREEDY, sampled, GREEDY])
    assert batch[2]["output_ids"] == alone
    assert_all_free(engine)


UNSEEDED = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True}  # no "seed"


def first_unseeded_outputs(model_dir: Path, random_seed: int) -> tuple[list[list[int]], float]:
    """A fresh engine's outputs for 4 prompts without a seed (64 drawn tokens), and the log
    of the probability that an independent random stream draws exactly these outputs: the
    sum of the drawn tokens' logprobs (temperature 1, no filters: the model's distribution)."""
    eng = make_engine(model_dir, random_seed=random_seed)
    outs = eng.generate(input_ids=prompts(4), sampling_params=UNSEEDED, return_logprob=True)
    log_p = sum(lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"])
    return [o["output_ids"] for o in outs], log_p


def test_random_seed_fixes_unseeded_draws(tiny_model_dir: Path) -> None:
    """EngineConfig.random_seed: same seed, same tokens in fresh engines; another seed,
    other tokens (a collision has probability exp(log_p), asserted below 1e-9)."""
    outs, log_p = first_unseeded_outputs(tiny_model_dir, 7)
    assert first_unseeded_outputs(tiny_model_dir, 7)[0] == outs
    assert log_p < math.log(1e-9), f"draws too predictable for the test: log P {log_p:.1f}"
    assert first_unseeded_outputs(tiny_model_dir, 8)[0] != outs


def test_fast_path_choices_come_from_the_config(
    tiny_model_dir: Path, reference: list[list[int]]
) -> None:
    """The reference paths chosen in EngineConfig give the greedy outputs of the fast ones;
    each engine's worker sets the process-wide kernel switches from its own config."""
    from radixserve import kernels
    from radixserve.config import EngineConfig
    from radixserve.native_build import native_ops_enabled, use_native_ops

    before = native_ops_enabled(), kernels.get_impl()
    try:
        slow = make_engine(
            tiny_model_dir, native_ops=False, attention_kernels="reference", packed_linear="off"
        )
        assert (native_ops_enabled(), kernels.get_impl()) == (False, "reference")
        outs = slow.generate(input_ids=prompts(8), sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == reference
        make_engine(tiny_model_dir, max_total_tokens=64)
        assert (native_ops_enabled(), kernels.get_impl()) == (EngineConfig().native_ops, "auto")
    finally:
        use_native_ops(before[0])
        kernels.set_impl(before[1])


def test_max_new_tokens_zero_caches_prompt(engine: Engine) -> None:
    ids = prompts(1, length=40, seed=9)[0]
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["first_token_latency"] is None  # no token: no time to it
    hit = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert hit["meta_info"]["cached_tokens"] == len(ids) - 1
    meta = hit["meta_info"]
    assert 0 < meta["first_token_latency"] < meta["e2e_latency"], meta
    assert_all_free(engine)


def test_stop_string_across_tokens(engine: Engine) -> None:
    ids = prompts(1, seed=11)[0]
    full = engine.generate(input_ids=ids, sampling_params=GREEDY)
    text = full["text"]
    pieces = [engine.tokenizer.decode([t]) for t in full["output_ids"]]
    # A stop string spanning the boundary between output tokens 3 and 4.
    cut = len("".join(pieces[:3]))
    stop = text[cut - 1 : cut + 2]
    assert len(stop) == 3
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    assert_all_free(engine)


def test_stop_token_ids(engine: Engine, reference: list[list[int]]) -> None:
    ids, ref = prompts(8)[0], reference[0]
    out = engine.generate(input_ids=ids, sampling_params={**GREEDY, "stop_token_ids": [ref[4]]})
    stop_at = ref.index(ref[4])
    assert out["output_ids"] == ref[: stop_at + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[4]}
    assert out["text"] == engine.tokenizer.decode(ref[:stop_at])
    assert_all_free(engine)


def test_logprobs_match_hf(engine: Engine, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    ids = prompts(1, length=12, seed=3)[0]
    out = engine.generate(
        input_ids=ids,
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=2,
    )
    meta = out["meta_info"]
    full = ids + out["output_ids"]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    want_in = [logp[i - 1, full[i]].item() for i in range(1, len(ids))]
    got_in = meta["input_token_logprobs"]
    assert got_in[0] == [None, ids[0], None]
    assert [e[1] for e in got_in] == ids
    assert max(abs(a[0] - b) for a, b in zip(got_in[1:], want_in)) < 1e-4
    want_out = [logp[len(ids) - 1 + i, t].item() for i, t in enumerate(out["output_ids"])]
    got_out = [e[0] for e in meta["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got_out, want_out)) < 1e-4
    top = meta["output_top_logprobs"][0]
    assert len(top) == 2 and top[0][1] == out["output_ids"][0]  # greedy = top-1
    assert math.isclose(top[0][0], got_out[0], abs_tol=1e-6)
    assert_all_free(engine)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"input_ids": []}, "input_ids"),
        ({"input_ids": [1, 2, 10**7]}, "input_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 5000}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"prompt": 5}, "prompt"),
    ],
)
def test_bad_input_is_a_clear_error(engine: Engine, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)
    assert_all_free(engine)


@pytest.mark.parametrize("chunked", [False, True])
def test_abort_before_fork_finishes_every_sample(tiny_model_dir: Path, chunked: bool) -> None:
    """n = 3 aborted while queued, or mid-prefill (chunked, its prompt not done): all three
    samples report 'abort' and the request holds nothing afterwards."""
    from radixserve.core.params import SamplingParams
    from radixserve.core.request import TokenizedRequest

    eng = make_engine(tiny_model_dir, chunked_prefill_size=16, max_prefill_tokens=16)
    sched = eng.scheduler
    params = SamplingParams(max_new_tokens=4, n=3)
    sched.add_request(TokenizedRequest("fam", prompts(1, length=40)[0], params))
    if chunked:
        sched.step()  # the first 16-token chunk of the prompt
        assert sched.running and next(iter(sched.running)).fork_pending
    sched.abort_request("fam")
    outs = list(sched.run_until_idle())
    assert sorted(o.index for o in outs if o.finished) == [0, 1, 2]
    assert {o.finish_reason.type for o in outs if o.finish_reason} == {"abort"}
    assert_all_free(eng)


def test_queue_counts_samples_and_tokens(tiny_model_dir: Path) -> None:
    """The waiting queue holds at most 3 samples and 100 prompt tokens: a family of n counts
    n samples; what can never queue is a ValueError (400), what cannot queue now a
    QueueFullError (503)."""
    from radixserve.core.params import SamplingParams
    from radixserve.core.request import TokenizedRequest
    from radixserve.scheduler.scheduler import QueueFullError

    eng = make_engine(tiny_model_dir, max_queued_requests=3, max_queued_tokens=100)
    sched = eng.scheduler

    def add(rid: str, length: int, n: int) -> None:
        sched.add_request(
            TokenizedRequest(rid, [7] * length, SamplingParams(max_new_tokens=2, n=n))
        )

    add("a", 40, 2)
    with pytest.raises(QueueFullError, match="4 samples"):
        add("b", 10, 2)
    with pytest.raises(QueueFullError, match="110 tokens"):
        add("c", 70, 1)
    add("d", 60, 1)  # 3 samples, 100 tokens: full on both counts
    with pytest.raises(ValueError, match="n: 4 samples can never queue"):
        add("e", 10, 4)
    with pytest.raises(ValueError, match="can never queue"):
        add("f", 101, 1)
    assert len(list(sched.run_until_idle())) > 0
    add("g", 40, 3)  # drained: room again
    sched.abort_request("g")
    list(sched.run_until_idle())
    assert_all_free(eng)


def test_offline_batch_larger_than_the_queue(
    tiny_model_dir: Path, reference: list[list[int]]
) -> None:
    eng = make_engine(tiny_model_dir, max_queued_requests=2, max_queued_tokens=50)
    outs = eng.generate(input_ids=prompts(5), sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference[:5]
    assert_all_free(eng)
