"""What the Ray request router knows of a replica's cache (radixserve/ray/replica_tree.py):
the whole blocks its reports named (full, or the changes since the last), the prompts routed
to it that no report named yet, within the horizon, and a newer report after an eviction
lowering the match; router/'s cache_aware policy over those trees. Plain Python on a manual
clock: no Ray, no server."""

from __future__ import annotations

import random

from radixserve.core.digest import HASH_BYTES, block_hashes, join, split
from radixserve.ray.replica_tree import DigestReports, ReplicaTree, ReportedCacheAware
from radixserve.router.backend import Backend
from radixserve.router.config import RouterConfig
from radixserve.router.tree import ids_key

B = 16


class ManualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


def stats(version: int, *cached: list[int]) -> dict[str, object]:
    """Routing stats as `EngineReplica.record_routing_stats` makes them."""
    hashes = {h: None for seq in cached for h in block_hashes(seq, B)}  # ordered, no repeats
    return {"version": version, "block": B, "hashes": join(list(hashes))}


def test_reported_blocks_match_whole_blocks_from_the_start() -> None:
    cached = ids(50, 0)  # blocks 0, 1, 2 (ids 48, 49 make no block)
    tree = ReplicaTree(clock=ManualClock())
    assert tree.match(ids_key(cached)) == 0  # no report yet
    tree.report(stats(1, cached))
    assert tree.match(ids_key(cached)) == 48
    assert tree.match(ids_key(cached + ids(30, 1))) == 48
    assert tree.match(ids_key(cached[:40] + ids(30, 2))) == 32  # leaves block 2 at id 40
    assert tree.match(ids_key(cached[:15])) == 0  # no whole block
    assert tree.match(ids_key([cached[0] + 1, *cached[1:]])) == 0  # block 0 differs
    assert tree.match(ids_key(cached[B:])) == 0  # block 1's ids alone are not block 1


def test_prompts_sent_count_until_named_or_past_the_horizon() -> None:
    clock = ManualClock()
    tree = ReplicaTree(horizon_s=5.0, clock=clock)
    sent = ids(40, 3)
    tree.insert(ids_key(sent))
    assert tree.match(ids_key(sent + [7])) == 40  # no report yet: the prompt itself
    clock.t = 4.0
    tree.report(stats(1))  # a report that does not name it yet
    assert tree.match(ids_key(sent)) == 40
    clock.t = 6.0
    tree.report(stats(2))  # past the horizon, and still not named: not cached
    assert tree.match(ids_key(sent)) == 0
    tree.insert(ids_key(sent))
    clock.t = 7.0
    tree.report(stats(3, sent[:B]))  # block 0 named, block 1 not yet: the prompt counts
    assert tree.match(ids_key(sent)) == 40
    tree.report(stats(4, sent))  # every whole block named: the report alone answers
    assert tree.match(ids_key(sent)) == 32


def test_a_newer_report_after_eviction_lowers_the_match() -> None:
    clock = ManualClock()
    tree = ReplicaTree(clock=clock)
    cached = ids(64, 4)
    tree.report(stats(1, cached))
    assert tree.match(ids_key(cached)) == 64
    tree.report(stats(2, cached[:B]))  # the replica evicted blocks 1..3
    assert tree.match(ids_key(cached)) == 16
    tree.report({"version": 2, "block": B, "hashes": join(block_hashes(cached, B))})
    assert tree.match(ids_key(cached)) == 16  # the same version again: already taken
    tree.report({"version": 3, "block": B})  # no hashes: nothing to take
    assert tree.match(ids_key(cached)) == 16
    tree.report(stats(4))
    assert tree.match(ids_key(cached)) == 0


def digest(*cached: list[int]) -> bytes:
    """A `/cache_digest` body naming the whole blocks of `cached`."""
    return join(list({h: None for seq in cached for h in block_hashes(seq, B)}))


