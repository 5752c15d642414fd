#!/usr/bin/env bash
# Reruns the docs/benchmarks.md sections measured on the `amx-avx512` machine and two runs
# beside them, each writing <what>_<machine>_<date>.{json,log} to benchmarks/results/:
#   offline        Offline throughput vs HF transformers (bench_offline.py)
#   tree_attention Attention op: tree vs flat, the full sweep and its plot
#   samples        n samples of one prompt, prefill included
#   gsm8k50, gsm8k_greedy, gsm8k_greedy_bf16   GSM8K self-consistency
#   humaneval      HumanEval code sampling
#   prompt_modules Prompt modules: TTFT and quality
# About 45 minutes on a 2-core CPU, estimated from the sections' stated times (HF's side of
# `samples` alone took 618 s, GSM8K's three runs ~11 min, HumanEval ~3 min); not timed as a
# whole. The other sections' commands are in docs/benchmarks.md. GSM8K and HumanEval data
# are downloaded on first use (docs/benchmarks.md#scripts). Run from the repository root with
# the project's virtualenv active:
#   MACHINE=zen4-avx512 bash benchmarks/run_all.sh
# MACHINE names the machine in the file names (docs/benchmarks.md#machines).
set -euo pipefail
out=benchmarks/results
tag="${MACHINE:-$(uname -m)}_$(date +%F)"
mkdir -p "$out"
export OMP_WAIT_POLICY=PASSIVE
run() { local name=$1_$tag; shift; echo "== $name: $*"; python "$@" 2>&1 | grep --line-buffered -v -i warn | tee "$out/$name.log"; }

run offline benchmarks/bench_offline.py --batch 16 --new-tokens 64 --json "$out/offline_$tag.json"
run tree_attention benchmarks/bench_tree_attention.py --json "$out/tree_attention_$tag.json" --plot "$out/tree_attention_$tag.png"
run samples benchmarks/bench_shared_prefix.py --samples --batch 64 --prefix 4096 --new-tokens 128 --backends tree hf --json "$out/samples_$tag.json"
run gsm8k50 benchmarks/eval_gsm8k.py --num-questions 50 --num-shots 8 -n 16 --compare --output-json "$out/gsm8k50_$tag.json"
run gsm8k_greedy benchmarks/eval_gsm8k.py --num-questions 50 --num-shots 8 -n 1 --temperature 0 --dtype float32 --compare --output-json "$out/gsm8k_greedy_$tag.json"
run gsm8k_greedy_bf16 benchmarks/eval_gsm8k.py --num-questions 50 --num-shots 8 -n 1 --temperature 0 --compare --control-parallel 7 --output-json "$out/gsm8k_greedy_bf16_$tag.json"
run humaneval benchmarks/eval_code.py --dataset humaneval --num-problems 20 -k 8 --compare --output-json "$out/humaneval_$tag.json"
run prompt_modules benchmarks/bench_prompt_modules.py --prompts 4 --questions 24 --max-tokens 128 --json "$out/prompt_modules_$tag.json" --plot "$out/prompt_modules_$tag.png"
