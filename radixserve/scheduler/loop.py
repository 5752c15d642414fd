"""The one step loop over the `Scheduler`, whichever way requests come in and outputs go out.

    driver: requests, aborts  ──> loop.add(request) / loop.abort(rid)
            loop.step()       ──> backlog admitted, Scheduler.step() ──> sink(outputs)

Drivers: the scheduler process (`scheduler_process.py`: inbox and outbox over ZeroMQ), the offline
`Engine` and the DSL's `EngineBackend` (in-process, in their caller's thread or a dispatcher
thread). What differs between them is only where requests come from and where these go:

- `sink(outputs)`: each step's `TokenDelta`s (never called with an empty list).
- `refuse(rid, status, message)`: a request not accepted; nothing of it stays in the loop
  (400: it can never run; 503: the queue is full and the loop keeps no backlog).
- `backlog=True` (in-process callers wait rather than retry): a request the queue has no
  room for waits here, and requests are added in arrival order as soon as the queue takes
  them (an empty queue takes any valid request, so a batch always progresses).

`active` counts, per accepted rid, the samples that have not finished; aborts of unknown or
finished rids are ignored. Rids are unique: the caller's edge refuses a rid in flight.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.core.request import TokenDelta, TokenizedRequest
from radixserve.scheduler.scheduler import QueueFullError, Scheduler

Sink = Callable[[list[TokenDelta]], None]
Refuse = Callable[[str, int, str], None]  # (rid, HTTP status, message)


class StepLoop:
    def __init__(self, sched: Scheduler, sink: Sink, refuse: Refuse, backlog: bool = False) -> None:
        self.sched = sched
        self.sink = sink
        self.refuse = refuse
        self.keeps_backlog = backlog
        self.backlog: list[TokenizedRequest] = []  # in arrival order
        self.active: dict[str, int] = {}  # rid -> samples not finished yet

    def add(self, request: TokenizedRequest) -> None:
        """Accept `request`, keep it in the backlog, or `refuse` it."""
        if self.backlog or not self._try_add(request):  # others wait already: keep the order
            self.backlog.append(request)

    def _try_add(self, request: TokenizedRequest) -> bool:
        """False only when the queue is full and the loop keeps a backlog."""
        rid = request.rid
        assert rid not in self.active, f"rid {rid!r} is already in use"
        try:
            self.sched.add_request(request)
        except QueueFullError as e:
            if self.keeps_backlog:
                return False
            self.refuse(rid, 503, str(e))
        except ValueError as e:
            self.refuse(rid, 400, str(e))
        else:
            self.active[rid] = request.sampling.n
        return True

    def abort(self, rid: str) -> None:
        """Stop an accepted `rid`: its samples end with finish "abort" outputs from the next
        step on. Unknown, backlogged or finished rids are ignored."""
        if rid in self.active:
            self.sched.abort_request(rid)

    def abort_all(self) -> None:
        """A failed caller: abort everything accepted and drop the backlog."""
        for rid in list(self.active):
            self.sched.abort_request(rid)
        self.backlog.clear()

    def has_work(self) -> bool:
        return bool(self.backlog) or self.sched.has_work()

    def step(self) -> bool:
        """Admit what the backlog can, run one scheduler step and sink its outputs.
        Returns False when there was nothing to do."""
        while self.backlog and self._try_add(self.backlog[0]):
            self.backlog.pop(0)
        if not self.sched.has_work():
            return False
        outputs = self.sched.step()
        for o in outputs:
            if o.finished and o.rid in self.active:
                self.active[o.rid] -= 1
                if self.active[o.rid] == 0:
                    del self.active[o.rid]
        if outputs:
            self.sink(outputs)
        return True
