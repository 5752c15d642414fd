"""Host time per decode step: everything a step does except the model's own computation.

Method: the real `Scheduler` over the real `ModelWorker`. `time.perf_counter` brackets each
`Scheduler.step()` and, inside it, four parts, each its own method wrapped by this script:
  - build     `Scheduler._build_batch`: the step's ForwardBatch, logits rows, first rows;
  - plan      the attention backend's `plan(batch)` (the tree plan of the radix backend);
  - model     the rest of `ModelWorker.forward`: the layers and the logits (not host time);
  - sampling  `OutputProcessor.draw`: logits to tokens (penalties, masks, the draw);
  - bookkeeping: the step's remainder: scheduling, KV slots and eviction, stop checks and
    collecting the outputs.
The host time of a step is the step's wall time less `model`. Only full decode steps count
(every one of the B samples adds one token); the admission and prefill steps before them
are not timed. Each part's median over the timed steps is reported (and the host time's
mean, min, max), and the host time in the scheduling thread's CPU time (`time.thread_time`;
on a busy machine the wall time also holds waits for the CPU, e.g. of torch's intra-op
threads inside the sampler).

Workload (the case the scheduler's per-step state is built for):
  - the prefix cache first holds a filler tree of --tree-nodes nodes (100 first-level nodes
    with --tree-nodes / 100 leaves each; their slots hold zeros, their K/V is never read),
    topped up once the requests are admitted so that the pool is full;
  - B requests share a 64-token system prompt, 16 groups of them a 16-token group prompt,
    each one its own 8-token tail; half decode greedily, half draw with temperature 0.8
    and a seed, and every fourth sample has a repetition and a frequency penalty; all
    ignore eos;
  - so the timed decode steps (--steps of them, right after the prefill) evict filler
    leaves to make room for their B new tokens each: a step finding too few free slots
    evicts what it needs and up to `kv.EVICT_AHEAD` more, which the next steps take. The
    bookkeeping's mean is reported beside its median, as that eviction falls on some steps;
  - with --leaving N, N samples are aborted before every timed step but the first (not
    timed), so each of those steps decodes a set of samples the step before did not: the
    case where a batch kept from step to step has rows removed.
The tokens every sample generated until the last timed step are hashed into
"outputs_sha256": the same hash before and after a change to the scheduler means the same
outputs (greedy, seeded and penalised draws alike).

Models: "tiny" (a seeded random Llama, hidden 64, 2 layers, the SmolLM2 tokenizer and its
49152-token vocabulary: the forward is small, so the host's share shows) and "smollm2"
(the embedded SmolLM2-135M, the Engine's default model).

    python benchmarks/bench_scheduler.py                       # tiny, B=16 and 256
    python benchmarks/bench_scheduler.py --models smollm2 --batch 16 --steps 16
    python benchmarks/bench_scheduler.py --models tiny smollm2 --batch 16 64 256
    python benchmarks/bench_scheduler.py --batch 256 --leaving 4     # rows leave every step

Results go to benchmarks/results/scheduler_step_<cpu>-<isa>_<date>.json unless --output-json.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixserve.config import EngineConfig
from radixserve.core.batch import ForwardBatch
from radixserve.core.params import SamplingParams
from radixserve.core.request import TokenDelta, TokenizedRequest
from radixserve.isa import cpu_isa
from radixserve.models.synthetic import build_tiny_model
from radixserve.scheduler.kv import EVICT_AHEAD
from radixserve.scheduler.parts import SchedulerParts, load_parts
from radixserve.scheduler.scheduler import Scheduler

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEM_TOKENS, GROUP_TOKENS, TAIL_TOKENS, GROUPS = 64, 16, 8, 16
FILLER_FANOUT = 100  # first-level filler nodes
FILLER_LEAF_TOKENS = 3
TOKEN_BASE = 1000  # prompt and filler token ids start here (below every special token)
FILLER_MAX_LEAVES = 15000


def machine_tag() -> str:
    """<cpu>-<isa>, e.g. zen5-avx512: the AMD Zen generation from /proc/cpuinfo's family
    (and AVX-512 for Zen 3 vs 4), else the vendor."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    vendor, family = info.get("vendor_id", ""), int(info.get("cpu family", "0") or 0)
    if vendor == "AuthenticAMD" and family == 26:
        cpu = "zen5"
    elif vendor == "AuthenticAMD" and family == 25:
        cpu = "zen4" if "avx512f" in info.get("flags", "").split() else "zen3"
    elif vendor == "GenuineIntel":
        cpu = "intel"
    else:
        cpu = "cpu"
    return f"{cpu}-{cpu_isa()}"


