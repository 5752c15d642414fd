"""benchmarks/bench_scheduler.py on the tiny model: its decode steps are timed part by part,
evict from the filler tree, and draw the same tokens run after run; samples can leave
between the timed steps."""

from __future__ import annotations

import bench_scheduler as bs
import pytest


@pytest.mark.slow  # two whole scheduler runs with model loads
def test_decode_steps_split_into_parts_and_repeat_their_outputs() -> None:
    first = bs.bench("tiny", batch=4, steps=3, tree=200, leaving=0)
    again = bs.bench("tiny", batch=4, steps=3, tree=200, leaving=0)
    assert first["timed_steps"] == 3 and first["batch"] == 4
    parts = [first[f"{part}_ms_median"] for part in (*bs.PARTS, "bookkeeping", "host")]
    assert all(ms > 0 for ms in parts), first
    nodes_before, nodes_after = first["tree_nodes_first_last"]
    assert nodes_after < nodes_before, first  # the steps evicted filler leaves
    assert first["outputs_sha256"] == again["outputs_sha256"]


@pytest.mark.slow  # a whole scheduler run with a model load
def test_samples_leave_between_timed_steps() -> None:
    """--leaving 2: two samples are aborted before each timed step after the first, so the
    steps decode 8, 6 and 4 samples, every one of them timed."""
    r = bs.bench("tiny", batch=8, steps=3, tree=200, leaving=2)
    assert r["leaving_per_step"] == 2 and r["timed_steps"] == 3, r
    assert all(r[f"{part}_ms_median"] > 0 for part in (*bs.PARTS, "bookkeeping", "host")), r
