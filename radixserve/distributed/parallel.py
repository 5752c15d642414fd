"""Tensor-parallel process groups (the weight layout they serve: `radixserve.models.sharding`).

`init_tp` creates two groups over the same N processes:
- the default group (NCCL on GPU, gloo on CPU) for the per-layer all_reduce, with a bounded
  timeout: between two all_reduces each rank only runs one layer;
- `ctrl`, a gloo group on CPU tensors for the per-step batch broadcast (`batch_sync`). Its
  timeout is effectively infinite because followers wait there while the server idles; a
  rank that dies closes its sockets, and gloo raises at once on the peers ("Connection
  closed by peer"), so a crash is still noticed immediately.

The group of this process is process-global (like torch.distributed's own default group):
`init_tp` sets it, `get_tp` reads it, `destroy_tp` ends it.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess

import torch
import torch.distributed as dist

logger = logging.getLogger("radixserve.tp")

ALL_REDUCE_TIMEOUT = datetime.timedelta(minutes=10)  # one layer of one step, on any machine
IDLE_TIMEOUT = datetime.timedelta(days=365)  # followers wait for the next step this long

_GROUP: TPGroup | None = None


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group."""

    rank: int
    size: int
    ctrl: dist.ProcessGroup  # gloo, CPU tensors: batch broadcast and start-up agreement
    # Followers this process spawned itself (in-process Engine with tp_size > 1), joined on
    # close; empty in the server, whose launcher owns every rank.
    followers: list[BaseProcess] = field(default_factory=list)
    scratch_dir: str | None = None  # private folder of the init file, removed on close
    # False once a step failed on this rank: a collective may be half done, so no further
    # step or stop message may be sent (the peers are terminated instead).
    healthy: bool = True
    threads_before: int = 0  # torch's CPU thread count before init_tp; destroy_tp restores it

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def init_tp(rank: int, size: int, init_method: str, device: str) -> TPGroup:
    """Join the N-rank group (blocks until every rank has called it); sets `get_tp()`.

    `init_method`: a `file://` path in a private folder or `tcp://127.0.0.1:PORT`, the same
    on every rank. `device`: "cpu" -> gloo everywhere; "cuda" -> NCCL for all_reduce, and
    this rank uses GPU `rank`. Raises AssertionError if this process already has a group.
    """
    global _GROUP
    assert _GROUP is None and not dist.is_initialized(), "this process already has a TP group"
    assert 0 <= rank < size, f"rank {rank} out of range for tp_size {size}"
    cuda = device.startswith("cuda")
    threads_before = torch.get_num_threads()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=ALL_REDUCE_TIMEOUT,
    )
    ctrl = dist.new_group(list(range(size)), backend="gloo", timeout=IDLE_TIMEOUT)
    _GROUP = TPGroup(rank, size, ctrl, threads_before=threads_before)
    logger.info("tensor parallel: rank %d of %d joined (%s)", rank, size, dist.get_backend())
    return _GROUP


def get_tp() -> TPGroup | None:
    """The group `init_tp` made in this process, or None."""
    return _GROUP


def destroy_tp() -> None:
    """Leave the group (no collective; peers must not be waiting on this rank) and restore
    the CPU thread count `init_tp` changed (an in-process Engine's host process lives on)."""
    global _GROUP
    if dist.is_initialized():
        dist.destroy_process_group()
    if _GROUP is not None:
        torch.set_num_threads(_GROUP.threads_before)
    _GROUP = None


def rank_device(device: str, rank: int) -> str:
    """The device a rank runs on: GPU `rank` for "cuda" (any index given is ignored: rank r
    always drives GPU r, as `init_tp` set), else `device` unchanged."""
    return f"cuda:{rank}" if device.startswith("cuda") else device


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks in place (default group) and return it.

    A different summation order than one rank's full matmul: results match tp_size 1 to
    rounding (fp32: ~1e-6 of the logit scale in tests/test_tp.py), not bit for bit.
    """
    dist.all_reduce(x)
    return x


def agree_min(value: int, tp: TPGroup) -> int:
    """The smallest `value` over all ranks (a collective: every rank must call it)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.ctrl)
    return int(t.item())