def prompts(batch: int) -> list[list[int]]:
    """B prompts: a shared system part, one of GROUPS group parts, an own tail."""
    system = [TOKEN_BASE + i for i in range(SYSTEM_TOKENS)]
    base = TOKEN_BASE + SYSTEM_TOKENS
    out = []
    for i in range(batch):
        g = i % GROUPS
        group = [base + g * GROUP_TOKENS + j for j in range(GROUP_TOKENS)]
        tail = [base + GROUPS * GROUP_TOKENS + (i * TAIL_TOKENS + j) % 20000 for j in range(8)]
        out.append(system + group + tail)
    return out


def fill_tree(sched: Scheduler, leaves: range) -> None:
    """Insert filler leaves straight into the prefix cache, under FILLER_FANOUT first-level
    nodes (their slots hold zeros; no request ever matches them)."""
    first = TOKEN_BASE + 30000  # disjoint from every prompt token
    assert leaves.stop <= FILLER_MAX_LEAVES, f"at most {FILLER_MAX_LEAVES} filler leaves"
    tail = [first + FILLER_FANOUT + FILLER_MAX_LEAVES + j for j in range(FILLER_LEAF_TOKENS - 1)]
    for i in leaves:
        key = [first + i % FILLER_FANOUT, first + FILLER_FANOUT + i, *tail]
        slots = sched.kv.pool.alloc(len(key))
        assert slots is not None, "the pool is too small for the filler tree"
        sched.cache.insert(key, slots)


PARTS = ("build", "plan", "model", "sampling")
SPLIT = ("build", "plan", "sampling", "bookkeeping")  # the host time's parts


class StepTimer:
    """Wall time of each part (module docstring) of `sched`'s steps, summed in `spent`
    since `reset`, and this thread's CPU time of the model's part in `model_cpu_s`."""

    def __init__(self, sched: Scheduler) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)
        self.model_cpu_s = 0.0
        self.batch: ForwardBatch | None = None  # the last step's
        self._wrap(sched, "_build_batch", "build")
        self._wrap(sched.out, "draw", "sampling")
        backend = sched.worker.backend
        self._wrap(backend, "plan", "plan")
        worker = sched.worker
        inner: Callable[[ForwardBatch, torch.Tensor], torch.Tensor] = worker.forward

        def forward(batch: ForwardBatch, rows: torch.Tensor) -> torch.Tensor:
            t0, c0, plan0 = time.perf_counter(), time.thread_time(), self.spent["plan"]
            logits = inner(batch, rows)
            plan = self.spent["plan"] - plan0
            self.spent["model"] += time.perf_counter() - t0 - plan
            self.model_cpu_s += time.thread_time() - c0 - plan
            self.batch = batch
            return logits

        worker.forward = forward  # type: ignore[method-assign]

    def _wrap(self, owner: object, method: str, part: str) -> None:
        inner = getattr(owner, method)

        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args)
            finally:
                self.spent[part] += time.perf_counter() - t0

        setattr(owner, method, timed)

    def reset(self) -> None:
        self.spent = dict.fromkeys(PARTS, 0.0)
        self.model_cpu_s = 0.0
        self.batch = None


