"""What quantized weights cost in exactness: perplexity, logprob deltas and greedy agreement of
each `--quantization` mode against the dequantized float32 model, on the same fixed text.

Modes: `none` (every weight dequantized to float32: the reference), `auto` (the GGUF's own
blocks: the same weights, with activations rounded to int16 per 32-block by the native
kernels, K-quants' per 256-block, and Q4_K's and Q6_K's to int8 as llama.cpp rounds them;
float32 ones in a build without AVX2), `auto-int16` (the same with Q4_K's and Q6_K's
activations int16 too: --quant-activations int16), `int8` (every projection re-quantized to
Q8_0: a real rounding of the weights).

Per mode: perplexity of the text (teacher-forced, the prompt's own input logprobs), the mean
and max |logprob delta| per token against `none`, and for greedy continuations of the prompts
the number identical to `none`'s and the mean length of the common prefix. The teacher-forced
logprobs are taken twice: in one long forward per chunk (prefill-sized: the int16 GEMM) and
`--step` tokens a forward, each request extending the cached prefix (decode-sized: the
weight-streaming kernels).

With `--model FILE` (a GGUF; default the embedded model) and `--llamacpp`, llama.cpp
(llama-cpp-python, the bench extra) reads the same file and text: its perplexity and greedy
continuations (the same token ids fed, argmax of its logits) are a row of their own, and
`vs_llamacpp` compares radixserve's `auto` modes with it: the perplexity ratio, the share of
positions whose top-1 token under teacher forcing is llama.cpp's, and the greedy
continuations identical to llama.cpp's; `llamacpp_flash_top1_agreement` is the same share
between llama.cpp's own two attention paths (flash attention off and on): the agreement a
model's near-ties allow; `top1_agreement_where_llamacpp_is_stable` is radixserve's share on
the positions where those two paths agree (no near-tie llama.cpp's own rounding flips).

    python benchmarks/eval_quant.py --data-path path/to/gsm8k --json out.json
    python benchmarks/eval_quant.py --model models/smollm2-135m-Q4_K_M.gguf \\
        --modes auto auto-int16 --llamacpp --data-path path/to/gsm8k
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from eval_data import gsm8k, gsm8k_text, synthetic_text
from llamacpp_side import supervise

from radixserve import Engine
from radixserve.isa import cpu_isa

MODES = ("none", "auto", "auto-int16", "int8")


def texts(args: argparse.Namespace, tokenizer: Any) -> list[list[int]]:
    """`--chunks` token windows of `--chunk-tokens` ids each, from one fixed text."""
    total = args.chunks * args.chunk_tokens
    text = (
        gsm8k_text(gsm8k(args.data_path, "test"), total)
        if args.data_path
        else synthetic_text(total)
    )
    ids = tokenizer.encode(text)
    n = args.chunk_tokens
    assert len(ids) >= total, f"{len(ids)} tokens of text, need {total}"
    return [ids[i * n : (i + 1) * n] for i in range(args.chunks)]


def logprobs(engine: Engine, chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced logprob of every token after the first, and the id the model ranked
    first at its position: (chunks, tokens - 1) each."""
    res = engine.generate(
        input_ids=chunks, sampling_params={"max_new_tokens": 0}, return_logprob=True,
        logprob_start_len=0, top_logprobs_num=1,
    )  # fmt: skip
    rows = res if isinstance(res, list) else [res]
    vals = [e[0] for r in rows for e in r["meta_info"]["input_token_logprobs"] if e[0] is not None]
    tops = [t[0][1] for r in rows for t in r["meta_info"]["input_top_logprobs"] if t]
    shape = (len(chunks), -1)
    return torch.tensor(vals, dtype=torch.float64).view(shape), torch.tensor(tops).view(shape)


def stepped_logprobs(engine: Engine, chunks: list[list[int]], step: int) -> torch.Tensor:
    """The same logprobs as `logprobs`, computed `step` tokens a forward (decode-sized M):
    (chunks, the first whole number of steps of tokens - 1)."""
    vals: list[float] = []
    for ids in chunks:
        for end in range(step + 1, len(ids) + 1, step):
            res = engine.generate(
                input_ids=ids[:end], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                logprob_start_len=end - step,
            )  # fmt: skip
            vals += [e[0] for e in res["meta_info"]["input_token_logprobs"]]
    return torch.tensor(vals, dtype=torch.float64).view(len(chunks), -1)


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    res = engine.generate(input_ids=prompts, sampling_params=params)
    return [r["output_ids"] for r in (res if isinstance(res, list) else [res])]


