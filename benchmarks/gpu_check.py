"""The GPU path, checked and measured in one run: exactness on the device, then tree vs flat
attention, then end-to-end decode against HF transformers. Writes one JSON and one plot.

    python benchmarks/gpu_check.py --out DIR [--model GGUF_OR_FOLDER] [--quick]
    python benchmarks/gpu_check.py --make-reference   # on a CPU: the fp32 greedy reference

Sections (each recorded in the JSON with its error if it fails; exit status 1 if any check
fails or any section errors):
1. `kernels`: the Triton ops on random trees (a root shared by all requests, segments shared
   by groups, private tails; decode rows and extends; pool slots shuffled) against the torch
   oracle (kernels/reference.py in float32 on the same rounded inputs): tree (segments read
   once, each resuming the previous state) and flat (each request's whole path), split-K
   off, forced and automatic. Tolerances: `TOLERANCES`.
2. `greedy`: the embedded model through `Engine(device="cuda")` in bf16 and float32, tree and
   flat backends, against the CPU float32 run stored in benchmarks/data/gpu_greedy_reference.json
   (a ~1.1k-token few-shot GSM8K prefix shared by 8 questions, so the tree backend keeps it):
   identical tokens, or the first divergence at a CPU near-tie (top-2 logprob gap below
   `NEAR_TIE`).
3. `attention`: one layer's decode attention, SmolLM2 heads, bf16, B in {16, 64, 256} x
   P in {1024, 4096, 16384} shared tokens + R = 128 private tokens each: tree (segment once,
   then the private parts resuming its state) vs flat (each request's whole path), each
   timed as CUDA-graph replays of `GRAPH_CALLS` calls (device time without launch gaps) and
   as eager calls (what a step pays today), beside its HBM roofline (bytes read once at the
   read bandwidth measured in this run).
4. `e2e`: decode of B = 64 greedy samples of one P = 4096-token prompt, 128 tokens each:
   radixserve tree vs flat vs HF transformers `generate` (same weights, bf16, sdpa); decode
   time = a 128-token run minus a 1-token run, the cache flushed before each.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from radixserve.kernels import reference

ROOT = Path(__file__).resolve().parent.parent

REFERENCE = ROOT / "benchmarks" / "data" / "gpu_greedy_reference.json"
HEADS = (9, 3, 64)  # SmolLM2-135M: Hq, Hkv, D
TOLERANCES = {  # (out atol, out rtol, lse atol) against the float32 oracle
    torch.float32: (1e-4, 0.0, 1e-4),
    torch.float16: (1e-2, 2e-2, 5e-4),
    torch.bfloat16: (2e-2, 2e-2, 5e-4),
}
NEAR_TIE = {"bfloat16": 0.5, "float32": 0.01}  # nats: a divergence below this gap is a tie
GRAPH_CALLS = 10
GREEDY_TOKENS = 48
DEVICE = "cuda"  # the e2e section runs on "cpu" too (a dry run of the script's own code)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------- 1. kernels
def random_tree(
    rng: random.Random, max_len: int, max_requests: int, extend: bool
) -> tuple[int, list[list[int]], list[int], list[int], list[int]]:
    """(root length, groups of request ids, group segment lengths, private lengths, q_lens):
    2..max_requests requests, 1-4 groups."""
    n_req = rng.randint(2, max_requests)
    order = list(range(n_req))
    rng.shuffle(order)
    cuts = sorted(rng.sample(range(1, n_req), min(rng.randint(0, 3), n_req - 1)))
    groups = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n_req], strict=True)]
    private = [rng.randint(1, max_len) for _ in range(n_req)]
    q_lens = [rng.randint(1, p) if extend and rng.random() < 0.5 else 1 for p in private]
    root = rng.randint(1, max_len)
    return root, groups, [rng.randint(0, max_len) for _ in groups], private, q_lens


def offsets(lens: list[int]) -> list[int]:
    """Cumulative lengths from 0: (len(lens) + 1,)."""
    return [0, *itertools.accumulate(lens)]


def check_random_trees(
    device: str, dtype: torch.dtype, cases: int, max_len: int, max_requests: int = 12, seed: int = 0
) -> dict[str, Any]:
    """Tree and flat through triton_ops on `cases` random trees vs the oracle; raises
    AssertionError past TOLERANCES. Returns the largest differences seen."""
    from radixserve.kernels import triton_ops as tops

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = HEADS
    scale = 1 / math.sqrt(d)
    atol, rtol, lse_atol = TOLERANCES[dtype]
    worst = {"out": 0.0, "lse": 0.0, "cases": 0}
    for case in range(cases):
        root, groups, group_lens, private, q_lens = random_tree(
            rng, max_len, max_requests, extend=case % 2 == 1
        )
        n_req = len(private)
        n_slots = 1 + root + sum(group_lens) + sum(private)
        perm = torch.randperm(n_slots - 1, generator=gen) + 1  # slot 0 is scratch
        kc = torch.randn(n_slots, hkv, d, generator=gen).to(dtype)
        vc = torch.randn(n_slots, hkv, d, generator=gen).to(dtype)
        q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
        runs = list(perm.split([root, *group_lens, *private]))  # scattered over the pool
        root_slots, group_slots, priv_slots = runs[0], runs[1 : 1 + len(groups)], runs[-n_req:]
        group_of = {r: g for g, members in enumerate(groups) for r in members}
        paths = [
            torch.cat([root_slots, group_slots[group_of[r]], priv_slots[r]]) for r in range(n_req)
        ]
        flat_slots = torch.cat(paths)
        path_lens = [p.numel() for p in paths]
        want = reference.private_attention(
            q.float(), kc.float()[flat_slots], vc.float()[flat_slots], q_lens, path_lens, scale
        )
        q_start = offsets(q_lens)
        q_off = torch.tensor(q_start, device=device)
        flat_kv = [torch.tensor(x, device=device) for x in (offsets(path_lens)[:-1], path_lens)]
        priv_kv = [torch.tensor(x, device=device) for x in (offsets(private)[:-1], private)]
        kc, vc, q = kc.to(device), vc.to(device), q.to(device)
        for splits in (1, 4, None):
            flat = tops.pool_private_attention(
                q, kc, vc, flat_slots.to(device), q_off, *flat_kv, scale, splits=splits
            )
            state = tops.pool_segment_attention(
                q, kc, vc, root_slots.to(device), scale, splits=splits
            )
            for g, members in enumerate(groups):
                rows = torch.cat(
                    [torch.arange(q_start[r], q_start[r] + q_lens[r]) for r in members]
                ).to(device)
                prior = state[0].index_select(0, rows), state[1].index_select(0, rows)
                o, s = tops.pool_segment_attention(
                    q.index_select(0, rows), kc, vc, group_slots[g].to(device), scale,
                    prior=prior, splits=splits,
                )  # fmt: skip
                state = state[0].index_copy(0, rows, o), state[1].index_copy(0, rows, s)
            tree = tops.pool_private_attention(
                q, kc, vc, torch.cat(priv_slots).to(device), q_off, *priv_kv, scale,
                prior=state, splits=splits,
            )  # fmt: skip
            for name, (out, lse) in (("flat", flat), ("tree", tree)):
                o_err = (out.float().cpu() - want[0]).abs()
                l_err = (lse.cpu() - want[1]).abs().max().item()
                bound = atol + rtol * want[0].abs()
                assert bool((o_err <= bound).all()), (
                    f"case {case} {name} splits={splits} {dtype}: out off by {o_err.max():.3g}"
                )
                assert l_err <= lse_atol, f"case {case} {name} splits={splits}: lse off {l_err:.3g}"
                worst["out"] = max(worst["out"], o_err.max().item())
                worst["lse"] = max(worst["lse"], l_err)
        worst["cases"] += 1
    return worst


# --------------------------------------------------------------------------- 2. greedy
def reference_prompts() -> list[str]:
    """A few-shot GSM8K prefix (~1.1k tokens) shared by 8 questions."""
    from eval_data import gsm8k  # noqa: PLC0415

    data = str(ROOT.parent / "shared" / "data" / "gsm8k")  # only where the reference is made
    train = gsm8k(data, "train", limit=8)
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train)
    tests = gsm8k(data, "test", limit=8)
    return [shots + f"Question: {r['question']}\nAnswer:" for r in tests]


def greedy_run(engine: Any, prompts: list[str]) -> list[dict[str, Any]]:
    outs = engine.generate(
        prompts,
        {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        top_logprobs_num=2,
    )
    rows = []
    for o in outs:
        tops = o["meta_info"]["output_top_logprobs"]
        gaps = [t[0][0] - t[1][0] for t in tops]
        rows.append({"ids": o["output_ids"], "gaps": gaps})
    return rows


def make_reference() -> None:
    from radixserve.engine.engine import Engine

    prompts = reference_prompts()
    with Engine(None, dtype="float32", quantization="none", attention_backend="flat") as eng:
        rows = greedy_run(eng, prompts)
        lens = [len(eng.tokenizer(p)["input_ids"]) for p in prompts]
    REFERENCE.write_text(
        json.dumps(
            {
                "made_with": "Engine(None, dtype='float32', quantization='none', "
                "attention_backend='flat') on a CPU",
                "prompt_tokens": lens,
                "prompts": prompts,
                "runs": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {REFERENCE}: {len(prompts)} prompts, {lens} tokens")


def compare_greedy(ref: list[dict[str, Any]], got: list[dict[str, Any]], tie: float) -> dict:
    """Per prompt: identical tokens, or the first divergence with the CPU's top-2 gap there."""
    rows = []
    for r, g in zip(ref, got, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(r["ids"], g["ids"])) if a != b), None)
        if same is None:
            rows.append({"identical": len(r["ids"]), "ok": True})
        else:
            gap = r["gaps"][same]
            rows.append({"identical": same, "cpu_gap": gap, "gpu_gap": g["gaps"][same],
                         "ok": gap < tie})  # fmt: skip
    return {"ok": all(x["ok"] for x in rows), "prompts": rows}


