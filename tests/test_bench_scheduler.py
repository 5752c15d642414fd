"""benchmarks/bench_scheduler.py on the tiny model: its decode steps are timed part by part,
evict from the filler tree, and draw the same tokens run after run."""

from __future__ import annotations

import bench_scheduler as bs
import pytest


@pytest.mark.slow  # two whole scheduler runs with model loads
def test_decode_steps_split_into_parts_and_repeat_their_outputs() -> None:
    first = bs.bench("tiny", batch=4, steps=3, tree=200)
    again = bs.bench("tiny", batch=4, steps=3, tree=200)
    assert first["timed_steps"] == 3 and first["batch"] == 4
    parts = [first[f"{part}_ms_median"] for part in (*bs.PARTS, "bookkeeping", "host")]
    assert all(ms > 0 for ms in parts), first
    nodes_before, nodes_after = first["tree_nodes_first_last"]
    assert nodes_after < nodes_before, first  # the steps evicted filler leaves
    assert first["outputs_sha256"] == again["outputs_sha256"]
