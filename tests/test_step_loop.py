"""The one step loop (`scheduler/loop.py`) over a fake scheduler: admission, backlog order,
refusals, abort and the active count, as every driver relies on them."""

from __future__ import annotations

from typing import Any

from radixserve.core.params import SamplingParams
from radixserve.core.request import FinishReason, TokenDelta, TokenizedRequest
from radixserve.scheduler.loop import StepLoop
from radixserve.scheduler.scheduler import QueueFullError


class FakeScheduler:
    """Room for `room` queued requests; each step finishes every queued sample."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.queued: list[TokenizedRequest] = []
        self.aborted: list[str] = []

    def add_request(self, r: TokenizedRequest) -> None:
        if r.input_ids == [666]:
            raise ValueError("input_ids: never runs")
        if len(self.queued) >= self.room:
            raise QueueFullError("queue full")
        self.queued.append(r)

    def abort_request(self, rid: str) -> None:
        self.aborted.append(rid)

    def has_work(self) -> bool:
        return bool(self.queued)

    def step(self) -> list[TokenDelta]:
        done, self.queued = self.queued, []
        return [
            TokenDelta(r.rid, i, [1], FinishReason("length"))
            for r in done
            for i in range(r.sampling.n)
        ]


def _req(rid: str, n: int = 1, ids: list[int] | None = None) -> TokenizedRequest:
    return TokenizedRequest(rid, ids or [1, 2], SamplingParams(n=n))


def _loop(room: int, backlog: bool) -> tuple[StepLoop, list[Any], list[Any]]:
    sunk: list[Any] = []
    refused: list[Any] = []
    loop = StepLoop(
        FakeScheduler(room),  # type: ignore[arg-type]
        lambda outs: sunk.append([(o.rid, o.index) for o in outs]),
        lambda rid, status, msg: refused.append((rid, status, msg)),
        backlog=backlog,
    )
    return loop, sunk, refused


def test_backlog_keeps_arrival_order() -> None:
    loop, sunk, refused = _loop(room=1, backlog=True)
    for rid in "abc":
        loop.add(_req(rid, n=2 if rid == "a" else 1))
    assert [r.rid for r in loop.backlog] == ["b", "c"] and loop.active == {"a": 2}
    assert loop.step() and loop.step() and loop.step() and not loop.step()
    assert sunk == [[("a", 0), ("a", 1)], [("b", 0)], [("c", 0)]]
    assert refused == [] and loop.active == {} and not loop.has_work()


def test_without_backlog_a_full_queue_refuses_with_503() -> None:
    loop, _, refused = _loop(room=1, backlog=False)
    loop.add(_req("a"))
    loop.add(_req("b"))
    loop.add(_req("bad", ids=[666]))
    assert refused == [("b", 503, "queue full"), ("bad", 400, "input_ids: never runs")]
    assert loop.active == {"a": 1} and loop.backlog == []


def test_abort_only_accepted_and_abort_all_drops_the_backlog() -> None:
    loop, _, _ = _loop(room=1, backlog=True)
    loop.add(_req("a"))
    loop.add(_req("b"))
    loop.abort("b")  # backlogged: ignored
    loop.abort("zzz")  # unknown: ignored
    loop.abort_all()
    assert loop.sched.aborted == ["a"] and loop.backlog == []  # type: ignore[attr-defined]
