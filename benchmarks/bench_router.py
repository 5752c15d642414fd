"""Data parallelism behind the router: bench_serving.py against a single worker (all cores),
then `radixserve serve --dp-size 2` (one core each) with `round_robin` and with
`cache_aware`, on a generated-shared-prefix and a multi-turn workload; one JSON of rows, and
a figure with --plot.

    python benchmarks/bench_router.py \\
        --output-json benchmarks/results/router_<cpu>-<isa>_<date>.json --plot docs/img/router.png

Each setup starts fresh (empty caches), is warmed by one unrelated request, and is stopped
after its workloads. Extra flags after `--` go to every `radixserve serve`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_serving
import httpx

SETUPS = ("single", "round_robin", "cache_aware")
STARTUP_S = 900.0


def workloads(args: argparse.Namespace) -> dict[str, list[str]]:
    return {
        "generated-shared-prefix": [
            "--dataset", "generated-shared-prefix",
            "--gsp-groups", str(args.groups), "--gsp-prompts-per-group", str(args.per_group),
            "--gsp-system-prompt-len", str(args.system_len), "--gsp-question-len", "32",
            "--gsp-output-len", "16",
        ],
        "multi-turn": [
            "--dataset", "multi-turn", "--mt-conversations", str(args.conversations),
            "--mt-turns", "4", "--mt-question-len", "96", "--mt-output-len", "24",
        ],
    }  # fmt: skip


def start(setup: str, port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cores = len(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "radixserve", "serve", "--port", str(port), *extra]
    if setup != "single":
        cmd += ["--dp-size", "2", "--router-policy", setup]  # the launcher splits the cores
    env = {**os.environ, "OMP_NUM_THREADS": str(cores)}
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def wait_ready(url: str, proc: subprocess.Popen, setup: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{setup}: exited with {proc.returncode}")
        try:
            if setup == "single":
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return
            else:
                workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
                if len(workers) == 2 and all(w["healthy"] for w in workers):
                    return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise SystemExit(f"{setup}: not ready after {STARTUP_S} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_setup(setup: str, args: argparse.Namespace, extra: list[str]) -> list[dict[str, Any]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(setup, port, extra, Path(args.log))
    rows = []
    try:
        wait_ready(url, proc, setup)
        for name, flags in workloads(args).items():
            out = bench_serving.main(  # each workload from empty caches, after a warm-up
                ["--base-url", url, "--disable-tqdm", "--flush-cache", "--seed", str(args.seed)]
                + flags
            )
            rows.append(
                {
                    "setup": setup,
                    "workload": name,
                    **{k: out[k] for k in ROW_KEYS},
                    "ttft_p50_ms": out["ttft_ms"]["p50"],
                    "ttft_mean_ms": out["ttft_ms"]["mean"],
                    "e2e_p50_ms": out["e2e_ms"]["p50"],
                }
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    return rows


ROW_KEYS = (
    "completed", "failed", "duration_s", "request_throughput", "total_tok_s", "output_tok_s",
    "cache_hit_rate", "prompt_tokens",
)  # fmt: skip


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["workload"] for r in rows})
    metrics = (
        ("cache_hit_rate", "cache hit rate"),
        ("request_throughput", "requests / s"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
    )
    fig, axes = plt.subplots(len(names), len(metrics), figsize=(12, 3.2 * len(names)))
    for i, name in enumerate(names):
        for j, (key, label) in enumerate(metrics):
            ax = axes[i][j] if len(names) > 1 else axes[j]
            values = {r["setup"]: r[key] or 0.0 for r in rows if r["workload"] == name}
            setups = [s for s in SETUPS if s in values]
            ax.bar(setups, [values[s] for s in setups], color=["gray", "tab:orange", "tab:blue"])
            ax.set_title(f"{name}: {label}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", nargs="+", choices=SETUPS, default=list(SETUPS))
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=768)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log", default="bench_router.log")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    rows = [row for setup in args.setups for row in run_setup(setup, args, extra)]
    for r in rows:
        hit = "n/a" if r["cache_hit_rate"] is None else f"{r['cache_hit_rate']:.3f}"
        print(
            f"{r['workload']:24s} {r['setup']:12s} ok {r['completed']:3d} failed {r['failed']}"
            f"  {r['request_throughput']:.2f} req/s  {r['total_tok_s']:.0f} tok/s"
            f"  hit {hit}  TTFT p50 {r['ttft_p50_ms']:.0f} ms"
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    if args.plot:
        plot(rows, Path(args.plot))


if __name__ == "__main__":
    main()
