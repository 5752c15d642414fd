"""bench_shared_prefix's decode timing: only full-batch decode steps are timed (radixserve's
scheduler steps, HF generate's steps), and the printed ratios are medians of per-round ones."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import bench_shared_prefix as bsp  # noqa: E402
from radixserve import Engine  # noqa: E402

B = 3


def _prompts() -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(100, 20000, (48,), generator=g).tolist()
    tails = torch.randint(100, 20000, (B, 5), generator=g).tolist()
    return prefix, [prefix + t for t in tails]


def test_round_ratio_is_the_median_of_per_round_ratios() -> None:
    rows = [
        {"backend": "tree", "round_steps_s": [1.0, 2.0, 4.0]},
        {"backend": "none", "round_steps_s": [0.5, 1.5, 1.0]},
    ]
    # per round, tree's rate / none's = none's step / tree's: 0.5, 0.75, 0.25
    assert bsp.round_ratio(rows, "tree", "none") == pytest.approx(0.5)
    assert bsp.round_ratio(rows, "none", "tree") == pytest.approx(2.0)


def test_engine_runner_times_only_full_batch_decode_steps(tiny_model_dir: Path) -> None:
    with Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=2048) as engine:
        _, prompts = _prompts()
        run = bsp.engine_runner(engine, prompts)
        assert run(1) == []  # one new token: prefill steps only, nothing timed
        n = 8
        steps = run(n)
        # the B requests prefill over at most a few steps, then decode together to the end;
        # at most n - 1 steps are pure decode steps of all B
        assert 1 <= len(steps) <= n - 1
        assert all(0 < s < 60 for s in steps)
        engine.check_integrity()
        assert engine.flush_cache()


def test_hf_runner_times_the_n_minus_1_decode_steps(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prefix, prompts = _prompts()
    steps = bsp.hf_runner(hf, prefix, prompts)(6)
    assert len(steps) == 5 and all(s > 0 for s in steps)


def test_decode_times_alternates_backends_and_keeps_every_round() -> None:
    calls: list[str] = []

    def fake(name: str, step: float) -> bsp.StepsRun:
        def run(n: int) -> list[float]:
            calls.append(name)
            return [step] * (n - 1)

        return run

    rows = bsp.decode_times({"tree": fake("tree", 0.2), "none": fake("none", 0.1)}, 4, 3)
    assert calls == ["tree", "none"] * 3
    by = {r["backend"]: r for r in rows}
    assert by["tree"]["round_steps_s"] == [0.2] * 3 and by["tree"]["step_s"] == 0.2
    assert bsp.round_ratio(rows, "tree", "none") == pytest.approx(0.5)
