"""Tensor-parallel process group and weight sharding (Megatron-style, heads / intermediate).

Ranks 0..N-1 each hold 1/N of every attention and MLP projection; everything else
(embeddings, norms, LM head, RoPE cache) is replicated:

    qkv_proj     column-parallel: rank r keeps q heads [r*Hq/N, (r+1)*Hq/N) and KV heads
                 [r*Hkv/N, (r+1)*Hkv/N) (a KV head's q group never straddles ranks, so GQA
                 needs no communication)
    o_proj       row-parallel: rank r keeps the input columns of its q heads; the partial
                 outputs are summed with all_reduce
    gate_up_proj column-parallel over the intermediate dimension
    down_proj    row-parallel over the intermediate dimension, then all_reduce

A row-parallel bias is added once: rank 0 keeps it, the other ranks get zeros.

Groups. `init_tp` creates two groups over the same N processes:
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

import dataclasses
import datetime
import logging
import os
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # a runtime import would cycle: radixserve.models.llama imports this module
    from radixserve.models.config import ModelConfig

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
    else:  # CPU ranks share the cores: oversubscribed OpenMP threads spin against each other
        torch.set_num_threads(max(1, _usable_cpus() // size))
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=size,
        timeout=ALL_REDUCE_TIMEOUT,
    )
    ctrl = dist.new_group(list(range(size)), backend="gloo", timeout=IDLE_TIMEOUT)
    _GROUP = TPGroup(rank, size, ctrl, threads_before=threads_before)
    logger.info(
        "tensor parallel: rank %d of %d joined (%s, %d CPU threads)",
        rank, size, dist.get_backend(), torch.get_num_threads(),
    )  # fmt: skip
    return _GROUP


def _usable_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):  # Linux: honours taskset / cgroup CPU sets
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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


# ---------------------------------------------------------------- weight sharding


def check_tp_size(config: ModelConfig, tp_size: int) -> None:
    """ValueError unless `tp_size` divides the q heads, KV heads and intermediate size."""
    parts = {
        "attention heads": config.num_heads,
        "KV heads": config.num_kv_heads,
        "intermediate size": config.intermediate_size,
    }
    bad = {name: n for name, n in parts.items() if n % tp_size}
    if tp_size < 1 or bad:
        raise ValueError(
            f"--tp-size {tp_size} must divide the model's attention heads "
            f"({config.num_heads}), KV heads ({config.num_kv_heads}) and intermediate size "
            f"({config.intermediate_size}); it does not divide {', '.join(bad) or 'anything'}"
        )


def local_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The config of one rank's shard: heads and intermediate size divided by `tp_size`.

    Everything else (hidden size, head_dim, vocab, RoPE) is unchanged, so a model built from
    it has exactly the shapes of one rank's weights. Raises ValueError (see check_tp_size).
    """
    check_tp_size(config, tp_size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // tp_size,
        num_kv_heads=config.num_kv_heads // tp_size,
        intermediate_size=config.intermediate_size // tp_size,
    )


def shard_hf_weights(
    hf: dict[str, torch.Tensor], config: ModelConfig, rank: int, size: int
) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard of an HF state dict (unfused names), as contiguous copies.

    Does not modify `hf`. Tensors not named here (embeddings, norms, lm_head) are shared
    as they are. Raises ValueError (see check_tp_size).
    """
    check_tp_size(config, size)
    d = config.head_dim
    q_rows = _part(config.num_heads * d, rank, size)
    kv_rows = _part(config.num_kv_heads * d, rank, size)
    inter = _part(config.intermediate_size, rank, size)
    # name suffix -> (dim to split, [start, end)); dim 0 = output rows, dim 1 = input columns
    column = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
              "gate_proj": inter, "up_proj": inter}  # fmt: skip
    row = {"o_proj": q_rows, "down_proj": inter}
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        proj, kind = name.split(".")[-2:]
        if proj in column:
            a, b = column[proj]
            out[name] = t[a:b].contiguous()  # weight (out, in) and bias (out,) alike
        elif proj in row and kind == "weight":
            a, b = row[proj]
            out[name] = t[:, a:b].contiguous()  # (hidden, in / N)
        elif proj in row:  # a row-parallel bias: added once, after the sum
            out[name] = t if rank == 0 else torch.zeros_like(t)
        else:
            out[name] = t
    return out


def _part(n: int, rank: int, size: int) -> tuple[int, int]:
    step = n // size
    return rank * step, (rank + 1) * step
