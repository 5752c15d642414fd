"""Command line: `radixserve serve [flags]` (also `python -m radixserve serve ...`).

The serve flags are generated from `EngineConfig`'s fields, one flag per field
(`max_total_tokens` -> `--max-total-tokens`; a bool field also gets `--no-...`), so the two
can never drift apart. Defaults are the fields' (some come from environment variables: see
radixserve/config.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from collections.abc import Sequence

from radixserve.config import (
    ATTENTION_BACKENDS,
    ATTENTION_KERNELS,
    DTYPE_CHOICES,
    GRAMMAR_BACKENDS,
    PACKED_LINEAR,
    POLICIES,
    QUANTIZATIONS,
    EngineConfig,
)

HELP = {
    "model": "HF checkpoint folder, .gguf file or hub id (Llama/Qwen2/Mistral); "
    "default: the embedded SmolLM2-135M-Instruct",
    "revision": "branch, tag or commit of a hub id (default: main)",
    "served_model_name": "model name in /v1/models and responses (default: --model as given)",
    "dtype": "compute dtype; auto: bfloat16 where bf16 is fast here, else float32",
    "quantization": "auto: a GGUF model's Q4_0/Q4_1/Q8_0 weights run quantized; none; int8",
    "kv_cache_dtype": "KV cache storage dtype; auto: float16 under quantized weights on a CPU "
    "(native attention kernels convert on load), else the compute dtype",
    "device": "torch device of the model worker (cpu, cuda)",
    "max_total_tokens": "KV pool size in tokens (default: from --mem-fraction)",
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
    "through and read back from it",
    "hicache_remote_ttl": "seconds a chunk stays in the remote tier (default: until evicted)",
    "attention_backend": "tree (shared-prefix Hydragen attention) or flat (per request)",
    "grammar_backend": "constrained decoding (regex, json_schema, ebnf): llguidance (default), "
    "xgrammar (the radixserve[xgrammar] extra) or outlines (regex and json_schema only)",
    "attention_kernels": "attention ops under the backend: auto (triton on CUDA, native C++ "
    "on an AVX2 CPU, else cpu), native, cpu (torch), reference (readable torch), triton",
    "native_ops": "our C++ CPU kernels (RMSNorm/RoPE, quantized matmuls, sampling, attention); "
    "off: the same math as torch ops; RADIXSERVE_NATIVE_OPS=0/1 sets the default",
    "packed_linear": "oneDNN pre-packed bf16 weights: auto (where supported), on, off; "
    "RADIXSERVE_PACKED_LINEAR=1/0 sets the default (else auto)",
    "tp_size": "tensor-parallel ranks (processes); must divide the model's heads and KV heads",
    "random_seed": "seed of the sampling generator of requests without a seed",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require 'Authorization: Bearer <key>' on every route but /health",
    "web_ui": "serve the web console at / (chat playground, live radix tree, plots)",
    "log_level": "debug, info, warning or error",
}
ALIASES = {"model": ("--model-path",)}  # SGLang's name for it
CHOICES: dict[str, Sequence[str]] = {
    "dtype": DTYPE_CHOICES,
    "kv_cache_dtype": DTYPE_CHOICES,
    "quantization": QUANTIZATIONS,
    "schedule_policy": POLICIES,
    "attention_backend": ATTENTION_BACKENDS,
    "attention_kernels": ATTENTION_KERNELS,
    "grammar_backend": GRAMMAR_BACKENDS,
    "packed_linear": PACKED_LINEAR,
    "log_level": ("debug", "info", "warning", "error"),
}


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flags = ("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ()))
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(
                *flags, action=argparse.BooleanOptionalAction, default=f.default,
                help=HELP.get(f.name),
            )  # fmt: skip
            continue
        base = next(t for t in typing.get_args(kind) or (kind,) if t is not type(None))
        parser.add_argument(
            *flags,
            type=base,
            default=f.default,
            choices=CHOICES.get(f.name),
            help=HELP.get(f.name),
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP server (SGLang-native and OpenAI APIs)")
    _add_config_flags(serve)
    return parser


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    try:
        config = EngineConfig(**values)
    except ValueError as e:
        parser.error(str(e))
    return config


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        config = config_from_args(args, parser)
        from radixserve.server.launcher import launch_server  # heavy imports only when serving

        return launch_server(config)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
