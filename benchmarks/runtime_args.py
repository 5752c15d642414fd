"""Command-line options shared by the evals that run either in-process or against a server."""

from __future__ import annotations

import argparse


def add_runtime_args(ap: argparse.ArgumentParser) -> None:
    """Where the eval runs (server URL or in-process Engine), how, and where results go."""
    ap.add_argument("--url", default=None, help="a server; default: in-process Engine")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="in-process model (default: embedded)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="in-process KV pool")
    ap.add_argument("--attention-backend", choices=["tree", "flat"], default="tree")
    ap.add_argument("--compare", action="store_true", help="in-process: tree, then flat")
    ap.add_argument("--output-json", default=None)


def check_runtime_args(args: argparse.Namespace) -> None:
    if args.compare and args.url:
        raise SystemExit("--compare builds both engines in-process; drop --url")
