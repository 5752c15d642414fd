"""Tree of thought, two levels of fork: propose `width` approaches, expand each into
`width` solutions, let the model judge every solution (a `select` between "yes" and "no"),
and keep the solution it trusts most.

    question ── approach 1 ── solution 1.1  verdict
             │             └─ solution 1.2  verdict
             └─ approach 2 ── solution 2.1  verdict
                           └─ solution 2.2  verdict

Each fork commits its prefix once, so every node of this tree is prefilled once and shared
by the branches below it in the radix cache (and read once per step by tree attention).

    python examples/tree_of_thought.py              # embedded SmolLM2-135M-Instruct
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import radixserve.frontend as rs

QUESTION = "How can I keep a small vegetable garden alive during a two-week vacation?"


@rs.function
def tree_of_thought(s, question, width=2, max_tokens=48):  # noqa: ANN001, ANN201
    s += rs.system("You are a practical assistant. Answer in one or two sentences.")
    s += rs.user(question)
    s += rs.assistant_begin()
    approaches = s.fork(width)
    # Submit every approach's gen before forking any of them: forking waits for the
    # approach's text, and waiting inside this loop would run the approaches one by one.
    for i, a in enumerate(approaches):
        a += f"Approach {i + 1}: " + rs.gen("approach", max_tokens=max_tokens, stop="\n") + "\n"
    for a in approaches:
        solutions = a.fork(width)
        solutions += "Solution: " + rs.gen("solution", max_tokens=max_tokens, stop="\n")
        solutions += "\nIs this solution practical? " + rs.select("verdict", ["yes", "no"])
        solutions.join()  # a["solution"], a["verdict"]: lists over this approach's solutions
    approaches.join()  # s["approach"]: list; s["solution"], s["verdict"]: lists of lists


@dataclass
class Best:
    approach: str
    solution: str
    score: float  # mean logprob of "yes" minus that of "no" for the chosen solution
    tree: list[tuple[str, list[tuple[str, str, float]]]]  # (approach, [(solution, verdict, score)])


def _yes_margin(meta: dict[str, Any]) -> float:
    yes, no = meta["normalized_prompt_logprobs"]
    return float(yes - no)


def solve(question: str, width: int = 2, backend: Any = None, max_tokens: int = 48) -> Best:
    state = tree_of_thought.run(question, width, max_tokens, backend=backend, temperature=0.8)
    metas = state.get_meta_info("verdict")  # [approach][solution] -> select meta_info
    tree = []
    for i, approach in enumerate(state["approach"]):
        leaves = [
            (sol, verdict, _yes_margin(meta))
            for sol, verdict, meta in zip(state["solution"][i], state["verdict"][i], metas[i])
        ]
        tree.append((approach, leaves))
    score, i, j = max(
        (leaf[2], i, j) for i, (_, ls) in enumerate(tree) for j, leaf in enumerate(ls)
    )
    return Best(tree[i][0], tree[i][1][j][0], score, tree)


def main(backend: Any = None, width: int = 2) -> Best:
    backend = backend or rs.EngineBackend()
    best = solve(QUESTION, width, backend)
    for approach, leaves in best.tree:
        print(f"approach: {approach.strip()}")
        for sol, verdict, score in leaves:
            print(f"    [{verdict:>3} {score:+.2f}] {sol.strip()}")
    print(f"\nbest: {best.solution.strip()}  (via: {best.approach.strip()})")
    return best


if __name__ == "__main__":
    main()
