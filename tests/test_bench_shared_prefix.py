"""bench_shared_prefix's decode timing: only full-batch decode steps are timed (radixserve's
scheduler steps, HF generate's steps), the backends of a round run side by side one step at a
time, and the printed ratios are medians of per-round ones."""

from __future__ import annotations

import threading
from pathlib import Path

import bench_shared_prefix as bsp
import pytest
import torch

from radixserve import Engine

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
        # one new token: prefill steps only, nothing timed
        assert bsp.side_by_side({"e": run}, 1)["e"] == []
        n = 8
        steps = bsp.side_by_side({"e": run}, n)["e"]
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
    steps = bsp.side_by_side({"hf": bsp.hf_runner(hf, prefix, prompts)}, 6)["hf"]
    assert len(steps) == 5 and all(s > 0 for s in steps)


def _stepper(name: str, steps: int, step_s: float, log: list[str]) -> bsp.StepsRun:
    """A runner of `steps` steps of step_s seconds each, logging each step it runs."""

    def run(n: int, turn: bsp.Turn) -> list[float]:
        assert turn.name == name
        for _ in range(steps):
            turn.baton.take(name)
            assert turn.main.call(threading.current_thread) is threading.main_thread()
            assert threading.current_thread() is not threading.main_thread()
            log.append(name)
            turn.baton.give(name)
        return [step_s] * steps

    return run


def test_side_by_side_runs_one_step_each_in_turn_until_each_is_done() -> None:
    log: list[str] = []
    runs = {"a": _stepper("a", 3, 0.1, log), "b": _stepper("b", 1, 0.1, log)}
    runs["c"] = _stepper("c", 2, 0.1, log)
    out = bsp.side_by_side(runs, 4)
    assert log == ["a", "b", "c", "a", "c", "a"]  # b leaves after its step, the rest go on
    assert out == {"a": [0.1] * 3, "b": [0.1], "c": [0.1] * 2}


def test_side_by_side_raises_a_runner_error_without_blocking_the_others() -> None:
    log: list[str] = []

    def broken(n: int, turn: bsp.Turn) -> list[float]:
        turn.baton.take(turn.name)
        turn.main.call(lambda: 1 / 0)  # a step that fails: its error reaches its runner
        raise AssertionError("unreachable")

    runs = {"bad": broken, "ok": _stepper("ok", 3, 0.1, log)}
    with pytest.raises(ZeroDivisionError):
        bsp.side_by_side(runs, 4)
    assert log == ["ok"] * 3


def test_decode_times_keeps_every_round() -> None:
    log: list[str] = []
    runs = {"tree": _stepper("tree", 3, 0.2, log), "none": _stepper("none", 3, 0.1, log)}
    rows = bsp.decode_times(runs, 4, 2)
    assert log == ["tree", "none"] * 6
    by = {r["backend"]: r for r in rows}
    assert by["tree"]["round_steps_s"] == [0.2] * 2 and by["tree"]["step_s"] == 0.2
    assert bsp.round_ratio(rows, "tree", "none") == pytest.approx(0.5)
