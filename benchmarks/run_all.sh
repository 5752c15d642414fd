#!/usr/bin/env bash
# Regenerates every number and figure in docs/benchmarks.md (about 40 minutes on the 2-core
# CPU): JSON and logs go to benchmarks/results/. Run from the repository root with the
# project's virtualenv active:  bash benchmarks/run_all.sh
set -euo pipefail
out=benchmarks/results
mkdir -p "$out"
export OMP_WAIT_POLICY=PASSIVE
run() { local name=$1; shift; echo "== $name: $*"; python "$@" 2>&1 | grep --line-buffered -v -i warn | tee "$out/$name.log"; }

run offline benchmarks/bench_offline.py --batch 16 --new-tokens 64 --json "$out/offline.json"
run tree_attention_headline benchmarks/bench_tree_attention.py --only headline --json "$out/tree_attention_headline.json"
run tree_attention benchmarks/bench_tree_attention.py --json "$out/tree_attention.json" --plot "$out/tree_attention.png"
run shared_prefix benchmarks/bench_shared_prefix.py --batch 1 16 64 --prefix 1024 4096 --new-tokens 16 --json "$out/shared_prefix.json"
run shared_prefix_b1 benchmarks/bench_shared_prefix.py --batch 1 --prefix 1024 4096 --new-tokens 32 --repeats 3 --backends tree flat --json "$out/shared_prefix_b1.json"
run samples benchmarks/bench_shared_prefix.py --samples --batch 64 --prefix 4096 --new-tokens 128 --backends tree hf --json "$out/samples.json"
run gsm8k50 benchmarks/eval_gsm8k.py --num-questions 50 --num-shots 8 -n 16 --compare --output-json "$out/gsm8k50.json"
run gsm8k_greedy benchmarks/eval_gsm8k.py --num-questions 50 --num-shots 8 -n 1 --temperature 0 --dtype float32 --compare --output-json "$out/gsm8k_greedy.json"
run gsm8k_greedy_bf16 benchmarks/eval_gsm8k.py --num-questions 50 --num-shots 8 -n 1 --temperature 0 --compare --control-parallel 7 --output-json "$out/gsm8k_greedy_bf16.json"
run humaneval benchmarks/eval_code.py --dataset humaneval --num-problems 20 -k 8 --compare --output-json "$out/humaneval.json"
run prompt_modules benchmarks/bench_prompt_modules.py --prompts 4 --questions 24 --max-tokens 128 --json "$out/prompt_modules.json" --plot "$out/prompt_modules.png"
python benchmarks/plot.py --shared-prefix "$out/shared_prefix.json" --out-dir "$out"
