"""benchmarks/replay_drafts.py's lock-step replay on hand-made samples."""

from __future__ import annotations

import pytest
from replay_drafts import replay, sibling_draft

RUNS = [{"prompt": [1, 2, 3], "outputs": [[5, 6, 7, 5, 6, 7, 5, 6, 7], [9, 8, 7, 5, 6]]}]


def test_replay_counts_steps_and_kept_tokens() -> None:
    # a step costs 1 s whatever its rows: 14 tokens, the first of each sample from the prefill
    plain = replay(RUNS, "own", cap=0, k=0, a=1.0, b=0.0)
    assert plain == {"tokens_per_s": pytest.approx(14 / 8), "proposed": 0, "kept": 0}
    # always right: one step, in which sample 0 drafts 7 of its 8 tokens to come and sample 1
    # 3 of its 4 (the last token of each is the one its last row computes)
    oracle = replay(RUNS, "oracle", cap=16, k=8, a=1.0, b=0.0)
    assert oracle == {"tokens_per_s": pytest.approx(14.0), "proposed": 10, "kept": 10}
    # within 6 rows: sample 0 drafts 4 and sample 1 nothing, then they draft 2 each
    capped = replay(RUNS, "oracle", cap=6, k=8, a=1.0, b=0.0)
    assert capped == {"tokens_per_s": pytest.approx(14 / 2), "proposed": 8, "kept": 8}
    # a row costs a second and the step nothing: the 12 rows of the one step
    costly = replay(RUNS, "oracle", cap=16, k=8, a=0.0, b=1.0)
    assert costly["tokens_per_s"] == pytest.approx(14 / 12)


def test_sibling_drafts_are_the_longest_matches_latest_first() -> None:
    others = [[4, 7, 5, 1, 1], [0, 6, 7, 5, 2, 2, 6, 7, 5, 3]]
    assert sibling_draft([9, 6, 7, 5], others, 2) == (3, [[3], [2, 2]])  # two 3-matches
    assert sibling_draft([9, 4, 7, 5], others, 2) == (3, [[1, 1]])
    assert sibling_draft([9, 9, 9, 5], others, 2) == (0, [])  # one token is no match


def test_a_tree_of_agreeing_matches_replays_as_their_chain() -> None:
    """Every match here continues alike, so the trees are the chains; a tree's kept tokens
    are those down the branch the sample's own next tokens take."""
    for cap, k in ((16, 4), (6, 8)):
        chain = replay(RUNS, "own+siblings", cap=cap, k=k, a=1.0, b=0.0)
        assert replay(RUNS, "own+siblings tree", cap=cap, k=k, a=1.0, b=0.0) == chain