def check_greedy(model: str | None) -> dict[str, Any]:
    from radixserve.engine.engine import Engine

    ref = json.loads(REFERENCE.read_text())
    out: dict[str, Any] = {}
    for dtype in ("bfloat16", "float32"):
        for backend in ("tree", "flat"):
            with Engine(model, device="cuda", dtype=dtype, attention_backend=backend,
                        max_total_tokens=65536) as eng:  # fmt: skip
                got = greedy_run(eng, ref["prompts"])
            out[f"{dtype}-{backend}"] = compare_greedy(ref["runs"], got, NEAR_TIE[dtype])
            torch.cuda.empty_cache()
    out["ok"] = all(v["ok"] for v in out.values())
    return out


# --------------------------------------------------------------------------- 3. attention
def device_roofline() -> dict[str, float]:
    """HBM read and copy bandwidth (2 GiB buffers) and the bf16 matmul peak, best of 5."""
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    out = {
        "read_GBps": 2 * x.numel() / gpu_time_s(lambda: x.sum(), 5) / 1e9,
        "copy_GBps": 4 * x.numel() / gpu_time_s(lambda: y.copy_(x), 5) / 1e9,
    }
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    out["bf16_TFLOPs"] = 2 * 8192**3 / gpu_time_s(lambda: a @ a, 5) / 1e12
    props = torch.cuda.get_device_properties(0)
    out["l2_MB"] = props.L2_cache_size / 1e6
    out["multiprocessors"] = props.multi_processor_count
    return out


