"""Follower ranks (1..N-1): load a shard, then run every step rank 0 broadcasts, until stop.

Who starts them:
- the server: the launcher spawns `run_follower` for each follower rank as an ordinary
  child (`procutil.child_main`), beside the scheduler process (rank 0), so a crashed rank
  takes the server down like any crashed child;
- an in-process Engine with tp_size > 1: its ModelWorker calls `start_local_tp`, which
  spawns the followers as daemon children of this process and joins the group as rank 0.

Life cycle of one follower: init_tp -> ModelWorker (shard + KV pool; agrees on the pool size
with the other ranks) -> `worker.follow()` until rank 0's stop -> destroy_tp -> exit 0. If
rank 0 dies, gloo raises in `follow` and the follower exits 1 with that traceback.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from multiprocessing.process import BaseProcess
from typing import Any

from radixserve.config import EngineConfig
from radixserve.distributed.parallel import TPGroup, destroy_tp, init_tp
from radixserve.models.resolve import resolve_model_path
from radixserve.procutil import child_main
from radixserve.worker.batch_sync import send_stop
from radixserve.worker.model_worker import ModelWorker

logger = logging.getLogger("radixserve.tp")

FOLLOWER_JOIN_S = 10.0


def init_method_in(folder: str) -> str:
    """The rendezvous every rank of one group passes to init_tp: a file in a private folder
    (no TCP port to race for). The folder must outlive the group."""
    return f"file://{os.path.join(folder, 'tp-init')}"


def run_follower(
    config: EngineConfig, rank: int, init_method: str, started: Any | None = None
) -> None:
    """Main of follower `rank`: returns after rank 0's stop; raises if rank 0 dies.

    `started` (a multiprocessing Event, optional) is set once this process is up, just
    before it joins the group, so a parent waiting to join can tell "slow" from "dead".
    """
    assert 1 <= rank < config.tp_size, f"follower rank {rank} for tp_size {config.tp_size}"
    if started is not None:
        started.set()
    init_tp(rank, config.tp_size, init_method, config.device)
    worker = ModelWorker(config, str(resolve_model_path(config.model, config.revision)))
    logger.info("tp rank %d ready", rank)
    worker.follow()
    destroy_tp()


def _spawn_follower(config: EngineConfig, rank: int, init_method: str) -> tuple[BaseProcess, Any]:
    """Start follower `rank` as a daemon "spawn" child running `run_follower` under
    child_main (crash -> traceback logged, exit 1; dies with this process). -> (process, its
    `started` Event)."""
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    name = f"tp-rank-{rank}"
    args = (name, config.log_level, os.getpid(), run_follower, config, rank, init_method, started)
    proc = ctx.Process(target=child_main, args=args, name=f"radixserve-{name}", daemon=True)
    proc.start()
    return proc, started


def _wait_started(procs: list[BaseProcess], events: list[Any]) -> None:
    """Until every follower is up; RuntimeError if one dies first (else rank 0 would wait
    in the rendezvous for the whole ALL_REDUCE_TIMEOUT)."""
    while not all(e.is_set() for e in events):
        dead = [p for p, e in zip(procs, events) if p.exitcode is not None and not e.is_set()]
        if dead:
            raise RuntimeError(
                f"{dead[0].name} exited with code {dead[0].exitcode} before joining the TP "
                "group (its traceback is above)"
            )
        time.sleep(0.05)


def start_local_tp(config: EngineConfig) -> TPGroup:
    """In-process Engine: spawn followers 1..N-1 here and join the group as rank 0.

    Blocks until every follower has joined. The returned group owns the followers and the
    scratch folder; `stop_followers` ends both. As with any "spawn" multiprocessing, a script
    that builds such an Engine needs the `if __name__ == "__main__":` guard.
    """
    scratch = tempfile.mkdtemp(prefix="radixserve-tp-")  # 0700: nobody else can join
    init_method = init_method_in(scratch)
    followers: list[BaseProcess] = []
    try:
        started = []
        for rank in range(1, config.tp_size):
            proc, event = _spawn_follower(config, rank, init_method)
            followers.append(proc)
            started.append(event)
        _wait_started(followers, started)
        tp = init_tp(0, config.tp_size, init_method, config.device)
    except BaseException:  # e.g. spawn refused in a script without `if __name__ == "__main__"`
        _end(followers, scratch)
        raise
    tp.followers, tp.scratch_dir = followers, scratch
    return tp


def stop_followers(tp: TPGroup, send: bool = True) -> None:
    """Rank 0: stop the followers (`send`: by message first), join those this process
    spawned (none in the server: the launcher joins them), and leave the group.

    `send=False`, or a group no longer `healthy` (a collective may be half done): the
    followers are terminated instead. Never raises for a follower that is already gone.
    """
    assert tp.is_leader, f"rank {tp.rank} does not own the followers"
    send = send and tp.healthy
    if send:
        try:
            send_stop(tp)
        except RuntimeError as e:  # a follower is already dead: gloo says so
            logger.warning("could not send stop to the TP followers: %s", e)
    _end(tp.followers, tp.scratch_dir, timeout=FOLLOWER_JOIN_S if send else 0.0)
    destroy_tp()


def _end(procs: list[BaseProcess], scratch: str | None, timeout: float = 0.0) -> None:
    for proc in procs:
        proc.join(timeout)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
