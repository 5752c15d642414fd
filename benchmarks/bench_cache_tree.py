"""How long `/cache_tree` takes on a big radix tree: fill a running server's cache with at
least --nodes nodes, then time the endpoint with the web console's limits (and without
filling, on the tree as it is, with --no-fill).

Each fill prompt is [A + i // 100, B + i % 100, C + i]: 100 first-level nodes, each with 100
children, each with its own leaf, so 10,000 prompts give about 10,100 nodes. Start the server
with a KV pool that holds them all (4 tokens each with the 1-token output):

    radixserve serve --max-total-tokens 65536 &
    python benchmarks/bench_cache_tree.py --base-url http://127.0.0.1:30000 --nodes 10000
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

TOKEN_BASE = (1000, 2000, 3000)
FILL_BATCH = 500  # prompts per /generate call


def fill(client: httpx.Client, prompts: int) -> None:
    a, b, c = TOKEN_BASE
    for start in range(0, prompts, FILL_BATCH):
        ids = [
            [a + i // 100, b + i % 100, c + i]
            for i in range(start, min(prompts, start + FILL_BATCH))
        ]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        r = client.post("/generate", json=body, timeout=600)
        r.raise_for_status()


def time_tree(client: httpx.Client, repeats: int, params: dict[str, int]) -> dict[str, float]:
    t0 = time.perf_counter()
    client.get("/cache_tree", params=params).raise_for_status()  # warm-up, reported apart
    first_ms = 1000 * (time.perf_counter() - t0)
    times = []
    view = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        r = client.get("/cache_tree", params=params)
        times.append(time.perf_counter() - t0)
        r.raise_for_status()
        view = r.json()
    times.sort()
    return {
        "total_nodes": view["total_nodes"],
        "nodes_returned": len(view["nodes"]),
        "p50_ms": 1000 * statistics.median(times),
        "p99_ms": 1000 * times[min(len(times) - 1, int(0.99 * len(times)))],
        "max_ms": 1000 * times[-1],
        "first_call_ms": first_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--nodes", type=int, default=10000, help="fill prompts (about one node each)")
    ap.add_argument("--no-fill", action="store_true", help="time the tree as it is")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.base_url, headers=headers, timeout=60) as client:
        if not args.no_fill:
            t0 = time.perf_counter()
            fill(client, args.nodes)
            print(f"filled {args.nodes} prompts in {time.perf_counter() - t0:.1f} s")
        results = {
            "console (300 nodes, depth 16)": time_tree(
                client, args.repeats, {"max_nodes": 300, "max_depth": 16}
            ),
            "largest (2000 nodes, depth 64)": time_tree(
                client, args.repeats, {"max_nodes": 2000, "max_depth": 64}
            ),
        }
    for name, r in results.items():
        print(
            f"{name:32s} tree {r['total_nodes']:6d} nodes, returned {r['nodes_returned']:5d}: "
            f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms "
            f"(first call, untimed above: {r['first_call_ms']:.1f} ms)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
