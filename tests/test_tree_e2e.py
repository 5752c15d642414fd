"""End-to-end exactness of tree attention on the embedded SmolLM2 in float32: greedy outputs
are identical under `tree` and `flat` for a fork of 16 samples and for a two-level tree
(shared few-shot prefix, 4 problems, 8 samples each), and the tree runs really attended
shared segments (one and two levels deep)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from radixserve import Engine

pytestmark = pytest.mark.slow

GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


class PlanStats:
    """Counts, per step, the shared segments the tree backend kept (observation only)."""

    def __init__(self, engine: Engine) -> None:
        self.steps_with_segments = 0
        self.max_levels = 0
        backend = engine.scheduler.worker.backend
        inner = backend.plan

        def plan(batch: Any) -> None:
            inner(batch)
            if batch.attn_plan.segments:
                self.steps_with_segments += 1
                self.max_levels = max(self.max_levels, batch.attn_plan.num_levels)

        backend.plan = plan  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def engines() -> dict[str, Engine]:
    return {
        b: Engine(dtype="float32", attention_backend=b, max_total_tokens=16384)
        for b in ("tree", "flat")
    }


def few_shot_prefix(engine: Engine) -> str:
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[:3]]
    return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows)


def run(engine: Engine, prompts: list[str], params: dict[str, Any]) -> list[list[int]]:
    engine.flush_cache()
    out = engine.generate(prompts, params)
    assert isinstance(out, list)
    engine.check_integrity()
    return [o["output_ids"] for o in out]


def test_fork_of_16_identical(engines: dict[str, Engine]) -> None:
    prompt = few_shot_prefix(engines["tree"]) + "Question: What is 12 times 7?\nAnswer:"
    stats = PlanStats(engines["tree"])
    params = {**GREEDY, "n": 16}
    tree = run(engines["tree"], [prompt], params)
    flat = run(engines["flat"], [prompt], params)
    assert len(tree) == 16 and tree == flat
    assert stats.steps_with_segments >= GREEDY["max_new_tokens"] - 2  # every decode step


@pytest.mark.parametrize("thresholds", ["default", "off"])
def test_two_level_tree_identical(engines: dict[str, Engine], thresholds: str) -> None:
    tree_engine = engines["tree"]
    backend = tree_engine.scheduler.worker.backend
    saved = (backend.min_tokens, backend.min_reads, backend.min_tokens_extend)
    if thresholds == "off":  # keep every shared segment: both tree levels are attended
        backend.min_tokens = backend.min_reads = backend.min_tokens_extend = 1
    try:
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
    finally:
        backend.min_tokens, backend.min_reads, backend.min_tokens_extend = saved
    assert len(tree) == 32 and tree == flat
    assert stats.steps_with_segments > 0
    if thresholds == "off":
        assert stats.max_levels >= 2  # prefix segment + per-problem segment
