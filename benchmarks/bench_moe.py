"""A mixture of experts' decode as the batch grows, and its experts' load on a prompt set.

Rows, on one GGUF mixture of experts (`--model`, e.g. `make_gguf.py --shape olmoe-1b-7b`):
- decode B: B samples forked from one `--prompt`-token GSM8K few-shot prompt, `--new-tokens`
  each (temperature 0.7, EOS ignored, drafting off): decode tok/s over all samples,
  B * (N - 1) / (wall - first-token latency). Each step reads the experts its B tokens
  picked, so its bytes grow with the distinct experts a layer reads a step, counted here
  in a second, identical run on the module path (the native layers give its logits bit
  for bit; the router's picks are recorded from moe.route). The weight-read roofline of a
  step is (the file less all experts, and less the token embedding where an output matrix
  is apart from it: a step gathers B of its rows, + the distinct experts' bytes) / the read
  bandwidth measured in the same run.
- load: the first `--questions` GSM8K test questions prefilled; each layer's tokens per
  expert (each token counts k times), summarised as max / mean and the coefficient of
  variation over experts and layers. With random weights the router's picks say nothing of
  a trained model's: this is the load these files put on the kernels, not a real one.

    python benchmarks/bench_moe.py --model models/olmoe-1b-7b-Q4_K_M.gguf \\
        --data-path <gsm8k> --json benchmarks/results/moe_olmoe-1b-7b_<machine>_<date>.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import eval_data
import torch
from bench_vs_llamacpp import cpu_info, prompt_ids
from roofline import measure_read_bandwidth

import radixserve.models.moe as moe
from radixserve import Engine
from radixserve.models.gguf_weights import gguf_metadata, gguf_tensors
from radixserve.models.llama import LlamaDecoderLayer
from radixserve.worker.model_worker import ModelWorker

TEMPERATURE = 0.7


@contextmanager
def recorded_picks() -> Iterator[list[torch.Tensor]]:
    """The expert ids (T, k) of every moe.route call while open, in call order (the module
    path: the caller turns the native layers off)."""
    picks: list[torch.Tensor] = []
    route: Callable[..., tuple[torch.Tensor, torch.Tensor]] = moe.route

    def recording(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = route(*args, **kwargs)
        picks.append(ids.clone())
        return weights, ids

    moe.route = recording
    try:
        yield picks
    finally:
        moe.route = route


def native_layers(engine: Engine, on: bool, saved: list[Any]) -> None:
    """Turn the model's native layers off (saving them) or back on."""
    worker = engine.worker
    assert isinstance(worker, ModelWorker), "the model runs in this process"
    layers = [ly for ly in worker.model.model.layers if isinstance(ly, LlamaDecoderLayer)]
    if not on:
        saved[:] = [layer.native for layer in layers]
    for layer, native in zip(layers, saved):
        layer.native = native if on else None


def generate(engine: Engine, prompt: list[int], b: int, n: int) -> tuple[float, float]:
    """(wall seconds, first-token latency) of B forked samples of N tokens."""
    assert engine.flush_cache(), "radix cache not flushed"
    params = {"max_new_tokens": n, "temperature": TEMPERATURE, "ignore_eos": True, "n": b}
    start = time.perf_counter()
    out = engine.generate(input_ids=prompt, sampling_params=params)
    wall = time.perf_counter() - start
    first = (out if isinstance(out, list) else [out])[0]["meta_info"]["first_token_latency"]
    return wall, first


def expert_bytes(model: Path) -> tuple[int, int]:
    """(all stacked experts' bytes, one expert's bytes in one layer: gate + up + down, with
    their bias rows where they have them)."""
    meta = gguf_metadata(model)
    arch = meta["general.architecture"]
    count, layers = meta[f"{arch}.expert_count"], meta[f"{arch}.block_count"]
    total = sum(int(t.data.nbytes) for t in gguf_tensors(model).tensors if "_exps." in t.name)
    return total, total // (count * layers)


def gathered_bytes(model: Path) -> int:
    """The token embedding's bytes where the file has an output matrix apart from it (a
    step reads only its tokens' rows), else 0 (tied: it is the output, read whole)."""
    tensors = {t.name: t for t in gguf_tensors(model).tensors}
    if "output.weight" not in tensors or "token_embd.weight" not in tensors:
        return 0
    return int(tensors["token_embd.weight"].data.nbytes)


