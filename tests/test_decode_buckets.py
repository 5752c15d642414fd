"""Decode steps run from fixed buffers padded to a bucket of batch sizes (worker/buckets.py):
the same tokens and logprobs as unpadded steps, and every tensor the padded steps read at the
same address from step to step, as a captured graph needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from radixserve.attention.slots import SlotPlan
from radixserve.attention.tree_plan import TreePlan
from radixserve.core.batch import ForwardBatch
from radixserve.worker.buckets import DecodeBuckets


def test_bucket_sizes() -> None:
    buckets = DecodeBuckets(256, torch.device("cpu"), copy_table=False)
    got = [buckets.bucket(b) for b in (1, 2, 3, 5, 16, 17, 100, 200, 256, 257)]
    assert got == [1, 2, 4, 8, 16, 24, 128, 256, 256, None]
    assert DecodeBuckets(40, torch.device("cpu"), copy_table=False).sizes[-3:] == [24, 32, 40]


def _generate(engine: Engine) -> list[dict[str, Any]]:
    system = list(range(300, 340))
    prompts = [system + [1000 + i, 2000 + i] for i in range(7)]
    params = [{"temperature": 0, "max_new_tokens": 4 + 3 * i, "ignore_eos": True} for i in range(7)]
    outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    assert isinstance(outs, list)
    assert engine.flush_cache()
    return outs


def _tokens_and_logprobs(outs: list[dict[str, Any]]) -> tuple[list[list[int]], list[float]]:
    tokens = [o["output_ids"] for o in outs]
    logprobs = [lp[0] for o in outs for lp in o["meta_info"]["output_token_logprobs"]]
    return tokens, logprobs


def _addresses(batch: ForwardBatch) -> tuple[int, ...]:
    plan = batch.attn_plan
    private = plan.private if isinstance(plan, TreePlan) else plan
    assert isinstance(private, SlotPlan)
    fixed = [batch.input_ids, batch.positions, batch.out_cache_loc, private.slots]
    fixed += [private.q_offsets, private.kv_starts, private.kv_lens]
    return tuple(t.data_ptr() for t in fixed)


@pytest.mark.parametrize("copy_table", [False, True], ids=["table", "copied"])
@pytest.mark.parametrize("backend", ["tree", "flat"])
def test_padded_steps_equal_unpadded(tiny_model_dir: Path, backend: str, copy_table: bool) -> None:
    """Seven samples finish one by one, so the steps pad 7 -> 8, 5 -> 8, 3 -> 4 and run 4, 2
    and 1 as they are. `copied`: the bucket reads its own copy of the table's rows, as on a
    GPU with the table on the host."""
    engine = Engine(
        str(tiny_model_dir), dtype="float32", max_total_tokens=4096, attention_backend=backend,
        speculative_algorithm="none",
    )  # fmt: skip
    worker = engine.scheduler.worker
    assert worker.buckets is None  # off by default
    want = _tokens_and_logprobs(_generate(engine))

    buckets = DecodeBuckets(engine.config.max_running_requests, worker.device, copy_table)
    worker.buckets = buckets
    steps: list[tuple[int, int, tuple[int, ...]]] = []  # (rows, bucket rows, addresses)
    pad = buckets.pad

    def recorded(batch: ForwardBatch) -> ForwardBatch:
        out = pad(batch)
        steps.append((batch.num_requests, out.num_requests, _addresses(out)))
        return out

    buckets.pad = recorded  # type: ignore[method-assign]
    got = _tokens_and_logprobs(_generate(engine))
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-4)
    sizes = {(b, n) for b, n, _ in steps}
    assert {(7, 8), (5, 8), (3, 4), (4, 4), (1, 1)} <= sizes, sizes
    assert len({a for _, _, a in steps}) == 1, "a buffer moved between steps"
    engine.shutdown()


def test_steps_with_a_shared_segment_run_unpadded(tiny_model_dir: Path) -> None:
    """A tree step that keeps a shared segment reads it outside the buffers: it runs as it
    is, and the tokens are those of the engine without buckets."""
    engine = Engine(
        str(tiny_model_dir), dtype="float32", max_total_tokens=4096, decode_buckets=True,
        speculative_algorithm="none",
    )  # fmt: skip
    worker = engine.scheduler.worker
    backend = worker.backend
    backend.min_tokens = backend.min_reads = 1  # keep every shared segment at decode
    buckets = worker.buckets
    assert buckets is not None
    padded = []
    pad = buckets.pad

    def recorded(batch: ForwardBatch) -> ForwardBatch:
        padded.append(batch.num_requests)
        return pad(batch)

    buckets.pad = recorded  # type: ignore[method-assign]
    got = _tokens_and_logprobs(_generate(engine))[0]
    assert padded and set(padded) == {1}, padded  # only the last sample decodes alone
    worker.buckets = None
    assert _tokens_and_logprobs(_generate(engine))[0] == got
    engine.shutdown()


def test_buckets_refused_with_tensor_parallelism() -> None:
    from radixserve.config import EngineConfig

    with pytest.raises(ValueError, match="decode_buckets runs at tp_size 1"):
        EngineConfig(model="m", decode_buckets=True, tp_size=2)