def test_reports_name_the_changes_and_every_tenth_names_all() -> None:
    system, a, b = ids(256, 10), ids(64, 11), ids(64, 12)
    reports = DigestReports(B, full_every=10)
    first = reports.next(digest(system), 256)
    assert first["hashes"] == digest(system) and first["cached_tokens"] == 256
    grown = reports.next(digest(system, system + a), 320)  # 4 blocks added, none removed
    assert "hashes" not in grown and len(grown["removed"]) == 0
    assert split(grown["added"]) == split(digest(system + a)) - split(digest(system))
    moved = reports.next(digest(system, system + b), 320)  # a's 4 evicted, b's 4 added
    assert len(moved["added"]) == len(moved["removed"]) == 4 * HASH_BYTES
    assert len(moved["added"]) + len(moved["removed"]) < len(digest(system, system + b)) // 2
    assert "hashes" in reports.next(digest(a), 64)  # more changed than it names: all of it
    kinds = ["hashes" in reports.next(digest(a), 64) for _ in range(7)]
    assert kinds == [False] * 6 + [True]  # versions 4..9, then 10


def test_trees_follow_changes_and_one_that_missed_a_report_recovers_at_a_full_one() -> None:
    system, a, b = ids(256, 13), ids(64, 14), ids(64, 15)
    cached = [(system,), (system, system + a), (system, system + a, system + b),
              (system + b,), (system + b,), (system, system + a)]  # fmt: skip
    reports = DigestReports(B, full_every=4)
    every, missed = ReplicaTree(clock=ManualClock()), ReplicaTree(clock=ManualClock())
    a_blocks = split(digest(system + a)) - split(digest(system))
    for version, seqs in enumerate(cached):
        stats = reports.next(digest(*seqs), 0)
        every.report(stats)
        if version != 1:
            missed.report(stats)
        assert every.reported == split(digest(*seqs))
        if version in (1, 2, 3):  # version 1's four blocks of `a` are not known
            assert missed.reported == split(digest(*seqs)) - a_blocks
    assert missed.reported == split(digest(system, system + a))  # version 4 named all
    assert every.match(ids_key(system + a)) == 320 and every.match(ids_key(system + b)) == 256


def test_reports_of_the_wrong_shape_change_nothing() -> None:
    tree = ReplicaTree(clock=ManualClock())
    system = ids(64, 16)
    added = {"version": 1, "block": B, "added": digest(system), "removed": b""}
    tree.report(added)  # changes before any full report: nothing to add them to
    assert tree.match(ids_key(system)) == 0
    tree.report({"version": 2, "block": B, "hashes": digest(system)})
    for bad in ({"version": 3, "block": "16", "hashes": b""}, {"version": 3, "block": 0},
                {"version": 3, "block": B, "hashes": "not bytes"},
                {"version": 3, "block": 32, "added": b"", "removed": digest(system)},
                {"version": 3, "block": B, "added": [1], "removed": b""}):  # fmt: skip
        tree.report(bad)
        assert tree.match(ids_key(system)) == 64, bad


def test_policy_sends_a_prompt_where_its_blocks_are_reported() -> None:
    clock = ManualClock()
    policy = ReportedCacheAware(RouterConfig(), clock=clock)
    workers = [Backend("a", healthy=True), Backend("b", healthy=True)]
    system = ids(64, 5)
    policy.report("b", stats(1, system))
    decision = policy.choose(workers, ids_key(system + ids(8, 6)))
    assert (decision.worker.url, decision.reason, decision.matched) == ("b", "cache", 64)
    assert policy.trees["b"].held() == 72  # the 64 reported ids and the prompt's 8 more
    other = ids(100, 7)  # cached nowhere: the smaller cache
    decision = policy.choose(workers, ids_key(other))
    assert (decision.worker.url, decision.reason) == ("a", "room")
    assert policy.trees["a"].held() == 100
    third = ids(40, 9)  # "a" now holds more: "b"
    assert policy.choose(workers, ids_key(third)).worker.url == "b"
    decision = policy.choose(workers, ids_key(other[:70]))  # just sent to "a"
    assert (decision.worker.url, decision.reason, decision.matched) == ("a", "cache", 70)
    policy.forget("b")
    decision = policy.choose(workers, ids_key(system + ids(8, 8)))
    assert (decision.worker.url, decision.reason) == ("b", "room")


def test_policy_balances_when_loads_are_far_apart() -> None:
    policy = ReportedCacheAware(RouterConfig(), clock=ManualClock())
    system = ids(64, 9)
    policy.report("b", stats(1, system))
    busy_b = [Backend("a", healthy=True), Backend("b", healthy=True, reported_load=40)]
    assert policy.choose(busy_b, ids_key(system)).worker.url == "a"