def gpu_time_s(fn: Callable[[], object], repeats: int) -> float:
    """Best device time of one call (CUDA events), after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def graph_time_s(fn: Callable[[], object], calls: int, repeats: int = 20) -> float:
    """Device time per call of `fn` captured `calls` times in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm-up: compile, allocate
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return gpu_time_s(graph.replay, repeats) / calls


def eager_time_s(fn: Callable[[], object], calls: int = 50) -> float:
    """Wall time per call of `calls` back-to-back eager calls (launch costs included)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def attention_case(batch: int, prefix: int, private: int, roof: dict[str, float]) -> dict:
    from radixserve import kernels

    hq, hkv, d = HEADS
    dev, dt = "cuda", torch.bfloat16
    n_slots = 1 + prefix + batch * private
    kc = torch.randn(n_slots, hkv, d, device=dev, dtype=dt)
    vc = torch.randn(n_slots, hkv, d, device=dev, dtype=dt)
    q = torch.randn(batch, hq, d, device=dev, dtype=dt)
    prefix_slots = torch.arange(1, 1 + prefix, device=dev)
    priv = torch.arange(1 + prefix, n_slots, device=dev).view(batch, private)
    flat_slots = torch.cat([prefix_slots.expand(batch, prefix), priv], 1).flatten()
    q_off = torch.arange(batch + 1, device=dev)
    rows = q_off[:-1]
    flat_kv = rows * (prefix + private), torch.full_like(rows, prefix + private)
    priv_kv = rows * private, torch.full_like(rows, private)
    scale = 1 / math.sqrt(d)

    def flat() -> object:
        return kernels.pool_private_attention(q, kc, vc, flat_slots, q_off, *flat_kv, scale)

    def tree() -> object:
        state = kernels.pool_segment_attention(q, kc, vc, prefix_slots, scale)
        return kernels.pool_private_attention(
            q, kc, vc, priv.flatten(), q_off, *priv_kv, scale, prior=state
        )

    row = 2 * hkv * d * dt.itemsize  # K and V of one token
    qo = 2 * batch * hq * d * dt.itemsize
    bytes_flat = batch * (prefix + private) * row + qo
    bytes_tree = (prefix + batch * private) * row + 2 * qo
    bw = roof["read_GBps"] * 1e9
    out: dict[str, Any] = {"batch": batch, "prefix": prefix, "private": private}
    for name, fn, nbytes in (("flat", flat, bytes_flat), ("tree", tree, bytes_tree)):
        out[f"{name}_graph_us"] = graph_time_s(fn, GRAPH_CALLS) * 1e6
        out[f"{name}_eager_us"] = eager_time_s(fn) * 1e6
        out[f"{name}_bound_us"] = nbytes / bw * 1e6
        out[f"{name}_frac_of_roofline"] = out[f"{name}_bound_us"] / out[f"{name}_graph_us"]
    out["speedup"] = out["flat_graph_us"] / out["tree_graph_us"]
    out["speedup_eager"] = out["flat_eager_us"] / out["tree_eager_us"]
    out["roofline_speedup"] = bytes_flat / bytes_tree
    out["speedup_of_roofline"] = out["speedup"] / out["roofline_speedup"]
    return out


# --------------------------------------------------------------------------- 4. e2e decode
def e2e_radixserve(model: str | None, backend: str, ids: list[int], batch: int, new: int) -> dict:
    from radixserve.engine.engine import Engine

    params = {"temperature": 0, "ignore_eos": True, "n": batch}
    with Engine(model, device=DEVICE, attention_backend=backend,
                max_total_tokens=batch * (len(ids) + new) + 8192) as eng:  # fmt: skip
        times = {}
        for tokens in (1, new, 1, new):  # warm-up pair, then the timed pair
            eng.flush_cache()
            sync()
            t0 = time.perf_counter()
            outs = eng.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": tokens})
            sync()
            times[tokens] = time.perf_counter() - t0
        first = outs[0]["output_ids"]
    decode_s = times[new] - times[1]
    return {"decode_s": decode_s, "step_ms": decode_s / (new - 1) * 1e3,
            "tokens_per_s": batch * (new - 1) / decode_s, "first_sample": first}  # fmt: skip


def hf_model(folder: Path, dtype: torch.dtype) -> Any:
    """HF transformers' model of a converted GGUF folder on the same weights (the GGUF
    dequantized to `dtype` by our reader, under HF names), sdpa attention, on DEVICE."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from radixserve.models.gguf_weights import read_gguf_weights
    from radixserve.models.loader import load_config
    from radixserve.models.resolve import gguf_source

    gguf = gguf_source(folder)
    assert gguf is not None, f"{folder} is not a converted GGUF folder"
    config = AutoConfig.from_pretrained(str(folder))
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    weights, _ = read_gguf_weights(gguf, load_config(folder), dtype, quantized=False)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return hf.to(DEVICE).eval()


