"""Command line: `radixserve serve [flags]` (also `python -m radixserve serve ...`),
`radixserve router --worker-urls URL... [flags]` and `radixserve ray serve [flags]`.

The serve flags are generated from `EngineConfig`'s fields, and the router's from
`RouterConfig`'s, one flag per field (`max_total_tokens` -> `--max-total-tokens`; a bool
field also gets `--no-...`), so the two can never drift apart. Defaults are the fields'
(some come from environment variables: see radixserve/config.py). `serve --dp-size N`
starts N workers with the serve flags and a router in front on --host / --port.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

from radixserve.config import (
    ATTENTION_BACKENDS,
    ATTENTION_KERNELS,
    DTYPE_CHOICES,
    GRAMMAR_BACKENDS,
    HICACHE_REMOTE_ENV,
    HICACHE_SECRET_ENV,
    PACKED_LINEAR,
    POLICIES,
    QUANT_ACTIVATIONS,
    QUANTIZATIONS,
    SECRET_FIELDS,
    SPECULATIVE_ALGORITHMS,
    EngineConfig,
)
from radixserve.keys import ADMIN_API_KEY_ENV, API_KEY_ENV, CACHE_ISOLATION
from radixserve.router.config import ROUTING_POLICIES, RouterConfig

HELP = {
    "model": "HF checkpoint folder, .gguf file or hub id (Llama, Qwen2, Mistral, Qwen3, "
    "Gemma 2 and 3, Phi-3 / Phi-4-mini, SmolLM3, Qwen3-MoE, OLMoE, Mixtral, gpt-oss); "
    "default: the embedded SmolLM2-135M-Instruct",
    "revision": "branch, tag or commit of a hub id (default: main)",
    "served_model_name": "model name in /v1/models and responses (default: --model as given)",
    "dtype": "compute dtype; auto: bfloat16 where bf16 is fast here, else float32 (float32 "
    "for a GGUF whose every matrix takes int8 x, e.g. Q4_K_M)",
    "quantization": "auto: a GGUF model's Q4_0/Q4_1/Q8_0 weights run quantized; none; int8",
    "quant_activations": "Q4_K and Q6_K weights' x rounded to int8 (llama.cpp's rounding, "
    "faster) or int16 (16-64x finer); other formats' x is int16",
    "kv_cache_dtype": "KV cache storage dtype; auto: float16 under quantized weights on a CPU "
    "(native attention kernels convert on load), else the compute dtype",
    "device": "torch device of the model worker (cpu, cuda)",
    "max_total_tokens": "KV pool size in tokens (default: from --mem-fraction)",
    "max_swa_tokens": "tokens whose sliding-window layers' K/V the pool holds at once, for "
    "models with such layers (default: --max-total-tokens when given, else half the tokens "
    "the budget holds at every layer's cost, the full layers taking the rest)",
    "mem_fraction": "fraction of free memory for the KV pool when --max-total-tokens is unset",
    "chunked_prefill_size": "most prompt tokens of one request per prefill step",
    "max_prefill_tokens": "most new tokens of one extend batch",
    "max_running_requests": "most samples decoding at once",
    "max_queued_requests": "most waiting samples (n counts n); beyond, HTTP 503 + Retry-After",
    "max_queued_tokens": "most prompt tokens waiting; beyond, HTTP 503 (default: 4x the KV pool)",
    "max_connections": "most HTTP connections at once; beyond, uvicorn answers 503 "
    "(default: max running + max queued + 64)",
    "schedule_policy": "waiting-queue order: lpm (longest prefix match) or fcfs",
    "disable_radix_cache": "do not reuse KV across requests",
    "hicache_size": "GB of host memory keeping K/V evicted from the pool (0: off)",
    "hicache_dir": "directory keeping K/V pushed out of the host tier (needs --hicache-size)",
    "hicache_disk_size": "GB of chunk files kept in --hicache-dir",
    "hicache_remote": "redis://host:port shared by servers of the same model: K/V is written "
    "through and read back from it (default: $RADIXSERVE_HICACHE_REMOTE; prefer the variable "
    "to the flag for a URL with a password)",
    "hicache_secret": "key of the MAC (or the seal) on every K/V record in the disk and Redis "
    "tiers: servers share K/V only with the same key (default: $RADIXSERVE_HICACHE_SECRET, "
    "else random per process: nothing shared across servers or restarts); prefer the "
    "variable to the flag",
    "hicache_encrypt": "seal every K/V record of the disk and Redis tiers with AES-256-GCM "
    "under keys derived from the tiers' secret, so their tokens and rows are unreadable "
    "without it; needs the cryptography package (default: $RADIXSERVE_HICACHE_ENCRYPT=0/1, "
    "else off)",
    "hicache_remote_ttl": "seconds a chunk stays in the remote tier (default: one day)",
    "hicache_ttl": "seconds a conversation's K/V stays in the host and disk tiers after it was "
    "last used (default: until evicted)",
    "hicache_layerwise": "load a lower-tier hit into the pool layer by layer on a loader "
    "thread while the step computes (off: all layers before the step starts)",
    "hicache_reposition": "approximate, off by default: reuse a prompt's run of 16+ tokens "
    "cached at another position (a truncated conversation's kept turns), its keys rotated "
    "to the new position, instead of recomputing it",
    "hicache_prefetch_window": "waiting samples (next to be admitted) whose K/V is pulled up "
    "the tiers before admission and spared by eviction (0: off)",
    "attention_backend": "tree (shared-prefix Hydragen attention) or flat (per request)",
    "grammar_backend": "constrained decoding (regex, json_schema, ebnf): llguidance (default), "
    "xgrammar (the radixserve[xgrammar] extra) or outlines (regex and json_schema only)",
    "speculative_algorithm": "speculative decoding: auto (default: a draft from the radix "
    "cache, else from the sample's own prompt and output), radix, ngram, draft-model (radix, "
    "else --speculative-draft-model-path), or none",
    "speculative_draft_model_path": "a smaller model of the same vocabulary that drafts "
    "(a folder, file or name as for --model), with --speculative-algorithm draft-model",
    "speculative_num_draft_tokens": "most draft tokens a sample verifies per step",
    "speculative_topk": "most branches under one token of a draft tree (1: chains); for a "
    "draft model, the likeliest tokens it proposes at each step (SGLang's "
    "--speculative-eagle-topk)",
    "attention_kernels": "attention ops under the backend: auto (triton on CUDA, native C++ "
    "on an AVX2 CPU, else cpu), native, cpu (torch), reference (readable torch), triton",
    "native_ops": "our C++ CPU kernels (RMSNorm/RoPE, quantized matmuls, sampling, attention); "
    "off: the same math as torch ops; RADIXSERVE_NATIVE_OPS=0/1 sets the default",
    "packed_linear": "oneDNN pre-packed bf16 weights: auto (where supported), on, off; "
    "RADIXSERVE_PACKED_LINEAR=1/0 sets the default (else auto)",
    "tp_size": "tensor-parallel ranks (processes); must divide the model's heads and KV heads",
    "threads": "CPU threads of each model process (default: $OMP_NUM_THREADS, else one per "
    "physical core available, split between TP ranks); a process the server starts is pinned "
    "one thread per core (OMP_PROC_BIND / OMP_PLACES, unless set)",
    "random_seed": "seed of the sampling generator of requests without a seed",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require 'Authorization: Bearer <key>' on every route but /health; its "
    "holders are the tenant 'default'",
    "admin_api_key": "the key of every route, admin ones included (flush, abort_all, schemas, "
    "server info, every tenant's cache tree and metrics)",
    "api_keys_file": "file of 'KEY TENANT' lines (# comments): inference keys of several "
    "tenants, each stopping and seeing only its own requests (keys of 16+ characters; "
    "default: $RADIXSERVE_API_KEYS_FILE)",
    "cache_isolation": "none: requests share cached K/V (a request's cache_salt still "
    "separates it); tenant: no cached K/V, tier record or radix draft is shared across "
    "tenants",
    "allow_unauthenticated": "listen on an address other than loopback with no API key "
    "(refused otherwise)",
    "web_ui": "serve the web console at / (chat playground, live radix tree, plots)",
    "log_level": "debug, info, warning or error",
}
ALIASES = {"model": ("--model-path",)}  # SGLang's name for it
ROUTER_HELP = {
    "worker_urls": "the workers' base URLs (http://host:port); more join with POST /workers",
    "policy": "cache_aware (longest cached prefix, balanced by load), round_robin, random "
    "or least_load",
    "cache_threshold": "cache_aware: route by prefix when the best match covers more than "
    "this fraction of the prompt",
    "balance_abs_threshold": "cache_aware: loads are unbalanced when max - min exceeds this "
    "(and max exceeds --balance-rel-threshold x min): then the least loaded worker",
    "balance_rel_threshold": "cache_aware: see --balance-abs-threshold",
    "tree_budget_chars": "cache_aware: characters of prompts remembered per worker (least "
    "recently sent pruned)",
    "health_interval_s": "seconds between health checks (and load refreshes from /metrics)",
    "health_timeout_s": "seconds a health check (or a connect) may take",
    "health_failures": "failed checks in a row that take a worker out",
    "max_attempts": "workers one request is tried on before 503",
    "api_key": "require 'Authorization: Bearer <key>' on every route but /health, and send "
    "it to the workers",
    "admin_api_key": "the key of every route (the workers' admin key: /metrics is read with it)",
    "api_keys_file": "inference keys of several tenants, as the workers' --api-keys-file",
    "cache_isolation": "tenant: route by tenant and prompt (the workers' --cache-isolation)",
    "sessions": "X-Session-ID values remembered (least recently used forgotten)",
    "allow_unauthenticated": "listen on an address other than loopback with no API key "
    "(refused otherwise)",
    "host": "address to listen on",
    "port": "port to listen on",
    "log_level": "debug, info, warning or error",
}
CHOICES: dict[str, Sequence[str]] = {
    "dtype": DTYPE_CHOICES,
    "kv_cache_dtype": DTYPE_CHOICES,
    "quantization": QUANTIZATIONS,
    "quant_activations": QUANT_ACTIVATIONS,
    "schedule_policy": POLICIES,
    "attention_backend": ATTENTION_BACKENDS,
    "attention_kernels": ATTENTION_KERNELS,
    "grammar_backend": GRAMMAR_BACKENDS,
    "speculative_algorithm": SPECULATIVE_ALGORITHMS,
    "cache_isolation": CACHE_ISOLATION,
    "packed_linear": PACKED_LINEAR,
    "log_level": ("debug", "info", "warning", "error"),
}


def _add_config_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    helps: dict[str, str],
    choices: dict[str, Sequence[str]],
) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flags = ("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ()))
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=f.default,
                help=helps.get(f.name),
            )  # fmt: skip
            continue
        if typing.get_origin(kind) is tuple:  # tuple[str, ...]: a list of values
            item = typing.get_args(kind)[0]
            parser.add_argument(*flags, type=item, nargs="*", default=[], help=helps.get(f.name))
            continue
        base = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
        parser.add_argument(
            *flags,
            type=base,
            default=f.default,
            choices=choices.get(f.name),
            help=helps.get(f.name),
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server (SGLang-native and OpenAI APIs)")
    _add_config_flags(serve, EngineConfig, HELP, CHOICES)
    serve.add_argument(
        "--dp-size", type=int, default=1,
        help="data parallel: N workers on this machine (CPU cores split between them) "
        "behind a router on --host/--port",
    )  # fmt: skip
    serve.add_argument(
        "--router-policy", default="cache_aware", choices=ROUTING_POLICIES,
        help="with --dp-size > 1: the router's policy",
    )  # fmt: skip
    router = sub.add_parser("router", help="route requests across workers (cache-aware)")
    choices: dict[str, Sequence[str]] = {
        "policy": ROUTING_POLICIES,
        "cache_isolation": CACHE_ISOLATION,
    }
    _add_config_flags(router, RouterConfig, ROUTER_HELP, choices)
    _add_ray_parser(sub)
    return parser


def _add_ray_parser(sub: Any) -> None:
    """`radixserve ray serve`: the replicas on Ray Serve (radixserve/ray/, needs the `ray`
    extra). Flags after `--` go to every replica's `radixserve serve`."""
    ray = sub.add_parser("ray", help="serve on a Ray cluster (pip install 'radixserve[ray]')")
    serve = ray.add_subparsers(dest="ray_command", required=True).add_parser(
        "serve", help="deploy the replicas and the ingress with Ray Serve; serve until stopped"
    )
    add = serve.add_argument
    add("--model", default=None, help=HELP["model"])
    add("--revision", default=None, help=HELP["revision"])
    add("--num-replicas", type=int, default=1, help="replicas (the minimum with --max-replicas)")
    add("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")
    add("--upscale-delay-s", type=float, default=30.0, help="autoscaling: queues long this long")
    add(
        "--downscale-delay-s", type=float, default=600.0, help="autoscaling: queues short this long"
    )
    add("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves per replica")
    add("--router", default="radix_tree", choices=("radix_tree", "power_of_two", "prefix_affinity"),
        help="radix_tree: by the replicas' own radix trees; the others are Ray's")  # fmt: skip
    add("--address", default=None, help="Ray cluster address (default: the running one, or local)")
    add("--host", default="127.0.0.1", help="where Ray Serve's HTTP proxy listens")
    add("--port", type=int, default=8000)
    add("serve_args", nargs="*", help="after --: more `radixserve serve` flags for each replica")


