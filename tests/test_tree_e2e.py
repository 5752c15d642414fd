"""End-to-end exactness of tree attention on the embedded SmolLM2 in float32: a sampled fork of
16 distinct samples (seeded) gives the same tokens and logprobs under `tree` and `flat`, and
greedy outputs are identical for a two-level tree (shared few-shot prefix, 4 problems, 8
samples each); the tree runs really attended shared segments (one and two levels deep)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from helpers import keep_every_segment

from radixserve import Engine

pytestmark = pytest.mark.slow

GSM8K = Path(__file__).with_name("data") / "gsm8k" / "train.jsonl"  # GSM8K's first 3 rows
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "max_new_tokens": 24, "ignore_eos": True, "seed": 1234}


class PlanStats:
    """Counts, per step, the shared segments the tree backend kept (observation only)."""

    def __init__(self, engine: Engine) -> None:
        self.steps = 0
        self.steps_with_segments = 0
        self.max_levels = 0
        backend = engine.worker.backend
        inner = backend.plan

        def plan(batch: Any) -> None:
            inner(batch)
            self.steps += 1
            if batch.attn_plan.segments:
                self.steps_with_segments += 1
                self.max_levels = max(self.max_levels, batch.attn_plan.num_levels)

        backend.plan = plan  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    return {
        # Float32 weights and KV (quantization "none"): the only difference between the two
        # is tree attention's summation order. (The default decode linears round their
        # activations to int16, which turns 1e-7 differences into ~1e-3 logprob ones.)
        b: Engine(dtype="float32", quantization="none", attention_backend=b, max_total_tokens=16384)
        for b in ("tree", "flat")
    }


def few_shot_prefix(engine: Engine) -> str:
    """The fixture's 3 GSM8K rows three times over: 1143 tokens, a shared prefix long enough
    for the default TreeBackend.keeps (L >= 1024) under the tests' 16 and 32 samples."""
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:3]]
    return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows) * 3


def run(engine: Engine, prompts: list[str], params: dict[str, Any]) -> list[list[int]]:
    engine.flush_cache()
    out = engine.generate(prompts, params)
    assert isinstance(out, list)
    engine.check_integrity()
    return [o["output_ids"] for o in out]


def test_fork_of_16_samples_identical(engines: dict[str, Engine]) -> None:
    """Seeded sampling draws token i of sample j from a fixed u(seed, j, i), so tree and flat
    give the same 16 distinct samples unless a u lands within the float32 summation-order
    difference of a CDF boundary: allowed for at most 2 samples, and only after the two
    runs agree on every earlier token's logprob to 1e-4."""
    prompt = few_shot_prefix(engines["tree"]) + "Question: What is 12 times 7?\nAnswer:"
    stats = PlanStats(engines["tree"])
    params = {**SAMPLED, "n": 16}
    tree, flat = (sampled(engines[b], prompt, params) for b in ("tree", "flat"))
    assert len(tree) == len(flat) == 16
    assert len({tuple(ids) for ids, _ in tree}) == 16, "the 16 samples must differ"
    same = 0
    for (ids_t, lp_t), (ids_f, lp_f) in zip(tree, flat, strict=True):
        common = next((i for i, (a, b) in enumerate(zip(ids_t, ids_f)) if a != b), len(ids_t))
        same += ids_t == ids_f
        for a, b in zip(lp_t[:common], lp_f[:common]):
            assert abs(a - b) <= 1e-4, (a, b)
    assert same >= 14, f"only {same} of 16 samples identical under tree and flat"
    # every decode step (the prefill is one step; drafts may make the steps fewer than tokens)
    assert stats.steps_with_segments >= stats.steps - 2


def sampled(engine: Engine, prompt: str, params: dict[str, Any]) -> list[tuple[list[int], list]]:
    engine.flush_cache()
    out = engine.generate([prompt], params, return_logprob=True)
    assert isinstance(out, list)
    engine.check_integrity()
    return [(o["output_ids"], [e[0] for e in o["meta_info"]["output_token_logprobs"]]) for o in out]


@pytest.mark.parametrize("thresholds", ["default", "off"])
def test_two_level_tree_identical(engines: dict[str, Engine], thresholds: str) -> None:
    tree_engine = engines["tree"]
    backend = tree_engine.worker.backend
    # "off": keep every shared segment, so that both tree levels are attended
    with keep_every_segment(backend) if thresholds == "off" else nullcontext():
        prefix = few_shot_prefix(tree_engine)
        problems = [
            f"Question: Tom has {i + 3} apples and eats {i}. How many are left?\nAnswer:"
            for i in range(4)
        ]
        prompts = [prefix + p for p in problems]
        params = {**GREEDY, "n": 8}
        stats = PlanStats(tree_engine)
        tree = run(tree_engine, prompts, params)
        flat = run(engines["flat"], prompts, params)
    assert len(tree) == 32 and tree == flat
    assert stats.steps_with_segments > 0
    if thresholds == "off":
        assert stats.max_levels >= 2  # prefix segment + per-problem segment