def run(
    parts: SchedulerParts, config: EngineConfig, batch: int, steps: int, tree: int, leaving: int
) -> dict[str, Any]:
    sched = Scheduler(config, parts)
    leaves = filler_leaves(tree)
    fill_tree(sched, range(leaves))
    new = steps + 8
    assert leaving * steps < batch, f"{leaving} leaving at each of {steps} steps: B > {batch}"
    for i, ids in enumerate(prompts(batch)):
        penalties = {"repetition_penalty": 1.1, "frequency_penalty": 0.5} if i % 4 == 3 else {}
        temperature = 0.8 if i % 2 else 0.0
        sp = SamplingParams(
            temperature=temperature,
            seed=1000 + i if i % 2 else None,
            max_new_tokens=new,
            ignore_eos=True,
            **penalties,  # type: ignore[arg-type]
        )
        sched.add_request(TokenizedRequest(f"r{i}", ids, sp))
    tokens: dict[str, list[int]] = {}
    while sched.waiting or any(r.kv_len < r.seq_len - 1 for r in sched.running):
        collect(sched.step(), tokens)  # admission and prefill
    # Top the filler up: what admission left free is taken, so every decode step evicts.
    top_up = max(sched.kv.pool.num_free - batch // 2, 0) // FILLER_LEAF_TOKENS
    fill_tree(sched, range(leaves, leaves + top_up))
    timer = StepTimer(sched)
    ms: dict[str, list[float]] = {part: [] for part in (*PARTS, "bookkeeping", "host")}
    cpu_ms: list[float] = []
    nodes = [sched.cache.num_nodes]
    for step in range(steps):
        for i in range(leaving * (step - 1), leaving * step) if step else ():
            sched.abort_request(f"r{i}")
        running = batch - leaving * step
        assert len(sched.running) == running, (len(sched.running), running)
        assert sched.kv.pool.num_free < batch + EVICT_AHEAD, sched.kv.pool.num_free
        timer.reset()
        t0, c0 = time.perf_counter(), time.thread_time()
        outputs = sched.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        collect(outputs, tokens)
        b = timer.batch
        assert b is not None and b.is_decode and b.num_requests == running, "not a decode step"
        for part, spent in timer.spent.items():
            ms[part].append(1000 * spent)
        ms["host"].append(1000 * (wall - timer.spent["model"]))
        ms["bookkeeping"].append(1000 * wall - sum(ms[part][-1] for part in PARTS))
        cpu_ms.append(1000 * (cpu - timer.model_cpu_s))
        nodes.append(sched.cache.num_nodes)
    digest = hashlib.sha256(json.dumps([tokens[f"r{i}"] for i in range(batch)]).encode())
    host = ms["host"]
    return {
        "batch": batch,
        "leaving_per_step": leaving,
        "timed_steps": steps,
        "tree_nodes_first_last": [nodes[0], nodes[-1]],
        "kv_capacity": sched.kv.pool.capacity,
        **{f"{part}_ms_median": statistics.median(v) for part, v in ms.items()},
        "host_ms_mean": statistics.fmean(host),
        "bookkeeping_ms_mean": statistics.fmean(ms["bookkeeping"]),
        "host_ms_min": min(host),
        "host_ms_max": max(host),
        "host_thread_cpu_ms_median": statistics.median(cpu_ms),
        "outputs_sha256": digest.hexdigest(),
    }


def collect(outputs: list[TokenDelta], tokens: dict[str, list[int]]) -> None:
    for o in outputs:
        tokens.setdefault(o.rid, []).extend(o.new_token_ids)


def filler_leaves(tree_nodes: int) -> int:
    return max(tree_nodes - FILLER_FANOUT, FILLER_FANOUT)


def pool_tokens(batch: int, tree_nodes: int) -> int:
    """The filler, the prompts, and room for admission to reserve its decode slots (the
    filler is topped up afterwards)."""
    filler = FILLER_FANOUT + filler_leaves(tree_nodes) * FILLER_LEAF_TOKENS
    prompt = SYSTEM_TOKENS + GROUPS * GROUP_TOKENS + batch * TAIL_TOKENS
    return filler + prompt + 2 * batch


def bench(name: str, batch: int, steps: int, tree: int, leaving: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        model = None if name == "smollm2" else str(build_tiny_model(Path(tmp) / "tiny"))
        config = EngineConfig(
            model=model,
            max_total_tokens=pool_tokens(batch, tree),
            max_running_requests=batch,
            random_seed=0,
        )
        t0 = time.perf_counter()
        parts = load_parts(config)
        load_s = time.perf_counter() - t0
        try:
            result = run(parts, config, batch, steps, tree, leaving)
        finally:
            parts.worker.close()
    result.update(model=name, load_s=round(load_s, 1), dtype=str(parts.worker.dtype))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", choices=["tiny", "smollm2"], default=["tiny"])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 256], help="concurrent requests")
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed")
    ap.add_argument("--tree-nodes", type=int, default=10_000, help="filler nodes in the cache")
    ap.add_argument("--leaving", type=int, default=0, help="samples finishing at each timed step")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tag = machine_tag()
    runs = []
    for name in args.models:
        for batch in args.batch:
            r = bench(name, batch, args.steps, args.tree_nodes, args.leaving)
            runs.append(r)
            split = ", ".join(f"{part} {r[f'{part}_ms_median']:.2f}" for part in SPLIT)
            print(
                f"{name:8s} B={batch:4d} tree {r['tree_nodes_first_last']} nodes: host "
                f"{r['host_ms_median']:.2f} ms/step median ({split}), thread CPU "
                f"{r['host_thread_cpu_ms_median']:.2f} ms, bookkeeping mean "
                f"{r['bookkeeping_ms_mean']:.2f}, model {r['model_ms_median']:.2f} "
                f"ms, outputs {r['outputs_sha256'][:12]}"
            )
    today = datetime.date.today().isoformat()
    out = Path(args.output_json or RESULTS / f"scheduler_step_{tag}_{today}.json")
    record = {
        "date": today,
        "machine": tag,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "command": "python benchmarks/bench_scheduler.py " + " ".join(sys.argv[1:]),
        "runs": runs,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