def _run_ray(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        from radixserve.ray.app import RayServeOptions
        from radixserve.ray.launcher import run_ray_serve
    except ImportError as e:
        parser.error(f"ray serve needs Ray Serve: pip install 'radixserve[ray]' ({e})")
    options = _config_or_exit(parser, lambda: RayServeOptions(
        model=args.model, revision=args.revision, serve_args=tuple(args.serve_args),
        num_replicas=args.num_replicas, max_replicas=args.max_replicas,
        upscale_delay_s=args.upscale_delay_s, downscale_delay_s=args.downscale_delay_s,
        cpus_per_replica=args.cpus_per_replica, router=args.router,
    ))  # fmt: skip
    return run_ray_serve(options, args.address, args.host, args.port)


def _config_or_exit(parser: argparse.ArgumentParser, build: Callable[[], Any]) -> Any:
    try:
        return build()
    except ValueError as e:
        parser.error(str(e))


def _config(cls: type, args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return _config_or_exit(parser, lambda: cls(**values))


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    config: EngineConfig = _config(EngineConfig, args, parser)
    return config


def worker_argv(config: EngineConfig, rank: int | None = None) -> list[str]:
    """`serve` flags that rebuild `config` but its secrets and the Redis tier's URL (they go
    by environment, `main`) and where it listens (the workers serve the router on
    loopback), those differing from the defaults only. Worker `rank` gets its own disk tier
    folder under --hicache-dir."""
    argv = []
    where = ("host", "port", "allowed_hosts", "allow_unauthenticated")
    skip = (*where, "hicache_remote", *SECRET_FIELDS)
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if f.name == "hicache_dir" and value is not None and rank is not None:
            value = os.path.join(value, f"worker-{rank}")
        if f.name in skip or value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def worker_env(config: EngineConfig) -> dict[str, str]:
    """The secrets `worker_argv` leaves out, as the environment variables a worker reads."""
    secrets = {
        HICACHE_SECRET_ENV: config.hicache_secret,
        HICACHE_REMOTE_ENV: config.hicache_remote,
        API_KEY_ENV: config.api_key,
        ADMIN_API_KEY_ENV: config.admin_api_key,
    }
    return {env: value for env, value in secrets.items() if value is not None}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "ray":
        return _run_ray(args, parser)
    if args.command == "router":
        from radixserve.router.launcher import run_router

        return run_router(_config(RouterConfig, args, parser))
    if args.command == "serve" and args.dp_size > 1:
        from radixserve.router.launcher import run_data_parallel

        config = config_from_args(args, parser)
        os.environ.update(worker_env(config))  # the workers inherit them
        router = _config_or_exit(parser, lambda: RouterConfig(
            host=config.host, port=config.port, policy=args.router_policy,
            allowed_hosts=config.allowed_hosts, log_level=config.log_level,
            allow_unauthenticated=config.allow_unauthenticated,
            api_keys_file=config.api_keys_file, cache_isolation=config.cache_isolation,
        ))  # fmt: skip
        return run_data_parallel([worker_argv(config, r) for r in range(args.dp_size)], router)
    if args.command == "serve":
        if args.dp_size < 1:
            parser.error(f"--dp-size must be at least 1, not {args.dp_size}")
        config = config_from_args(args, parser)
        from radixserve.server.launcher import launch_server  # heavy imports only when serving

        return launch_server(config)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