class LlamaCppRef:
    """llama.cpp on the same GGUF: teacher-forced logprobs and greedy continuations."""

    def __init__(self, model: Path, n_ctx: int, threads: int, flash: bool = False) -> None:
        import llama_cpp  # the bench extra

        self.llm = llama_cpp.Llama(
            str(model), n_ctx=n_ctx, logits_all=True, n_threads=threads, verbose=False,
            flash_attn=flash,
        )  # fmt: skip

    def logprobs(self, chunks: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        rows, tops = [], []
        for ids in chunks:
            self.llm.reset()
            self.llm.eval(ids)
            logits = torch.from_numpy(self.llm.scores[: len(ids) - 1]).double()  # (T - 1, V)
            lp = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            rows.append(lp)
            tops.append(logits.argmax(-1))
        return torch.stack(rows), torch.stack(tops)

    def greedy(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        outs = []
        for ids in prompts:
            self.llm.reset()
            self.llm.eval(ids)
            out: list[int] = []
            for _ in range(n):
                out.append(int(self.llm.scores[self.llm.n_tokens - 1].argmax()))
                self.llm.eval([out[-1]])
            outs.append(out)
        return outs


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-path", default=None, help="GSM8K folder or jsonl; default: synthetic")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--step", type=int, default=8, help="tokens a forward, decode-sized pass")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: the embedded)")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp on the same file too")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = str(args.model) if args.model else None
    results: dict[str, dict[str, Any]] = {}
    ref_lp: torch.Tensor | None = None
    ref_steps: torch.Tensor | None = None
    ref_out: list[list[int]] | None = None
    outputs: dict[str, tuple[torch.Tensor, torch.Tensor, list[list[int]]]] = {}
    chunks: list[list[int]] = []  # the text, tokenized by the first engine
    # The first run is the reference: `none` when asked for (a float32 copy of every weight:
    # 4x a Q8_0 model's memory), else the first mode.
    first = ["none"] if "none" in args.modes else []
    runs = (*first, *[m for m in args.modes if m != "none"], *(["llama.cpp"] * args.llamacpp))
    for mode in runs:
        if mode == "llama.cpp":
            assert args.model is not None, "--llamacpp needs --model FILE.gguf"
            ref = LlamaCppRef(args.model, args.chunk_tokens + args.greedy_tokens, args.threads)
            lp, top = ref.logprobs(chunks)
            assert ref_steps is not None  # (the reference ran first)
            steps = lp[:, : ref_steps.shape[1]]  # one way of running it: a chunk a forward
            out = ref.greedy([c[:64] for c in chunks], args.greedy_tokens)
            del ref
            flash = LlamaCppRef(args.model, args.chunk_tokens, args.threads, flash=True)
            flash_top = flash.logprobs(chunks)[1]
            del flash
        else:
            activations = "int16" if mode == "auto-int16" else "int8"
            engine = Engine(
                model, quantization=mode.removesuffix("-int16"), dtype="float32",
                quant_activations=activations,
            )  # fmt: skip
            chunks = texts(args, engine.tokenizer)
            lp, top = logprobs(engine, chunks)
            steps = stepped_logprobs(engine, chunks, args.step)
            out = greedy(engine, [c[:64] for c in chunks], args.greedy_tokens)
            engine.shutdown()
        outputs[mode] = (lp, top, out)
        ref_lp = lp if ref_lp is None else ref_lp
        ref_steps = lp[:, : steps.shape[1]] if ref_steps is None else ref_steps  # one pass
        ref_out = out if ref_out is None else ref_out
        delta, step_delta = (lp - ref_lp).abs(), (steps - ref_steps).abs()
        prefixes = [common_prefix(a, b) for a, b in zip(out, ref_out)]
        results[mode] = {
            "perplexity": float(torch.exp(-lp.mean())),
            "mean_abs_logprob_delta": float(delta.mean()),
            "max_abs_logprob_delta": float(delta.max()),
            "decode_sized_perplexity": float(torch.exp(-steps.mean())),
            "decode_sized_mean_abs_logprob_delta": float(step_delta.mean()),
            "decode_sized_max_abs_logprob_delta": float(step_delta.max()),
            "greedy_identical": sum(a == b for a, b in zip(out, ref_out)),
            "greedy_prompts": len(out),
            "mean_common_prefix": sum(prefixes) / len(prefixes),
        }
        r = results[mode]
        print(
            f"{mode:10s} ppl {r['perplexity']:.4f}",
            f"|dlogprob| mean {r['mean_abs_logprob_delta']:.2e}",
            f"max {r['max_abs_logprob_delta']:.2e};",
            f"decode-sized ppl {r['decode_sized_perplexity']:.4f}",
            f"|dlogprob| mean {r['decode_sized_mean_abs_logprob_delta']:.2e}",
            f"max {r['decode_sized_max_abs_logprob_delta']:.2e};",
            f"greedy identical {r['greedy_identical']}/{r['greedy_prompts']},",
            f"common prefix {r['mean_common_prefix']:.1f}/{args.greedy_tokens}",
        )
    res: dict[str, Any] = {"isa": cpu_isa(), "model": model or "embedded",
                           "tokens": int(ref_lp.numel()) if ref_lp is not None else 0,
                           "modes": results}  # fmt: skip
    if "llama.cpp" in outputs:
        # llama.cpp against itself: the share of positions where its two attention paths
        # (flash attention off and on) rank the same token first. Where the model's
        # next-token distribution is nearly flat, rounding alone moves the top-1 token, and
        # no implementation agrees with llama.cpp more often than llama.cpp does with itself.
        self_top1 = float((flash_top == outputs["llama.cpp"][1]).double().mean())
        res["llamacpp_flash_top1_agreement"] = self_top1
        print(f"llama.cpp flash attention on vs off: top-1 agreement {self_top1:.4f}")
    for mode in ("auto", "auto-int16"):
        if "llama.cpp" not in outputs or mode not in outputs:
            continue
        (ours, our_top, our_out) = outputs[mode]
        (theirs, their_top, their_out) = outputs["llama.cpp"]
        vs = {
            "perplexity_ratio": float(torch.exp(-ours.mean()) / torch.exp(-theirs.mean())),
            "mean_abs_logprob_delta": float((ours - theirs).abs().mean()),
            # teacher forcing: the share of positions where both rank the same token first
            "top1_agreement": float((our_top == their_top).double().mean()),
            "top1_agreement_where_llamacpp_is_stable": float(
                (our_top == their_top)[flash_top == their_top].double().mean()
            ),
            "greedy_identical": sum(a == b for a, b in zip(our_out, their_out)),
            "greedy_prompts": len(our_out),
        }
        res["vs_llamacpp" if mode == "auto" else f"{mode}_vs_llamacpp"] = vs
        print(f"{mode} vs llama.cpp: {vs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    if parse_args(None).llamacpp:  # llama.cpp runs here: a signal in it is named
        supervise(__file__, sys.argv[1:])
    main()
