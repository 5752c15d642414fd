"""Grammar backends side by side on the same patterns and the embedded SmolLM2 tokenizer
(49152 tokens): compile time, and the mask time per decode step at batch 1 / 16 / 64.

A step is what the sampler does for B constrained rows (radixserve/sampling/sampler.py,
_mask_grammar): every row's `allowed_tokens()`, stacked (`masks`: the backend's cost), then
applied to a copy of the (B, V) logits as 0 / -inf by the sampler's `apply_token_masks`
(`apply`: the same for every backend); advancing each row by its token is timed apart
(`advance`). Each row walks a valid document of its pattern token by token; the B rows of a
batch walk the same document (what n samples of one request in lockstep do). outlines caches
each automaton state's mask on its first visit, so its first walk (`cold`) and later walks
over the same states (`warm`, the best of --repeats) are reported apart; llguidance and
xgrammar compute masks at each step. Compile time is the median of fresh compiles of the
pattern (xgrammar's own cache is off: the server keeps compiled patterns in its LRU); each
backend's one-time vocabulary set-up is reported apart.

    python benchmarks/bench_grammar.py --json benchmarks/results/grammar_<cpu>-<isa>_<date>.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from radixserve.constrained.backend import BACKENDS, make_grammar_backend
from radixserve.isa import cpu_isa
from radixserve.models import load_tokenizer, resolve_model_path
from radixserve.sampling.sampler import apply_token_masks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "email", "tags", "address"],
}
DOCUMENT = (
    '{"name": "Alice Smith", "age": 34, "email": "alice@example.com", "tags": ["admin", '
    '"ops"], "address": {"city": "Paris", "zip": "75001"}}'
)
# (name, field, pattern, a document it accepts)
PATTERNS = [
    ("regex-date", "regex", r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}", "2024-05-17T09:30"),
    ("regex-email", "regex", r"[a-z]{1,20}@[a-z]{1,20}\.(com|org|net)", "johnsmith@example.org"),
    ("json-schema", "json_schema", json.dumps(SCHEMA), DOCUMENT),
    (
        "ebnf-arith",
        "ebnf",
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
        'factor ::= [0-9]+ | "(" expr ")"',
        "(12+3)*45-(6/2)+789",
    ),
]


def walk_ms(grammar: Any, ids: list[int], batch: int, vocab: int) -> dict[str, float]:
    """Mean ms per step over `ids` of: the B masks (`fetch`: allowed_tokens + stack), their
    application to a copy of the logits (`apply`: what the sampler does), and advancing."""
    states = [grammar.new_state() for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    total = {"fetch": 0.0, "apply": 0.0, "advance": 0.0}
    steps = 0
    for tok in ids:
        if states[0].terminated:  # complete: the sampler does not draw again
            break
        steps += 1
        t0 = time.perf_counter()
        packed = torch.stack([s.allowed_tokens() for s in states])  # (B, ceil(V / 8))
        t1 = time.perf_counter()
        work = logits.clone()
        apply_token_masks(work, list(range(batch)), packed)
        t2 = time.perf_counter()
        for s in states:
            s.advance(tok)
        t3 = time.perf_counter()
        assert bool(torch.isfinite(work[:, tok]).all()), f"token {tok} masked"
        for key, dt in (("fetch", t1 - t0), ("apply", t2 - t1), ("advance", t3 - t2)):
            total[key] += dt
    return {key: v / steps * 1e3 for key, v in total.items()}


def run(names: list[str], batches: list[int], compiles: int, repeats: int) -> list[dict[str, Any]]:
    tok = load_tokenizer(resolve_model_path(None))
    vocab = len(tok)
    for b in batches:  # warm the kernels and the allocator up before anything is timed
        apply_token_masks(
            torch.zeros(b, vocab),
            list(range(b)),
            torch.full((b, (vocab + 7) // 8), 255, dtype=torch.uint8),
        )
    rows = []
    for name in names:
        t0 = time.perf_counter()
        backend = make_grammar_backend(
            name, tok, tok.eos_token_id, frozenset({tok.eos_token_id}), vocab
        )
        setup_s = time.perf_counter() - t0
        print(f"{name}: vocabulary set up in {setup_s:.2f} s")
        for pname, field, pattern, doc in PATTERNS:
            if name == "outlines" and field == "ebnf":
                continue
            times = []
            for _ in range(compiles):
                t0 = time.perf_counter()
                backend.compile(field, pattern)
                times.append(time.perf_counter() - t0)
            ids = tok.encode(doc, add_special_tokens=False) + [tok.eos_token_id]
            row: dict[str, Any] = {"backend": name, "pattern": pname, "steps": len(ids),
                                   "compile_ms": statistics.median(times) * 1e3,
                                   "setup_s": setup_s}  # fmt: skip
            for b in batches:
                fresh = backend.compile(field, pattern)  # outlines: an empty mask cache
                cold = walk_ms(fresh, ids, b, vocab)
                warm = [walk_ms(fresh, ids, b, vocab) for _ in range(repeats)]
                row[f"fetch_cold_b{b}"] = cold["fetch"]
                for key in ("fetch", "apply", "advance"):  # best of the warm walks: this VM
                    row[f"{key}_warm_b{b}" if key == "fetch" else f"{key}_b{b}"] = min(
                        w[key] for w in warm
                    )  # is shared, and a walk's mean moves with its neighbours' load
            rows.append(row)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
            )
    return rows


def table(rows: list[dict[str, Any]], batches: list[int]) -> str:
    """Markdown: per pattern and backend, compile ms and per-step ms (masks fetched cold /
    warm, and their expansion into the logits) at each batch size."""
    cols = [f"B={b}: masks cold / warm, apply" for b in batches]
    lines = ["| pattern | backend | compile ms | " + " | ".join(cols) + " |"]
    lines.append("|" + "---|" * (3 + len(batches)))
    for r in rows:
        cells = [
            f"{r[f'fetch_cold_b{b}']:.3f} / {r[f'fetch_warm_b{b}']:.3f}, {r[f'apply_b{b}']:.2f}"
            for b in batches
        ]
        lines.append(
            f"| {r['pattern']} | {r['backend']} | {r['compile_ms']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64])
    ap.add_argument("--compiles", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="warm walks per batch (best kept)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    print(f"CPU ISA: {cpu_isa()}, torch threads: {torch.get_num_threads()}")
    rows = run(args.backends, args.batches, args.compiles, args.repeats)
    print(table(rows, args.batches))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": cpu_isa(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
