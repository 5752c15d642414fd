"""radixserve on Ray Serve: the replicas' choice by their own radix trees (`radix_tree`)
against Ray Serve's power-of-two-choices and Ray's `PrefixCacheAffinityRouter`, on the same
replicas and a generated-shared-prefix workload (bench_serving.py's), through Ray Serve's
HTTP proxy: prompt tokens cached, throughput, TTFT p50 / p99; one JSON of rows.

    python benchmarks/bench_ray_router.py --model /path/or/id -- --max-total-tokens 8192

Starts a local cluster on loopback (a head and one node per replica, `--cpus-per-replica`
CPUs each) unless `--address` names one, and ends it with `ray stop --force`. Each router
gets freshly started replicas (empty caches) and one warm-up request. With
`--kill-replica-after S`, the first router runs once more, and S seconds into that run one
replica is killed (Ray starts another): its row counts the requests that failed across it.
Needs the `ray` extra and pyarrow (Ray's prefix router). Flags after `--` go to every
replica's `radixserve serve`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import bench_serving
import httpx

ROUTERS = ("radix_tree", "power_of_two", "prefix_affinity")
HEAD_IP = "127.0.0.2"


def ray_cli(*args: str) -> None:
    subprocess.run([str(Path(sys.executable).with_name("ray")), *args], check=True,
                   capture_output=True, timeout=300)  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_cluster(replicas: int, cpus: float) -> str:
    port = free_port()
    address = f"{HEAD_IP}:{port}"
    ray_cli("start", "--head", "--node-ip-address", HEAD_IP, "--port", str(port),
            "--num-cpus", "0", "--include-dashboard", "false", "--disable-usage-stats")  # fmt: skip
    for i in range(replicas):
        ray_cli("start", "--address", address, "--node-ip-address", f"127.0.0.{3 + i}",
                "--num-cpus", str(math.ceil(cpus)), "--disable-usage-stats")  # fmt: skip
    return address


def kill_one_replica() -> None:
    """Kill one EngineReplica actor, as a crash would (Ray then starts another)."""
    import ray

    # the named actors come from the GCS: no dashboard needed (the state API needs one)
    named = ray.util.list_named_actors(all_namespaces=True)
    victim = next(a["name"] for a in named if "EngineReplica" in a["name"])
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    print(f"killed replica {victim}", flush=True)


def run_router(
    router: str, args: argparse.Namespace, url: str, kill_after_s: float | None = None
) -> dict[str, Any]:
    from ray import serve

    from radixserve.ray.app import RayServeOptions, application

    options = RayServeOptions(
        model=args.model, serve_args=tuple(args.serve_args), num_replicas=args.replicas,
        cpus_per_replica=args.cpus_per_replica, router=router, stats_period_s=0.5,
    )  # fmt: skip
    serve.run(application(options), name=options.name, route_prefix="/")
    httpx.post(url + "/generate", timeout=300, json={
        "text": "warm-up", "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
    flags = [
        "--base-url", url, "--disable-tqdm", "--seed", str(args.seed),
        "--dataset", "generated-shared-prefix", "--gsp-groups", str(args.groups),
        "--gsp-prompts-per-group", str(args.per_group),
        "--gsp-system-prompt-len", str(args.system_len), "--gsp-question-len", "32",
        "--gsp-output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
    ]  # fmt: skip
    killer = threading.Timer(kill_after_s, kill_one_replica) if kill_after_s else None
    if killer:
        killer.start()
    out = bench_serving.main(flags)
    if killer:
        killer.cancel()
    serve.delete(options.name)  # the next router starts from fresh replicas
    return {
        "router": router,
        **{k: out[k] for k in ("completed", "failed", "duration_s", "request_throughput",
                               "output_tok_s", "cache_hit_rate", "prompt_tokens")},
        "ttft_p50_ms": out["ttft_ms"]["p50"],
        "ttft_p99_ms": out["ttft_ms"]["p99"],
        "replica_killed_after_s": kill_after_s,
    }  # fmt: skip


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--routers", nargs="+", choices=ROUTERS, default=list(ROUTERS))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--address", default=None, help="a running cluster (default: start one)")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kill-replica-after", type=float, default=None, metavar="S",
                    help="run the first router again, killing a replica S s into it")  # fmt: skip
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    args.serve_args = extra

    import ray
    from ray import serve

    started = args.address is None
    address = start_cluster(args.replicas, args.cpus_per_replica) if started else args.address
    port = free_port()
    rows = []
    try:
        ray.init(address=address, logging_level="WARNING")
        serve.start(proxy_location="HeadOnly", http_options={"host": HEAD_IP, "port": port})
        for router in args.routers:
            rows.append(run_router(router, args, f"http://{HEAD_IP}:{port}"))
            print(json.dumps(rows[-1]), flush=True)
        if args.kill_replica_after:
            url = f"http://{HEAD_IP}:{port}"
            rows.append(run_router(args.routers[0], args, url, args.kill_replica_after))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        if started:
            ray_cli("stop", "--force")
    report(rows, args)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    base = {r["router"]: r for r in rows if not r["replica_killed_after_s"]}
    head = ("router", "cached", "req/s", "tok/s", "TTFT p50", "p99", "failed")
    print(f"{head[0]:<16}" + "".join(f"{h:>9}" for h in head[1:]))
    for r in rows:
        name = r["router"] + (" (kill)" if r["replica_killed_after_s"] else "")
        print(f"{name:<16}{r['cache_hit_rate']:>9.1%}{r['request_throughput']:>9.2f}"
              f"{r['output_tok_s']:>9.1f}{r['ttft_p50_ms']:>9.0f}{r['ttft_p99_ms']:>9.0f}"
              f"{r['failed']:>9}")  # fmt: skip
    ours = base.get("radix_tree")
    for peer in ("power_of_two", "prefix_affinity"):
        if ours and peer in base:
            ratio = ours["request_throughput"] / max(base[peer]["request_throughput"], 1e-9)
            print(f"radix_tree / {peer} throughput: {ratio:.2f}x")
    machine = platform.node() or "machine"
    date = datetime.date.today().isoformat()
    out = Path(args.output_json or f"benchmarks/results/ray_router_{machine}_{date}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "output_json"}
    out.write_text(json.dumps({"config": config, "date": date, "time": time.time(),
                               "rows": rows}, indent=1))  # fmt: skip
    print("wrote", out)


if __name__ == "__main__":
    main()
