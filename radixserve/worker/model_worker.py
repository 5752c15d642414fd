"""Model worker: owns the model, the KV pool and the attention backend; runs one step.

Tensor parallel (tp_size > 1): every rank has a ModelWorker with its shard of the weights and
a KV pool for its KV heads, all pools the same size with the same slot numbering. Rank 0's
worker (inside the Scheduler) broadcasts each step's batch before running it; followers run
`follow()` (radixserve.worker.tp_follower). Only rank 0 computes logits.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import itertools
import logging
import weakref
from pathlib import Path

import psutil
import torch

from radixserve import kernels
from radixserve.attention import make_backend
from radixserve.config import DTYPES, EngineConfig
from radixserve.core.batch import ForwardBatch
from radixserve.cpus import default_threads
from radixserve.distributed.parallel import TPGroup, agree_min, get_tp, rank_device
from radixserve.isa import resolve_dtype
from radixserve.kvcache.pool import KVPool
from radixserve.models import native as fused_ops
from radixserve.models.loader import int8_x_only, load_config, load_model
from radixserve.models.moe import QuantExperts
from radixserve.models.quant import QuantLinear
from radixserve.models.sharding import check_tp_size
from radixserve.native_build import build_in_background, use_native_ops
from radixserve.sampling import sampler
from radixserve.worker.batch_sync import recv_batch, send_batch
from radixserve.worker.buckets import DecodeBuckets

logger = logging.getLogger("radixserve.worker")
# Of the tokens a KV budget holds at every layer's cost, the share that keeps sliding-window
# K/V (kv_capacity): the full layers of a Gemma 3 (6 of 34) then hold 3.3x as many tokens.
SWA_ROWS_SHARE = 0.5


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc mallopt parameters (malloc.h)


def keep_freed_host_memory() -> None:
    """Make glibc malloc keep freed memory for reuse: no mmap per large block, no trimming.

    By default glibc serves each block above its mmap threshold (128 KiB, adapting up to
    32 MiB) with a fresh mmap and returns freed heap tops to the OS, so a forward's large
    activations page-fault in again on every step. Measured on a 2-core EPYC (Zen 4), prefill
    of 4096 tokens, A/B alternating: 373-500 -> 482-522 tok/s under the AVX2 settings; natively
    the cold first prefill 334-371 -> 570-660 tok/s, steady state unchanged. The memory then
    stays at the process's peak, which a server reaches in its first steps anyway. A no-op
    where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1):
        logger.info("host allocator: freed memory kept for reuse (no mmap, no trim)")


