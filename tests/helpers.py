"""Test-side drivers that run a model through ForwardBatch + KVPool without a scheduler, and
the engine tests' check that a run leaked no KV slot, and the runner of test scripts under
Triton's CPU interpreter.

Single request, no radix tree (paths=[[]]): the request's KV slots are allocated up front,
slot i holding position i. Import from a test module as `from helpers import ...` (pytest's
default rootdir-relative import mode puts tests/ on sys.path).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import Engine
from radixserve.attention import TreeBackend
from radixserve.attention.base import AttentionBackend
from radixserve.core.batch import ForwardBatch
from radixserve.kvcache.pool import KVPool
from radixserve.models.llama import LlamaForCausalLM


def make_pool(model: LlamaForCausalLM, num_tokens: int, sliding_rows: bool = False) -> KVPool:
    """A KV pool for `num_tokens` tokens (+ scratch slot 0) in the model's dtype; with
    `sliding_rows`, the model's sliding-window layers keep rows of their own (as a worker's
    pool does)."""
    cfg = model.config
    dtype = model.model.norm.weight.dtype  # (the embedding may be a quantized table)
    windows = [cfg.window(i) for i in range(cfg.num_layers)] if sliding_rows else []
    return KVPool(num_tokens + 1, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype,
                  windows=windows)  # fmt: skip


def alloc_slots(pool: KVPool, n: int) -> torch.Tensor:
    """`n` KV slots from `pool`; asserts the pool had room."""
    slots = pool.alloc(n)
    assert slots is not None, f"KV pool has {pool.num_free} free slots, asked for {n}"
    return slots


def extend(
    model: LlamaForCausalLM,
    backend: AttentionBackend,
    pool: KVPool,
    slots: torch.Tensor,  # (>= start + len(token_ids),) KV slot of every position
    token_ids: list[int],
    start: int,
) -> torch.Tensor:
    """Feed `token_ids` at positions start.. of one request -> logits (len(token_ids), vocab).

    Positions 0..start-1 must already be in `pool` at `slots[:start]`; writes the new K/V.
    """
    n = len(token_ids)
    end = start + n
    batch = ForwardBatch(
        input_ids=torch.tensor(token_ids, dtype=torch.int64),
        positions=torch.arange(start, end, dtype=torch.int64),
        out_cache_loc=slots[start:end],
        seq_lens=[end],
        extend_lens=[n],
        kv_indices=[slots[:end]],
        paths=[[]],
        kv_pool=pool,
        swa_kv_indices=None if pool.swa_of is None else [pool.swa_of[slots[:end]]],
    )
    backend.plan(batch)
    return model.compute_logits(model.forward(batch, backend))


def greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    backend: AttentionBackend,
    eos_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy (argmax) continuation: one prefill, then one decode step per new token.

    Stops after `max_new_tokens` or right after emitting a token in `eos_ids` (included in the
    result, as HF generate does). Returns only the new tokens.
    """
    total = len(prompt_ids) + max_new_tokens
    pool = make_pool(model, total)
    slots = alloc_slots(pool, total)
    logits = extend(model, backend, pool, slots, prompt_ids, 0)
    out: list[int] = []
    while True:
        token = int(logits[-1].argmax())
        out.append(token)
        if len(out) == max_new_tokens or token in eos_ids:
            return out
        logits = extend(model, backend, pool, slots, [token], len(prompt_ids) + len(out) - 1)


@contextmanager
def keep_every_segment(backend: TreeBackend) -> Iterator[None]:
    """Within the block, `backend` keeps every shared segment (thresholds at 1): for tests of
    the tree path on segments shorter than what its defaults keep."""
    saved = (backend.min_tokens, backend.min_reads, backend.min_tokens_extend)
    backend.min_tokens = backend.min_reads = backend.min_tokens_extend = 1
    try:
        yield
    finally:
        backend.min_tokens, backend.min_reads, backend.min_tokens_extend = saved


def assert_all_free(engine: Engine) -> None:
    """The engine's KV accounting holds, and once its cache is flushed every slot is free."""
    engine.check_integrity()
    assert engine.flush_cache()
    pool = engine.scheduler.kv.pool
    assert pool.num_free == pool.capacity
    assert pool.swa_used == 0
    drafter = engine.scheduler.speculator.drafter  # a draft model's pool: the samples ended
    if drafter is not None:
        assert drafter.worker.pool.num_free == drafter.worker.pool.capacity


ROOT = Path(__file__).resolve().parent.parent


def run_under_triton_interpreter(script: str, *args: str, timeout: float) -> str:
    """Run test file `script` as a script (`args` after it) with TRITON_INTERPRET=1, which
    must be set before triton itself is first imported (its own tl.* helpers are decorated
    then), so a pytest process cannot set it; assert that it succeeded and return its
    stdout. Skips where triton is not installed (an optional dependency)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (optional dependency)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "benchmarks")}
    proc = subprocess.run(
        [sys.executable, script, *args], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, f"child failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


def finish_gguf(w: Any, tensors: Iterable[tuple[str, Any]], quant: Any) -> None:
    """Add `tensors` ((llama.cpp name, float32 numpy array) pairs) to GGUFWriter `w`, the
    2-D and 3-D (stacked experts) layer tensors quantized to `quant` by the gguf package
    (F32: none; a router `ffn_gate_inp` stays F32, as llama.cpp's converter keeps it), and
    write the file."""
    import gguf

    for name, x in tensors:
        matrix = x.ndim in (2, 3) and name.startswith("blk.") and ".ffn_gate_inp." not in name
        if matrix and quant != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(x, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