def e2e_hf(folder: Path, ids: list[int], batch: int, new: int) -> dict:
    """HF transformers' generate on the same weights in bf16 (hf_model)."""
    hf = hf_model(folder, torch.bfloat16)
    x = torch.tensor([ids] * batch, device=DEVICE)
    times = {}
    with torch.inference_mode():
        for tokens in (1, new, 1, new):
            sync()
            t0 = time.perf_counter()
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, pad_token_id=0)  # fmt: skip
            sync()
            times[tokens] = time.perf_counter() - t0
    decode_s = times[new] - times[1]
    first = out[0, len(ids) :].tolist()
    del hf
    return {"decode_s": decode_s, "step_ms": decode_s / (new - 1) * 1e3,
            "tokens_per_s": batch * (new - 1) / decode_s, "first_sample": first}  # fmt: skip


def e2e_prompt(tokens: int) -> list[int]:
    """The end-to-end section's prompt: `tokens` random ids (seed 0)."""
    rng = random.Random(0)
    return [rng.randrange(100, 49000) for _ in range(tokens)]


def check_e2e(model: str | None, batch: int, prompt: int, new: int) -> dict[str, Any]:
    from radixserve.models.resolve import resolve_model_path

    ids = e2e_prompt(prompt)
    out: dict[str, Any] = {"batch": batch, "prompt": prompt, "new_tokens": new}
    for backend in ("tree", "flat"):
        out[backend] = e2e_radixserve(model, backend, ids, batch, new)
    out["hf"] = e2e_hf(resolve_model_path(model), ids, batch, new)
    out["tree_over_flat"] = out["tree"]["tokens_per_s"] / out["flat"]["tokens_per_s"]
    out["tree_over_hf"] = out["tree"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    for name in ("tree", "flat", "hf"):
        out[f"{name}_same_tokens_as_flat"] = sum(
            1 for _ in _same_prefix(out[name]["first_sample"], out["flat"]["first_sample"])
        )
    return out


def profile_decode(model: str | None, backend: str, batch: int, prompt: int, steps: int) -> dict:
    """Where one decode step's time goes: torch.profiler over `steps` decode steps of the
    e2e workload (after a 1-token run that prefilled and cached the prompt), top ops by
    host time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    from radixserve.engine.engine import Engine

    ids = e2e_prompt(prompt)
    params = {"temperature": 0, "ignore_eos": True, "n": batch}
    with Engine(model, device=DEVICE, attention_backend=backend,
                max_total_tokens=batch * (prompt + steps) + 8192) as eng:  # fmt: skip
        eng.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 2})
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sync()
            t0 = time.perf_counter()
            eng.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": steps})
            sync()
            wall = time.perf_counter() - t0
    table = prof.key_averages()
    return {
        "backend": backend, "steps": steps, "wall_s": wall,
        "by_host": table.table(sort_by="self_cpu_time_total", row_limit=25),
        "by_device": table.table(sort_by="self_device_time_total", row_limit=15),
    }  # fmt: skip


def _same_prefix(a: list[int], b: list[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


# --------------------------------------------------------------------------- driver
def section(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    t0 = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as exc:  # recorded, and the run goes on to the next section
        report[name] = {"error": f"{type(exc).__name__}: {exc}", "ok": False,
                        "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
    report[name + "_s"] = round(time.perf_counter() - t0, 1)
    print(f"[{name}] {report[name + '_s']} s: {json.dumps(report[name], default=str)[:1500]}",
          flush=True)  # fmt: skip


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = report.get("attention", {}).get("cases", [])
    if rows:
        labels = [f"B{r['batch']}\nP{r['prefix']}" for r in rows]
        xs = range(len(rows))
        axes[0].bar([x - 0.2 for x in xs], [r["speedup"] for r in rows], 0.4, label="measured")
        axes[0].bar([x + 0.2 for x in xs], [r["roofline_speedup"] for r in rows], 0.4,
                    label="HBM roofline")  # fmt: skip
        axes[0].set_xticks(list(xs), labels, fontsize=7)
        axes[0].set_yscale("log")
        axes[0].set_ylabel("tree speedup over flat (one layer's decode attention)")
        axes[0].legend()
    e2e = report.get("e2e", {})
    if "tree" in e2e:
        names = ["tree", "flat", "hf"]
        axes[1].bar(names, [e2e[n]["tokens_per_s"] for n in names])
        axes[1].set_ylabel(f"decode tokens/s, B={e2e['batch']} P={e2e['prompt']}")
    fig.suptitle(report["device"]["name"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"))
    ap.add_argument("--model", default=None, help="GGUF file or model folder (default: embedded)")
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--make-reference", action="store_true")
    ap.add_argument("--sections", nargs="+", default=["kernels", "greedy", "attention", "e2e"],
                    choices=["kernels", "greedy", "attention", "e2e", "profile"])  # fmt: skip
    args = ap.parse_args()
    if args.make_reference:
        make_reference()
        return 0
    import triton

    assert torch.cuda.is_available(), "no CUDA device"
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "device": {
            "name": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        },  # fmt: skip
    }
    section(report, "roofline", device_roofline)
    report["device"].update(report["roofline"])
    if "kernels" in args.sections:
        section(report, "kernels", lambda: {
            str(dt).removeprefix("torch."): check_random_trees("cuda", dt, 6 if args.quick else 24,
                                                               2000, seed=1)
            for dt in (torch.bfloat16, torch.float16, torch.float32)
        })  # fmt: skip
    if "greedy" in args.sections:
        section(report, "greedy", lambda: check_greedy(args.model))
    if "attention" in args.sections:
        sizes = [(16, 1024), (64, 4096)] if args.quick else [
            (b, p) for b in (16, 64, 256) for p in (1024, 4096, 16384)]  # fmt: skip
        section(report, "attention", lambda: {"cases": [
            attention_case(b, p, 128, report["roofline"]) for b, p in sizes]})  # fmt: skip
    if "e2e" in args.sections:
        new = 16 if args.quick else 128
        section(report, "e2e", lambda: check_e2e(args.model, 64, 4096, new))
    if "profile" in args.sections:
        for backend in ("tree", "flat"):
            section(report, f"profile_{backend}",
                    lambda b=backend: profile_decode(args.model, b, 64, 4096, 16))  # fmt: skip
            print(report[f"profile_{backend}"].get("by_host", ""))
            print(report[f"profile_{backend}"].get("by_device", ""))
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    try:
        plot(report, args.out / "gpu_check.png")
    except Exception as exc:  # the JSON is the record; a plot failure is reported, not fatal
        print(f"plot failed: {exc}")
    failed = [k for k, v in report.items() if isinstance(v, dict) and v.get("ok") is False]
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