def decode_rows(args: argparse.Namespace, engine: Engine, bandwidth: float) -> list[dict]:
    prompt = prompt_ids(engine.tokenizer, args.prompt, args.data_path)
    experts_total, one_expert = expert_bytes(args.model)
    # every step reads these once
    shared = args.model.stat().st_size - experts_total - gathered_bytes(args.model)
    layers = engine.worker.model_config.num_layers
    generate(engine, prompt, 2, 4)  # warm
    saved: list[Any] = []
    rows = []
    for b in args.batch:
        wall, first = min(generate(engine, prompt, b, args.new_tokens) for _ in range(2))
        rate = b * (args.new_tokens - 1) / (wall - first)
        native_layers(engine, False, saved)
        with recorded_picks() as picks:
            generate(engine, prompt, b, args.new_tokens)
        native_layers(engine, True, saved)
        steps = [ids for ids in picks if ids.shape[0] == b]  # the decode steps' layers
        distinct = sum(int(ids.unique().numel()) for ids in steps) / max(1, len(steps))
        step_bytes = shared + distinct * one_expert * layers
        roof = b * bandwidth / step_bytes
        rows.append({
            "batch": b, "decode_tok_s": rate, "distinct_experts_per_layer_step": distinct,
            "step_bytes": step_bytes, "roofline_tok_s": roof, "of_roofline": rate / roof,
        })  # fmt: skip
        print(f"B={b:3d}  {rate:8.2f} tok/s  {distinct:6.2f} experts a layer-step  "
              f"roofline {roof:8.2f} tok/s ({100 * rate / roof:.0f} %)", flush=True)  # fmt: skip
    return rows


def load_row(args: argparse.Namespace, engine: Engine) -> dict[str, Any]:
    questions = eval_data.gsm8k(args.data_path, "test")[: args.questions]
    config = engine.worker.model_config
    counts = torch.zeros(config.num_layers, config.num_experts, dtype=torch.long)
    saved: list[Any] = []
    native_layers(engine, False, saved)
    with recorded_picks() as picks:
        for q in questions:
            ids = engine.tokenizer.encode(q["question"])
            assert engine.flush_cache()
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
            prefills = [p for p in picks if p.shape[0] == len(ids)]
            for layer, p in enumerate(prefills[-config.num_layers :]):
                counts[layer] += torch.bincount(p.flatten(), minlength=config.num_experts)
            picks.clear()
    native_layers(engine, True, saved)
    per = counts.float()
    mean = per.mean(dim=1, keepdim=True)
    row = {
        "questions": len(questions),
        "tokens": int(counts[0].sum()) // config.num_experts_per_tok,
        "max_over_mean": float((per.max(dim=1).values / mean.squeeze(1)).mean()),
        "coefficient_of_variation": float((per.std(dim=1) / mean.squeeze(1)).mean()),
        "unused_experts_per_layer": float((counts == 0).sum(dim=1).float().mean()),
        "tokens_per_expert": counts.tolist(),
    }
    print(f"load over {row['questions']} questions ({row['tokens']} tokens): max/mean "
          f"{row['max_over_mean']:.2f}, CV {row['coefficient_of_variation']:.2f}, "
          f"{row['unused_experts_per_layer']:.1f} unused a layer (random weights)")  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a GGUF mixture of experts")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--prompt", type=int, default=256, help="tokens of the forked prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--data-path", default=None, help="GSM8K folder (default: synthetic)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bandwidth = measure_read_bandwidth(512 << 20)
    engine = Engine(str(args.model), speculative_algorithm="none")
    print(f"{args.model}: read bandwidth {bandwidth / 1e9:.1f} GB/s")
    res: dict[str, Any] = {
        "cpu": cpu_info(), "model": str(args.model), "threads": args.threads,
        "read_GBps": bandwidth / 1e9, "argv": vars(args) | {"model": str(args.model)},
    }  # fmt: skip
    res["decode"] = decode_rows(args, engine, bandwidth)
    res["load"] = load_row(args, engine) if args.data_path else None
    engine.shutdown()
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
