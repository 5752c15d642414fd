"""Figures from benchmark JSON results (matplotlib, Agg: no display needed).

- throughput vs shared-prefix length, one line per backend (tree, flat, hf, none), one panel
  per batch size, from benchmarks/bench_shared_prefix.py's
  {"rows": [{"batch", "prefix", "backend", "decode_tok_s"}, ...]};
- latency vs request rate (TTFT, inter-token and end-to-end p50 / p99), one line per label,
  from several bench_serving.py --output-json files (one per request rate).

    python benchmarks/plot.py --shared-prefix results/shared_prefix.json \\
        --serving results/serving_*.json --out-dir docs/img
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt

BACKEND_STYLE = {  # stable colours and markers across figures
    "tree": ("tab:blue", "o"),
    "flat": ("tab:orange", "s"),
    "hf": ("tab:green", "^"),
    "none": ("tab:gray", "x"),
}
LATENCIES = (
    ("ttft_ms", "time to first token"),
    ("itl_ms", "inter-token"),
    ("e2e_ms", "end to end"),
)


def plot_shared_prefix(rows: list[dict[str, Any]], out: Path) -> Path:
    """Throughput vs shared-prefix length; one panel per batch size. Decode-mode rows carry
    `decode_tok_s`; samples-mode rows (prefill included) carry `tok_s`."""
    assert rows, "no rows to plot"
    key = "decode_tok_s" if all("decode_tok_s" in r for r in rows) else "tok_s"
    ylabel = "decode throughput (tokens/s)" if key == "decode_tok_s" else "tokens/s (with prefill)"
    batches = sorted({int(r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        series: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in rows:
            if int(r["batch"]) == batch:
                series[str(r["backend"])].append((float(r["prefix"]), float(r[key])))
        for backend, points in sorted(series.items()):
            xs, ys = zip(*sorted(points))
            color, marker = BACKEND_STYLE.get(backend, (None, "."))
            ax.plot(xs, ys, marker=marker, color=color, label=backend)
        if all(float(r["prefix"]) > 0 for r in rows):
            ax.set_xscale("log", base=2)
        ax.set_xlabel("shared prefix length (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"batch {batch}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    return _save(fig, out)


def _rate(run: dict[str, Any]) -> float:
    """The offered request rate; an unbounded one (inf) is plotted at the achieved rate."""
    rate = float(run["config"]["request_rate"])
    return float(run["request_throughput"]) if math.isinf(rate) else rate


def plot_latency_vs_rate(runs: list[dict[str, Any]], out: Path) -> Path:
    """p50 (solid) and p99 (dashed) latencies vs request rate; one colour per label
    (config.label, else config.backend)."""
    assert runs, "no serving runs to plot"
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        cfg = run["config"]
        by_label[str(cfg.get("label") or cfg["backend"])].append(run)
    fig, axes = plt.subplots(1, len(LATENCIES), figsize=(4.5 * len(LATENCIES), 3.6))
    for ax, (key, title) in zip(axes, LATENCIES):
        for label, group in sorted(by_label.items()):
            group = sorted(group, key=_rate)
            xs = [_rate(g) for g in group]
            color, marker = BACKEND_STYLE.get(label, (None, "o"))
            p50 = ax.plot(xs, [g[key]["p50"] for g in group], marker=marker, color=color)
            ax.plot(
                xs,
                [g[key]["p99"] for g in group],
                marker=marker,
                linestyle="--",
                color=p50[0].get_color(),
            )
            p50[0].set_label(f"{label} p50 / p99")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    return _save(fig, out)


def _save(fig: Any, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shared-prefix", default=None, help="bench_shared_prefix.py JSON")
    ap.add_argument("--serving", nargs="*", default=[], help="bench_serving.py JSON files")
    ap.add_argument("--out-dir", default="docs/img")
    args = ap.parse_args(argv)
    out_dir = Path(args.out_dir)
    written = []
    if args.shared_prefix:
        rows = json.loads(Path(args.shared_prefix).read_text())["rows"]
        written.append(plot_shared_prefix(rows, out_dir / "throughput_vs_prefix.png"))
    if args.serving:
        runs = [json.loads(Path(p).read_text()) for p in args.serving]
        written.append(plot_latency_vs_rate(runs, out_dir / "latency_vs_rate.png"))
    if not written:
        raise SystemExit("nothing to plot: give --shared-prefix and/or --serving")
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