def kv_capacity(
    config: EngineConfig, full_bytes: int, row_bytes: int, mapped_weights: int, window: int = 0
) -> tuple[int, int | None, int]:
    """KV pool size: (slots, sliding rows (None: one per slot), the bytes they were sized
    from). --max-total-tokens (and --max-swa-tokens), else mem_fraction of the memory left
    after the weights are loaded: for a model with sliding-window layers (the widest
    `window`), SWA_ROWS_SHARE of the slots that budget buys at every layer's cost become
    rows (at least what one running sample may need) and the full layers take the rest of
    the budget (kvcache/pool.py).

    `full_bytes`, `row_bytes`: what one token costs in the full and the sliding layers, in
    the memory measured (on CPU, all TP ranks' shards together: they share the host's
    memory). `mapped_weights`: bytes of weights used in place from a file mapping, which
    the OS still counts as available (page cache, or not read yet) although every step
    reads them.
    """
    if config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info()
    else:
        free = max(psutil.virtual_memory().available - mapped_weights, 0)
    if config.max_total_tokens is not None:
        return config.max_total_tokens, config.max_swa_tokens, free
    budget = int(free * config.mem_fraction)
    if not row_bytes:
        return max(budget // full_bytes, 16), None, free
    rows = config.max_swa_tokens
    if rows is None:
        share = int(SWA_ROWS_SHARE * budget) // (full_bytes + row_bytes)
        rows = max(share, config.swa_rows_needed(window))
    left = budget - rows * row_bytes
    if left < 0:
        raise ValueError(
            f"max_swa_tokens: {rows} rows take {rows * row_bytes / 1e9:.2f} GB, more than "
            f"the KV budget ({budget / 1e9:.2f} GB); lower it or raise --mem-fraction"
        )
    return (max(left // full_bytes, rows) if full_bytes else rows), rows, free


def file_mapped_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's CPU tensors that live in a file mapping (a GGUF's blocks used in
    place; not those read from packed copies), from /proc/self/maps; 0 where there is no
    /proc."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return 0
    spans = []
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0":  # a nonzero inode: a file's pages
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            spans.append((lo, hi))
    spans.sort()
    starts = [lo for lo, _ in spans]
    unread = (
        b
        for m in model.modules()
        if isinstance(m, QuantLinear | QuantExperts)
        for b in m.unread_blocks()
    )
    seen, total = {b.data_ptr() for b in unread}, 0  # packed parts' blocks count as seen
    for t in itertools.chain(model.parameters(), model.buffers()):
        ptr = t.data_ptr()
        if t.device.type != "cpu" or ptr in seen:
            continue
        seen.add(ptr)
        i = bisect.bisect_right(starts, ptr) - 1
        if i >= 0 and ptr < spans[i][1]:
            total += t.numel() * t.element_size()
    return total


class ModelWorker:
    """Contract: `forward(batch, rows)` writes the batch's new K/V into the pool and returns
    float32 logits (len(rows), vocab) for the flattened token rows `rows`.

    With tp_size > 1 it joins the process's TP group (`get_tp()`), or, if there is none (an
    in-process Engine), spawns the followers and becomes rank 0. `close()` ends the
    followers; it also runs when the worker is garbage-collected or at interpreter exit.
    """

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        torch.manual_seed(config.random_seed)
        self.tp = _join_tp(config, model_path)
        self._closer: weakref.finalize | None = None
        try:
            self._build(config, model_path)
        except BaseException:
            if self.tp is not None and self.tp.is_leader:
                _stop_followers(self.tp, send=False)
            raise
        if self.tp is not None and self.tp.is_leader:
            self._closer = weakref.finalize(self, _stop_followers, self.tp)

    def _build(self, config: EngineConfig, model_path: str) -> None:
        rank, size = (self.tp.rank, self.tp.size) if self.tp is not None else (0, 1)
        device = rank_device(config.device, rank)
        self.device = torch.device(device)
        if not device.startswith("cuda"):
            keep_freed_host_memory()
            if config.threads or size > 1:  # else as the process has them (cpus.py)
                torch.set_num_threads(config.threads or default_threads(rank, size))
            logger.info("%d CPU threads", torch.get_num_threads())
        select_fast_paths(config)
        if not device.startswith("cuda") and config.native_ops:
            build_cpu_kernels_in_background()
        int8_x = int8_x_only(
            model_path, config.quantization, config.quant_activations, size, device
        )
        self.dtype, why = resolve_dtype(config.dtype, device, int8_x)
        logger.info("dtype %s (%s: %s)", self.dtype, config.dtype, why)
        self.model, self.model_config = load_model(
            model_path, self.dtype, device, packed_linear=config.packed_linear_request,
            tp_rank=rank, tp_size=size, quantization=config.quantization,
            activations=config.quant_activations,
        )  # fmt: skip
        self.backend = make_backend(config.attention_backend)
        host = self.device.type == "cpu"  # the scheduler's request-to-token table is here
        self.buckets = (
            DecodeBuckets(config.max_running_requests, self.device, copy_table=not host)
            if config.decode_buckets
            else None
        )
        self.kv_dtype, why = kv_cache_dtype(
            config.kv_cache_dtype, self.dtype, is_quantized(self.model), device
        )
        logger.info("KV cache dtype %s (%s: %s)", self.kv_dtype, config.kv_cache_dtype, why)
        mc = self.model_config
        kv_heads = mc.num_kv_heads // size  # this rank's shard of the KV heads
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        windows = [mc.window(i) for i in range(mc.num_layers)]
        layer_bytes = 2 * kv_heads * mc.head_dim * itemsize
        row_bytes = layer_bytes * sum(w > 0 for w in windows)
        full_bytes = layer_bytes * mc.num_layers - row_bytes
        sharing = 1 if device.startswith("cuda") else size  # CPU ranks share host memory
        mapped = file_mapped_bytes(self.model) if not device.startswith("cuda") else 0
        capacity, rows, free = kv_capacity(
            config, full_bytes * sharing, row_bytes * sharing, mapped, max(windows)
        )
        if self.tp is not None:  # same slot numbering on every rank needs the same size
            capacity = agree_min(capacity, self.tp)
            rows = None if rows is None else agree_min(rows, self.tp)
        self.pool = KVPool(capacity + 1, mc.num_layers, kv_heads, mc.head_dim,
                           self.kv_dtype, device, windows, rows)  # fmt: skip
        per_token = full_bytes + row_bytes
        kv_bytes = capacity * full_bytes + self.pool.swa_capacity * row_bytes
        logger.info(
            "KV pool: %d tokens%s, %.2f GB (%d B/token)%s, %s of %.2f GB free after the "
            "weights (%.2f GB of them used in place from the file); attention backend %s",
            capacity,
            f" ({self.pool.swa_capacity} with sliding-window K/V)" if row_bytes else "",
            kv_bytes / 1e9,
            per_token,
            f" on TP rank {rank} of {size}" if size > 1 else "",
            "--max-total-tokens" if config.max_total_tokens else f"{config.mem_fraction:g}",
            free / 1e9,
            mapped / 1e9,
            self.backend.name,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self._forward(batch, rows)
        assert self.tp.healthy, "an earlier step failed: the TP ranks are out of step"
        self.tp.healthy = False  # until this step's collectives are all done
        send_batch(self.tp, batch)  # the followers run this same step with us
        logits = self._forward(batch, rows)
        self.tp.healthy = True
        return logits

    def _forward(self, batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cpu":  # the scheduler builds the step's tensors on the host
            batch = dataclasses.replace(
                batch,
                input_ids=batch.input_ids.to(self.device, non_blocking=True),
                positions=batch.positions.to(self.device, non_blocking=True),
                out_cache_loc=batch.out_cache_loc.to(self.device, non_blocking=True),
            )
            rows = rows.to(self.device, non_blocking=True)
        self.backend.plan(batch)
        if self.buckets is not None and self.buckets.fits(batch):
            batch = self.buckets.pad(batch)  # rows 0..B-1 are the step's, as `rows` reads
        hidden = self.model(batch, self.backend)  # (T, hidden)
        return self.model.compute_logits(hidden[rows])  # (len(rows), vocab) float32

    @torch.inference_mode()
    def follow(self) -> None:
        """Follower ranks: run each step rank 0 broadcasts until it sends stop.

        Mutates only the KV pool. Raises RuntimeError (gloo) if rank 0 dies.
        """
        assert self.tp is not None and not self.tp.is_leader, "follow() is for ranks >= 1"
        while (batch := recv_batch(self.tp, self.pool)) is not None:
            self.backend.plan(batch)
            self.model(batch, self.backend)  # hidden states are rank 0's business

    def close(self) -> None:
        """Rank 0: stop the follower ranks and leave the TP group. Idempotent; a no-op at
        tp_size 1 and on followers. Call it only between steps."""
        if self._closer is not None:
            self._closer()


def select_fast_paths(config: EngineConfig) -> None:
    """Set the two process-wide kernel switches from the config (the last worker started in
    a process wins): native CPU ops on/off, and the attention ops' implementation.
    packed_linear travels to the loader as an argument."""
    use_native_ops(config.native_ops)
    kernels.set_impl(config.attention_kernels)
    logger.info(
        "fast paths: native CPU ops %s, attention kernels %s, packed linear %s",
        "on" if config.native_ops else "off", config.attention_kernels, config.packed_linear,
    )  # fmt: skip


def build_cpu_kernels_in_background() -> None:
    """Start building the native modules every CPU worker calls (attention ops, fused
    RMSNorm/RoPE, sampler), so that a first start compiles them while the model loads,
    side by side with the quantized kernels the loader builds. Cached builds just load."""
    build_in_background(
        lambda: kernels.resolve_impl(torch.empty(0)), fused_ops.ops, sampler.native_ops
    )


def is_quantized(model: torch.nn.Module) -> bool:
    return any(isinstance(m, QuantLinear) for m in model.modules())


def kv_cache_dtype(
    choice: str, compute: torch.dtype, quantized: bool, device: str
) -> tuple[torch.dtype, str]:
    """The KV pool's storage dtype and why. "auto": float16 under quantized weights on a CPU
    whose native attention kernels read the pool in place (they convert rows to float32 on
    load: half the bytes a decode step reads, as llama.cpp's default f16 cache), else the
    compute dtype. A dtype other than the compute dtype needs those kernels (the gathering
    attention paths compute in the pool's dtype)."""
    probe = torch.empty(0, 1, 8, dtype=torch.float16)
    in_place = device == "cpu" and kernels.reads_pool_in_place(probe)
    if choice == "auto":
        if in_place and quantized and compute == torch.float32:
            return torch.float16, "quantized weights, native CPU attention: fp16 rows, fp32 math"
        return compute, "the compute dtype"
    want = DTYPES[choice]
    if want != compute and not in_place:
        raise ValueError(
            f"kv_cache_dtype {choice} differs from the compute dtype {compute}: only the native "
            "CPU attention kernels read such a pool; use kv_cache_dtype=auto"
        )
    return want, "requested"


def _join_tp(config: EngineConfig, model_path: str) -> TPGroup | None:
    if config.tp_size == 1:
        return None
    check_tp_size(load_config(model_path), config.tp_size)  # fail before any collective
    tp = get_tp()
    if tp is None:  # no launcher made a group: this process leads and spawns the followers
        from radixserve.worker.tp_follower import start_local_tp  # (it imports us)

        tp = start_local_tp(config)
    assert tp.size == config.tp_size, f"TP group of {tp.size} ranks, config says {config.tp_size}"
    return tp


def _stop_followers(tp: TPGroup, send: bool = True) -> None:
    from radixserve.worker.tp_follower import stop_followers  # (it imports us)

    stop_followers(tp, send)
