"""The scheduler's tables of samples: which wait, which run, and every sample of a request.

    waiting    samples queued for admission (new, forked later, or retracted), in the order
               they joined; admission orders them itself (policy.order_waiting)
    running    samples with a table row and K/V, in the order they started: a step's batch
    by_rid     request id -> its samples in waiting or running, in the order they joined

A sample is in at most one of waiting and running, and in by_rid exactly while it is in one
of them. Adding, moving and removing a sample, and finding a request's samples, take O(1)
(O(n) for a request's n samples); nothing scans a queue. `check` recomputes by_rid from the
two queues and compares.
"""

from __future__ import annotations

from collections.abc import Iterator

from radixserve.scheduler.sample import Sample


class SampleQueue:
    """Samples in the order they joined, with O(1) append, remove and membership."""

    def __init__(self) -> None:
        self._order: dict[Sample, None] = {}

    def append(self, req: Sample) -> None:
        assert req not in self._order, f"{req.rid}/{req.index} queued twice"
        self._order[req] = None

    def remove(self, req: Sample) -> None:
        del self._order[req]

    def __contains__(self, req: object) -> bool:
        return req in self._order

    def __iter__(self) -> Iterator[Sample]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __bool__(self) -> bool:
        return bool(self._order)


class SampleTables:
    """`waiting`, `running` and `by_rid` (module docstring), changed only through these
    methods."""

    def __init__(self) -> None:
        self.waiting = SampleQueue()
        self.running = SampleQueue()
        self.by_rid: dict[str, list[Sample]] = {}

    def queue(self, req: Sample) -> None:
        """A new sample joins the waiting queue."""
        self.waiting.append(req)
        self.by_rid.setdefault(req.rid, []).append(req)

    def run(self, req: Sample) -> None:
        """A new sample (a fork with its prompt's K/V) starts running at once."""
        self.running.append(req)
        self.by_rid.setdefault(req.rid, []).append(req)

    def start(self, req: Sample) -> None:
        """A waiting sample was admitted."""
        self.waiting.remove(req)
        self.running.append(req)

    def retract(self, req: Sample) -> None:
        """A running sample goes back to the waiting queue."""
        self.running.remove(req)
        self.waiting.append(req)

    def drop(self, req: Sample) -> bool:
        """The sample ends: out of every table. Returns whether it was running."""
        was_running = req in self.running
        (self.running if was_running else self.waiting).remove(req)
        samples = self.by_rid[req.rid]
        samples.remove(req)  # a request's own few samples
        if not samples:
            del self.by_rid[req.rid]
        return was_running

    def samples(self, rid: str) -> list[Sample]:
        """The request's samples still waiting or running (a copy)."""
        return list(self.by_rid.get(rid, ()))

    def check(self) -> None:
        """by_rid against a recomputation from the queues; no sample in both."""
        both = [r for r in self.running if r in self.waiting]
        assert not both, f"samples both waiting and running: {[(r.rid, r.index) for r in both]}"
        want: dict[str, set[Sample]] = {}
        for r in [*self.waiting, *self.running]:
            want.setdefault(r.rid, set()).add(r)
        got = {rid: set(samples) for rid, samples in self.by_rid.items()}
        assert got == want, f"by_rid {sorted(got)} vs the queues' {sorted(want)}"
        assert all(len(s) == len(set(s)) for s in self.by_rid.values()), "a sample listed twice"
