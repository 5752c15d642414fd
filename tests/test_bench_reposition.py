"""benchmarks/bench_reposition.py on the tiny model and 4 real ShareGPT conversations
(tests/data/sharegpt_multiturn.json): truncated histories, and with --hicache-reposition
the kept turns are moved instead of prefilled again."""

from __future__ import annotations

import json
from pathlib import Path

import bench_reposition as br
import pytest

ROOT = Path(__file__).resolve().parents[1]

FIXTURE = ROOT / "tests" / "data" / "sharegpt_multiturn.json"


@pytest.mark.slow  # the reposition benchmark end to end
def test_reposition_prefills_less_after_truncation(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "reposition.json"
    args = ["--model", str(tiny_model_dir), "--dataset-path", str(FIXTURE), "--conversations", "4"]
    args += ["--max-turns", "4", "--max-user-tokens", "48", "--max-new-tokens", "8"]
    args += ["--context-budget", "160", "--pool-tokens", "512", "--host-gb", "0.05"]
    report = br.main([*args, "--out", str(out)])
    assert json.loads(out.read_text()) == report
    off, on = report["rows"]
    assert (off["config"], on["config"]) == ("recompute", "reposition")
    assert off["turns"] == on["turns"] == 16 and off["prompt_tokens"] == on["prompt_tokens"]
    assert off["truncated_turns"] == on["truncated_turns"] > 0, report
    assert off["moved_tokens"] == 0 < on["moved_tokens"], report
    assert on["prefilled_tokens"] <= off["prefilled_tokens"] - on["moved_tokens"] // 2, report
    assert off["skipped_scores"] == on["skipped_scores"] == 0, report
    agree = report["agreement"]
    assert agree["untruncated_identical"] == 1.0, agree  # before any cut: the same prompts and K/V
    assert agree["truncated_turns"] == off["truncated_turns"]
