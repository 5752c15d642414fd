"""Self-consistency (Wang et al., 2022): sample several reasoning paths for one question from
a shared prefix, read each path's final answer, and return the majority answer.

The question is prefilled once: `s.fork(n)` commits it to the radix cache and the n
children's gens reach the runtime together, so they are batched and decode side by side.

    python examples/self_consistency.py            # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import radixserve.frontend as rs

QUESTION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
    "in May. How many clips did Natalia sell altogether in April and May?"
)
ANSWER_RE = re.compile(r"answer is\s*\$?(-?[\d,]*\.?\d+)", re.IGNORECASE)
NUMBER_RE = re.compile(r"-?\d[\d,]*\.?\d*")


@rs.function
def self_consistency(s, question, n, max_tokens=128):  # noqa: ANN001, ANN201 (DSL program)
    s += rs.system("Solve the math problem step by step. End with 'The answer is <number>.'")
    s += rs.user(question)
    paths = s.fork(n)
    paths += rs.assistant(rs.gen("reasoning", max_tokens=max_tokens, temperature=0.7, top_p=0.95))
    paths.join()  # s["reasoning"]: the n paths, in fork order


def extract_answer(text: str) -> str | None:
    """The path's final number: after 'answer is' if present, else the last number."""
    m = ANSWER_RE.search(text)
    if m:
        return _clean(m.group(1))
    numbers = NUMBER_RE.findall(text)
    return _clean(numbers[-1]) if numbers else None


def _clean(number: str) -> str:
    number = number.replace(",", "").rstrip(".")
    return number[:-2] if number.endswith(".0") else number


@dataclass
class Vote:
    answer: str | None  # the majority answer (None if no path gave a number)
    answers: list[str | None]  # each path's answer, in fork order
    paths: list[str]
    cached_tokens: list[int]  # per path: prompt tokens found in the prefix cache


def solve(question: str, n: int = 5, backend: Any = None, max_tokens: int = 128) -> Vote:
    state = self_consistency.run(question, n, max_tokens, backend=backend)
    paths = state["reasoning"]
    answers = [extract_answer(p) for p in paths]
    counts = Counter(a for a in answers if a is not None)
    majority = counts.most_common(1)[0][0] if counts else None
    cached = [m["cached_tokens"] for m in state.get_meta_info("reasoning")]
    return Vote(majority, answers, paths, cached)


def main(backend: Any = None, n: int = 5) -> Vote:
    backend = backend or rs.EngineBackend()  # the embedded model by default
    vote = solve(QUESTION, n, backend)
    for i, (path, answer) in enumerate(zip(vote.paths, vote.answers)):
        print(f"--- path {i} (answer {answer}) ---\n{path.strip()}\n")
    print(f"majority answer: {vote.answer}   (votes: {vote.answers})")
    return vote


if __name__ == "__main__":
    main(n=int(sys.argv[1]) if len(sys.argv) > 1 else 5)
