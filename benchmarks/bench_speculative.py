"""Speculative decoding: batch-1 decode with and without drafts on workloads that repeat
text nobody tuned for, and one that repeats nothing; the same greedy tokens either way.

Workloads (greedy, chat template of the model, one request at a time but in
code-edit-batch):
- code-edit: a HumanEval prompt with its canonical solution, "rewrite it with <first
  parameter> renamed to x";
- quote: a ShareGPT answer as a document, "quote its first paragraph exactly";
- multi-turn: a ShareGPT first turn, the model's answer, then "repeat your answer, adding a
  title line" (the answer is in the prompt);
- sharegpt: ShareGPT first turns alone (nothing to copy: no regression allowed);
- repeat: the code-edit requests sent again (the radix cache holds every answer: the
  engine ran them just before, untimed);
- dated: the ShareGPT first turns under a system prompt that names today's date, the engine
  having run each just before under yesterday's (untimed): the cache holds the earlier
  answer under another prefix, so only the suffix lookup finds it;
- code-edit-batch: the code-edit requests decoding together (a batch of --requests);
- gsm8k-sc: GSM8K self-consistency, 8-shot, 16 samples of each question decoding together
  (temperature 0.7, seeded: the same tokens with or without drafts), half as many
  questions as --requests.

For each workload both engines (`speculative_algorithm` "none" and the default "auto", or
"draft-model" with --draft-model) run
the same requests, --repeats times each, taking turns (each rate is an engine's best run:
this VM's speed moves within a minute). tokens/s = output tokens / wall time (prefill
included, the cache flushed before each request); decode tokens/s the same
for the steps after every sample's first token (the prefills left out). Also whether every
run gave the same tokens (draft counts are the first run's). Prints a table, writes JSON and
a bar plot.

    python benchmarks/bench_speculative.py --requests 6 --max-new-tokens 192 \\
        --json benchmarks/results/speculative.json
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import time
from pathlib import Path
from typing import Any

import eval_data
import torch
from eval_gsm8k import STOP, few_shot_prompt

from radixserve import Engine
from radixserve.models.resolve import embedded_gguf
from radixserve.tokenizer.chat import render_chat

Messages = list[dict[str, str]]
SC_SAMPLES = 16  # samples of each GSM8K question in the self-consistency workload
LOOKUP_WORKLOADS = ("code-edit", "quote", "multi-turn", "sharegpt")  # llama.cpp's cases
EARLIER = {"repeat": "code-edit", "dated": "dated-earlier"}  # what the cache saw just before
WORKLOADS = (
    "code-edit",
    "quote",
    "multi-turn",
    "sharegpt",
    "repeat",
    "dated",
    "code-edit-batch",
    "gsm8k-sc",
)


def code_edit(n: int) -> list[Messages]:
    out = []
    for row in eval_data.humaneval(None, n):
        code = row["prompt"] + row["canonical_solution"]
        match = re.search(rf"def {row['entry_point']}\((\w+)", code)
        name = match.group(1) if match else row["entry_point"]
        ask = f"Rewrite this function with the parameter `{name}` renamed to `x`:\n\n{code}"
        out.append([{"role": "user", "content": ask}])
    return out


def _answers(n: int, skip: int = 0) -> list[tuple[str, str]]:
    """(first human turn, first gpt answer) of ShareGPT conversations in order, answers
    of 400-2000 characters."""
    out = []
    for conv in eval_data.sharegpt(None)[skip:]:
        turns = conv["conversations"]
        if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt":
            if 400 <= len(turns[1]["value"]) <= 2000 and len(turns[0]["value"]) < 1500:
                out.append((turns[0]["value"], turns[1]["value"]))
        if len(out) == n:
            return out
    return out


def quote(n: int) -> list[Messages]:
    ask = "Quote the first paragraph of the text above exactly."
    return [[{"role": "user", "content": f"{doc}\n\n{ask}"}] for _, doc in _answers(n)]


def multi_turn(n: int) -> list[Messages]:
    return [
        [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Repeat your answer word for word, with a title line."},
        ]
        for question, answer in _answers(n, skip=500)
    ]


def sharegpt_first_turns(n: int) -> list[Messages]:
    return [[{"role": "user", "content": q}] for q, _ in _answers(n, skip=1000)]


def dated(n: int, day: str) -> list[Messages]:
    system = {"role": "system", "content": f"You are a helpful assistant. Today is {day}."}
    return [[system, *turns] for turns in sharegpt_first_turns(n)]


def gsm8k_self_consistency(data_path: str | None, n: int) -> list[str]:
    """8-shot GSM8K prompts of the first n test questions (each sampled SC_SAMPLES times)."""
    shots = few_shot_prompt(eval_data.gsm8k(data_path, "train", 8), 8)
    return [
        f"{shots}Question: {r['question']}\nAnswer:" for r in eval_data.gsm8k(data_path, "test", n)
    ]


def run(
    engine: Engine,
    prompts: list[Any],
    params: dict[str, Any],
    earlier: list[Any] | None = None,
) -> dict[str, Any]:
    """Each prompt alone (its samples together; a prompt may be a batch of prompts), the
    cache flushed before it; seed i for prompt i where params sample. `earlier[i]`, when
    given, is run untimed between the flush and prompt i: the request the cache has seen."""
    outputs, seconds, decode_seconds, drafted, accepted = [], 0.0, 0.0, 0, 0
    for i, ids in enumerate(prompts):
        engine.flush_cache()
        if earlier is not None:
            engine.generate(input_ids=earlier[i], sampling_params={**params, "seed": i})
        before = engine.scheduler.stats()
        t = time.perf_counter()
        out = engine.generate(input_ids=ids, sampling_params={**params, "seed": i})
        wall = time.perf_counter() - t
        after = engine.scheduler.stats()
        samples = out if isinstance(out, list) else [out]
        seconds += wall
        decode_seconds += wall - max(o["meta_info"]["first_token_latency"] for o in samples)
        outputs.extend(o["output_ids"] for o in samples)
        drafted += after.draft_tokens_total - before.draft_tokens_total
        accepted += after.accepted_draft_tokens_total - before.accepted_draft_tokens_total
    tokens = sum(map(len, outputs))
    return {
        "outputs": outputs,
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        # the steps after every sample's first token: the prefills left out
        "decode_tokens_per_s": (tokens - len(outputs)) / decode_seconds,
        "draft_tokens": drafted,
        "accepted_draft_tokens": accepted,
    }


def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs of one engine as one: each rate at its best run, the rest of the first."""
    return {
        **runs[0],
        "tokens_per_s": max(r["tokens_per_s"] for r in runs),
        "decode_tokens_per_s": max(r["decode_tokens_per_s"] for r in runs),
    }


