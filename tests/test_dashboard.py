"""docs/grafana-dashboard.json: valid Grafana JSON whose every query names a series that the
server's metrics exporter (radixserve/server/metrics.py) really renders."""

from __future__ import annotations

import json
import re
from pathlib import Path

from radixserve.core.info import SchedulerStats
from radixserve.server.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-dashboard.json"


def exported_series() -> set[str]:
    metrics = Metrics()
    metrics.ttft.observe(0.2)
    metrics.e2e.observe(1.5)
    stats = SchedulerStats(
        num_running=1, num_queued=2, kv_used_tokens=10, kv_capacity_tokens=100,
        kv_held_tokens=5, prompt_tokens_total=40, cached_tokens_total=30,
        generation_tokens_total=7, computed_tokens_total=17,
    )  # fmt: skip
    text = metrics.render(stats).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1].isalpha()}


def test_every_dashboard_query_uses_an_exported_series() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"radixserve_\w+", e)}
    exported = exported_series()
    assert used - exported == set(), f"queried but not exported: {sorted(used - exported)}"
    # Every exported family has a panel (histograms through their _bucket / _count series).
    families = {re.sub(r"_(bucket|sum|count|created)$", "", m) for m in exported}
    shown = {re.sub(r"_(bucket|sum|count)$", "", m) for m in used}
    assert families - shown == set(), f"exported but on no panel: {sorted(families - shown)}"
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