def llamacpp_runs(path: str, prompts: list[list[int]], max_new: int) -> dict[str, dict[str, Any]]:
    """llama.cpp (llama-cpp-python, the bench extra) on the same GGUF, greedy, each prompt
    alone, plain and with its prompt-lookup decoding (LlamaPromptLookupDecoding: the tokens
    after the latest earlier match of the last 1-2 tokens, 8 at most, as radixserve's cap)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    runs = {}
    for name, draft in (("plain", None), ("lookup", LlamaPromptLookupDecoding(num_pred_tokens=8))):
        llm = Llama(model_path=path, n_ctx=4096, draft_model=draft, logits_all=True, verbose=False)
        eos = llm.token_eos()
        seconds, decode_seconds, tokens = 0.0, 0.0, 0
        for ids in prompts:
            t = time.perf_counter()
            first, n = 0.0, 0
            for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
                first, n = first or time.perf_counter(), n + 1
                if token == eos or n >= max_new:
                    break
            end = time.perf_counter()
            seconds, decode_seconds, tokens = (
                seconds + end - t,
                decode_seconds + end - first,
                tokens + n,
            )
        runs[name] = {
            "tokens_per_s": tokens / seconds,
            "decode_tokens_per_s": (tokens - len(prompts)) / decode_seconds,
        }
        del llm
    return runs


def workload_prompts(tok: Any, n: int, gsm8k: str | None) -> dict[str, list[Any]]:
    """Each workload's prompts as token ids (code-edit-batch: one batch of them)."""
    edits = code_edit(n)
    chats = {
        "code-edit": edits,
        "quote": quote(n),
        "multi-turn": multi_turn(n),
        "sharegpt": sharegpt_first_turns(n),
        "repeat": edits,
        "dated": dated(n, "2026-11-29"),
        "dated-earlier": dated(n, "2026-11-28"),
    }
    out: dict[str, list[Any]] = {k: [render_chat(tok, m) for m in c] for k, c in chats.items()}
    out["code-edit-batch"] = [out["code-edit"]]  # all at once
    out["gsm8k-sc"] = [tok.encode(p) for p in gsm8k_self_consistency(gsm8k, max(1, n // 2))]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--dtype", default="auto", help="the engines' dtype (default: auto)")
    ap.add_argument(
        "--quantization", default="auto", help="the engines' quantization (default: auto)"
    )
    ap.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="the speculating engine drafts with this model (draft-model) instead of auto",
    )
    ap.add_argument("--device", default="cpu", help="the engines' device (default: cpu)")
    ap.add_argument(
        "--save-prompts", type=Path, default=None, help="write every workload's token ids here"
    )
    ap.add_argument("--prompts", type=Path, default=None, help="take them from such a file instead")
    ap.add_argument("--requests", type=int, default=6, help="requests per workload")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="the speculating engine's (default: its default)",
    )
    ap.add_argument(
        "--chains",
        action="store_true",
        help="also the speculating engine with --speculative-topk 1 (chains, no trees)",
    )
    ap.add_argument(
        "--gsm8k", default=None, metavar="PATH", help="GSM8K folder or jsonl (default: download)"
    )
    ap.add_argument(
        "--llamacpp",
        action="store_true",
        help="also llama.cpp on the same GGUF, plain and with prompt lookup (greedy workloads)",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs of each engine, taking turns (best kept)"
    )
    ap.add_argument(
        "--workloads", nargs="+", default=None, choices=WORKLOADS, help="default: all of them"
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)

    draft = (
        {}
        if args.num_draft_tokens is None
        else {"speculative_num_draft_tokens": args.num_draft_tokens}
    )
    common = {"dtype": args.dtype, "device": args.device, "quantization": args.quantization}
    if args.draft_model:
        draft.update(
            speculative_algorithm="draft-model", speculative_draft_model_path=args.draft_model
        )
    algorithm = draft.get("speculative_algorithm", "auto")
    engines = {
        "none": Engine(args.model, speculative_algorithm="none", **common),
        "auto": Engine(args.model, **{"speculative_algorithm": "auto", **common, **draft}),
    }
    if args.chains:
        chains = {"speculative_algorithm": "auto", **common, **draft, "speculative_topk": 1}
        engines["chains"] = Engine(args.model, **chains)
    if args.prompts:  # token ids saved by --save-prompts (no data packages needed)
        saved = json.loads(args.prompts.read_text())
    else:
        saved = workload_prompts(engines["none"].tokenizer, args.requests, args.gsm8k)
    if args.save_prompts:
        args.save_prompts.write_text(json.dumps(saved))
    greedy = {"temperature": 0, "max_new_tokens": args.max_new_tokens}
    sc = {"temperature": 0.7, "max_new_tokens": 256, "n": SC_SAMPLES, "stop": STOP}
    workloads = {name: (saved[name], sc if name == "gsm8k-sc" else greedy) for name in WORKLOADS}
    for engine in engines.values():  # kernels built and memory touched before any timing
        engine.generate(input_ids=workloads["code-edit"][0][0], sampling_params=greedy)
    rows = []
    for name, (prompts, params) in workloads.items():
        if args.workloads and name not in args.workloads:
            continue
        earlier = EARLIER.get(name)
        runs: dict[str, list[dict[str, Any]]] = {a: [] for a in engines}
        for _ in range(args.repeats):  # the engines take turns
            for a, e in engines.items():
                runs[a].append(run(e, prompts, params, earlier and saved[earlier]))
        plain, spec = (best(runs[a]) for a in ("none", "auto"))
        row = {
            "workload": name,
            "requests": len(prompts),
            "tokens": spec["tokens"],
            "plain_tokens_per_s": round(plain["tokens_per_s"], 2),
            "spec_tokens_per_s": round(spec["tokens_per_s"], 2),
            "speedup": round(spec["tokens_per_s"] / plain["tokens_per_s"], 3),
            "plain_decode_tokens_per_s": round(plain["decode_tokens_per_s"], 2),
            "spec_decode_tokens_per_s": round(spec["decode_tokens_per_s"], 2),
            "decode_speedup": round(spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"], 3),
            "draft_tokens": spec["draft_tokens"],
            "accepted_draft_tokens": spec["accepted_draft_tokens"],
            "same_tokens": all(
                r["outputs"] == plain["outputs"] for runs_of in runs.values() for r in runs_of
            ),
        }
        if "chains" in runs:
            chained = best(runs["chains"])
            row["chains_decode_tokens_per_s"] = round(chained["decode_tokens_per_s"], 2)
            row["chains_draft_tokens"] = chained["draft_tokens"]
            row["chains_accepted_draft_tokens"] = chained["accepted_draft_tokens"]
            row["trees_over_chains"] = round(
                spec["decode_tokens_per_s"] / chained["decode_tokens_per_s"], 3
            )
            print(
                f"{name:11s} chains decode {row['chains_decode_tokens_per_s']:7.2f} tok/s "
                f"accepted {chained['accepted_draft_tokens']}/{chained['draft_tokens']}; "
                f"trees {row['trees_over_chains']:5.2f}x chains",
                flush=True,
            )
        if args.llamacpp and name in LOOKUP_WORKLOADS:
            gguf = args.model if args.model and args.model.endswith(".gguf") else embedded_gguf()
            lc = llamacpp_runs(str(gguf), prompts, args.max_new_tokens)
            row["llamacpp_decode_tokens_per_s"] = round(lc["plain"]["decode_tokens_per_s"], 2)
            row["llamacpp_lookup_decode_tokens_per_s"] = round(
                lc["lookup"]["decode_tokens_per_s"], 2
            )
            row["llamacpp_lookup_speedup"] = round(
                lc["lookup"]["decode_tokens_per_s"] / lc["plain"]["decode_tokens_per_s"], 3
            )
            print(
                f"{name:11s} llama.cpp decode {row['llamacpp_decode_tokens_per_s']:7.2f} -> "
                f"{row['llamacpp_lookup_decode_tokens_per_s']:7.2f} tok/s with prompt lookup "
                f"{row['llamacpp_lookup_speedup']:5.2f}x",
                flush=True,
            )
        rows.append(row)
        print(
            f"{name:11s} {row['tokens']:6d} tok  none {row['plain_tokens_per_s']:7.2f} tok/s  "
            f"{algorithm} {row['spec_tokens_per_s']:7.2f} tok/s  {row['speedup']:5.2f}x  "
            f"decode alone {row['plain_decode_tokens_per_s']:7.2f} -> "
            f"{row['spec_decode_tokens_per_s']:7.2f} tok/s {row['decode_speedup']:5.2f}x  "
            f"accepted {row['accepted_draft_tokens']}/{row['draft_tokens']}  "
            f"same tokens: {row['same_tokens']}",
            flush=True,
        )
    info = engines["none"].scheduler.model_info
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "cpu": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "model": info.model_path,
        "dtype": info.dtype,
        "quantization": args.quantization,
        "algorithm": algorithm,
        "draft_model": args.draft_model,
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(rows, algorithm, args.plot)
    return result


def plot(rows: list[dict[str, Any]], algorithm: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    names = [r["workload"] for r in rows]
    x = range(len(rows))
    plain = [r["plain_decode_tokens_per_s"] for r in rows]
    bars = [("none", plain), (algorithm, [r["spec_decode_tokens_per_s"] for r in rows])]
    if "chains_decode_tokens_per_s" in rows[0]:
        bars.append((f"{algorithm}, chains", [r["chains_decode_tokens_per_s"] for r in rows]))
    width = 0.8 / len(bars)
    for j, (label, rates) in enumerate(bars):
        ax.bar([i + (j - (len(bars) - 1) / 2) * width for i in x], rates, width, label=label)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
