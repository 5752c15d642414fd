"""Tensor parallelism on CPU (gloo), 2 ranks, fp32, the tiny random Llama (4 q heads, 2 KV
heads, intermediate 128: each rank holds 2 q heads, 1 KV head, 64 intermediate columns).

- weight sharding partitions every projection exactly (no processes);
- a tp_size that does not divide the heads is refused before any process starts;
- in-process Engine, tp 2 vs tp 1: same greedy tokens for 10 prompts that share a cached
  320-token prefix (the tree backend keeps a shared segment in 23 of the run's 25 steps, on
  both ranks); logits of an extend and a decode step within 1e-5 of the logit scale (fp32;
  see LOGIT_RTOL);
- the real server with --tp-size 2: same greedy tokens as tp 1, clean SIGTERM shutdown with
  no process left; a SIGKILLed follower takes the server down (exit 1, named in the log).
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from conftest import children_of, launch_server, wait_gone

from radixserve.core.batch import ForwardBatch
from radixserve.distributed.parallel import get_tp
from radixserve.engine.engine import Engine
from radixserve.kvcache.pool import KVPool
from radixserve.models.loader import load_config
from radixserve.models.sharding import shard_hf_weights
from radixserve.worker.batch_sync import decode_batch, encode_batch

SHARED = [(7 * i + 3) % 900 + 20 for i in range(320)]  # cached prefix of every prompt
PROMPTS = [SHARED + [100 + 13 * i + j for j in range(i + 1)] for i in range(10)]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
KV_TOKENS = "2048"
# fp32: max |tp2 - tp1| <= LOGIT_RTOL * max |logit|. The row-parallel layers sum two partial
# dot products (a different rounding order), amplified through the tiny model's large random
# weights; measured 6.0e-5 at max |logit| 21.4 (2.8e-6 of the scale).
LOGIT_RTOL = 1e-5


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    """(tp 1, tp 2) Engines on the tiny model. Teardown checks the follower exited cleanly."""
    kw = {"dtype": "float32", "max_total_tokens": int(KV_TOKENS), "attention_backend": "tree"}
    threads = torch.get_num_threads()
    e1 = Engine(str(tiny_model_dir), **kw)
    e2 = Engine(str(tiny_model_dir), tp_size=2, **kw)
    tp = get_tp()
    assert tp is not None and tp.rank == 0 and tp.size == 2 and len(tp.followers) == 1
    yield e1, e2
    e2.worker.close()
    assert torch.get_num_threads() == threads  # rank 0 gave this process its threads back
    assert [p.exitcode for p in tp.followers] == [0]
    assert get_tp() is None and tp.scratch_dir is not None and not os.path.exists(tp.scratch_dir)


def greedy_ids(engine: Engine) -> tuple[list[list[int]], list[int]]:
    """Output ids of PROMPTS (after a warm-up that caches SHARED) and their cached_tokens."""
    engine.generate(input_ids=SHARED + [5], sampling_params=dict(GREEDY, max_new_tokens=1))
    out = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert isinstance(out, list) and len(out) == len(PROMPTS)
    engine.check_integrity()
    return [r["output_ids"] for r in out], [r["meta_info"]["cached_tokens"] for r in out]


def test_shard_partitions_every_projection(tiny_model_dir: Path) -> None:
    config = load_config(tiny_model_dir)
    d, hq, hkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, 128
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0."
    hf = {
        p + "self_attn.q_proj.weight": torch.randn(hq * d, 64, generator=g),
        p + "self_attn.k_proj.weight": torch.randn(hkv * d, 64, generator=g),
        p + "self_attn.o_proj.weight": torch.randn(64, hq * d, generator=g),
        p + "self_attn.o_proj.bias": torch.randn(64, generator=g),
        p + "mlp.up_proj.weight": torch.randn(inter, 64, generator=g),
        p + "mlp.down_proj.weight": torch.randn(64, inter, generator=g),
        "model.embed_tokens.weight": torch.randn(10, 64, generator=g),
    }
    shards = [shard_hf_weights(hf, config, r, 2) for r in range(2)]
    for name, dim in [("q_proj.weight", 0), ("k_proj.weight", 0), ("o_proj.weight", 1)]:
        parts = [s[p + "self_attn." + name] for s in shards]
        assert parts[0].shape[dim] * 2 == hf[p + "self_attn." + name].shape[dim]
        assert torch.equal(torch.cat(parts, dim), hf[p + "self_attn." + name])
    for name, dim in [("up_proj.weight", 0), ("down_proj.weight", 1)]:
        assert torch.equal(
            torch.cat([s[p + "mlp." + name] for s in shards], dim), hf[p + "mlp." + name]
        )
    # Row-parallel bias is added once (rank 0); replicated tensors are shared as they are.
    assert torch.equal(shards[0][p + "self_attn.o_proj.bias"], hf[p + "self_attn.o_proj.bias"])
    assert not shards[1][p + "self_attn.o_proj.bias"].any()
    assert shards[1]["model.embed_tokens.weight"] is hf["model.embed_tokens.weight"]


@pytest.mark.parametrize("sliding", [False, True])
def test_batch_encoding_round_trips(sliding: bool) -> None:
    """Three requests: two share radix nodes 7 and 9, one has no path; mixed extend lengths;
    with a sliding layer, its rows too."""
    pool = KVPool(64, 1, 1, 2, torch.float32, windows=[4] if sliding else [])
    kv = [torch.tensor([5, 6, 7, 8, 20]), torch.tensor([5, 6, 7, 30, 31, 32]), torch.tensor([40])]
    rows = [s + 100 for s in kv] if sliding else None
    batch = ForwardBatch(
        input_ids=torch.tensor([11, 12, 13, 14]),
        positions=torch.tensor([4, 4, 5, 0]),
        out_cache_loc=torch.tensor([20, 31, 32, 40]),
        seq_lens=[5, 6, 1],
        extend_lens=[1, 2, 1],
        kv_indices=kv,
        paths=[[(7, 2), (9, 1)], [(7, 2), (9, 1), (12, 1)], []],
        kv_pool=pool,
        swa_kv_indices=rows,
    )
    header, body = encode_batch(batch)
    n_swa = 12 if sliding else 0
    # forward, requests, tokens, path nodes, kv, sliding rows
    assert header.tolist() == [1, 3, 4, 5, 12, n_swa]
    assert body.numel() == 3 * 4 + 3 * 3 + 12 + 2 * 5 + n_swa
    got = decode_batch(header, body, pool)
    if rows is not None:
        assert got.swa_kv_indices is not None and got.swa_out_cache_loc is not None
        assert all(torch.equal(a, b) for a, b in zip(got.swa_kv_indices, rows, strict=True))
        assert got.swa_out_cache_loc.tolist() == [120, 131, 132, 140]
    else:
        assert got.swa_kv_indices is None
    for name in ("input_ids", "positions", "out_cache_loc"):
        assert torch.equal(getattr(got, name), getattr(batch, name)), name
    assert (got.seq_lens, got.extend_lens, got.paths) == (
        batch.seq_lens,
        batch.extend_lens,
        batch.paths,
    )
    assert all(torch.equal(a, b) for a, b in zip(got.kv_indices, kv)) and len(got.kv_indices) == 3
    assert got.kv_pool is pool


def test_tp_size_must_divide_heads(tiny_model_dir: Path) -> None:
    before = set(children_of(os.getpid()))
    with pytest.raises(ValueError, match=r"--tp-size 3 must divide .*attention heads \(4\)"):
        Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=256, tp_size=3)
    assert set(children_of(os.getpid())) <= before  # refused before spawning anything
    assert get_tp() is None


@pytest.mark.slow  # two-process engines and servers: ~5-9 s each
def test_engine_greedy_matches_tp1(engines: tuple[Engine, Engine]) -> None:
    ids1, cached1 = greedy_ids(engines[0])
    ids2, cached2 = greedy_ids(engines[1])
    assert ids2 == ids1
    assert all(len(ids) == GREEDY["max_new_tokens"] for ids in ids1)
    assert len({tuple(ids) for ids in ids1}) == len(PROMPTS)  # not one degenerate output
    assert cached2 == cached1 and min(cached1) >= len(SHARED)  # the shared prefix was reused


def _forward(
    engine: Engine, reqs: list[list[int]], kv: list[torch.Tensor], new: int | None
) -> torch.Tensor:
    """One batch on `engine`'s worker: request r has tokens reqs[r] at KV slots kv[r]; its
    last `new` tokens (all when None) are this step's queries. -> logits of every query."""
    worker = engine.worker
    ext = [len(t) if new is None else new for t in reqs]
    batch = ForwardBatch(
        input_ids=torch.tensor([x for t, e in zip(reqs, ext) for x in t[len(t) - e :]]),
        positions=torch.tensor([p for t, e in zip(reqs, ext) for p in range(len(t) - e, len(t))]),
        out_cache_loc=torch.cat([s[len(s) - e :] for s, e in zip(kv, ext)]),
        seq_lens=[len(t) for t in reqs],
        extend_lens=ext,
        kv_indices=kv,
        paths=[[] for _ in reqs],
        kv_pool=worker.pool,
    )
    return worker.forward(batch, torch.arange(sum(ext)))


@pytest.mark.slow  # two-process engines and servers: ~5-9 s each
def test_logits_close(engines: tuple[Engine, Engine]) -> None:
    """An extend of 3 prompts (5, 17, 40 tokens), then a decode step of the same 3 requests
    over the K/V the extend wrote: tp 2 logits within LOGIT_RTOL * max |logit| of tp 1's."""
    prompts = [[(11 * i + 5 * r) % 700 + 30 for i in range(n)] for r, n in enumerate((5, 17, 40))]
    decoded = [p + [400 + r] for r, p in enumerate(prompts)]
    got: list[list[torch.Tensor]] = []
    for engine in engines:
        pool = engine.worker.pool
        kv = [pool.alloc(len(p) + 1) for p in prompts]
        assert all(s is not None for s in kv)
        got.append(
            [
                _forward(engine, prompts, [s[:-1] for s in kv], None),  # (62, vocab)
                _forward(engine, decoded, kv, 1),  # (3, vocab)
            ]
        )
        pool.free(torch.cat(kv))
        engine.check_integrity()
    for tp1, tp2 in zip(*got):
        assert tp1.shape == tp2.shape and tp1.shape[1] == engines[0].scheduler.model_info.vocab_size
        diff, scale = (tp2 - tp1).abs().max().item(), tp1.abs().max().item()
        assert scale > 1.0  # the comparison is not between near-zeros
        assert diff <= LOGIT_RTOL * scale, f"tp 2 vs tp 1 logits differ by {diff} (max {scale})"
        assert torch.equal(tp2.argmax(-1), tp1.argmax(-1))


# ---------------------------------------------------------------- the real server


def _follower_pid(log: str) -> int:
    m = re.search(r"radixserve-tp-rank-1\[(\d+)\]", log)
    assert m, log[-3000:]
    return int(m.group(1))


@pytest.mark.slow  # two-process engines and servers: ~5-9 s each
def test_server_tp2_greedy_and_clean_shutdown(
    tiny_model_dir: Path, tmp_path: Path, engines: tuple[Engine, Engine]
) -> None:
    expected, _ = greedy_ids(engines[0])
    h = launch_server(tiny_model_dir, tmp_path, "--tp-size", "2", "--max-total-tokens", KV_TOKENS)
    try:
        kids = children_of(h.proc.pid)
        follower = _follower_pid(h.log_text())
        assert follower in kids  # a child of the launcher, watched like the others
        with h.client() as c:
            c.post("/generate", json={"input_ids": SHARED + [5], "sampling_params": GREEDY})
            r = c.post("/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        assert [o["output_ids"] for o in r.json()] == expected
        assert min(o["meta_info"]["cached_tokens"] for o in r.json()) >= len(SHARED)
    finally:
        code = h.stop(signal.SIGTERM)
    log = h.log_text()
    assert code == 0, log[-3000:]
    assert "tp-rank-1 process exited cleanly" in log
    assert "radixserve-tp-rank-1 exited with code 0" in log
    wait_gone(kids)


@pytest.mark.slow  # two-process engines and servers: ~5-9 s each
def test_server_dies_with_a_killed_follower(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL rank 1 while a streamed request is decoding: rank 0 fails in the step's
    collective, the launcher names the dead rank, fails the request and exits 1."""
    h = launch_server(tiny_model_dir, tmp_path, "--tp-size", "2", "--max-total-tokens", KV_TOKENS)
    long = {"temperature": 0, "max_new_tokens": 1000, "ignore_eos": True}
    try:
        kids = children_of(h.proc.pid)
        body = {"input_ids": [1, 2, 3], "sampling_params": long, "stream": True}
        with h.client() as c, c.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # decoding now
            os.kill(_follower_pid(h.log_text()), signal.SIGKILL)
            rest = "\n".join(lines)  # the stream ends: with an error event or cut short
        code = h.proc.wait(60)
    finally:
        h.stop(signal.SIGKILL)
    log = h.log_text()
    assert code == 1, log[-3000:]
    assert "radixserve-tp-rank-1 exited with code -9" in log
    # Whichever death the launcher's watch saw first (rank 1, or rank 0 failing in the
    # step's all_reduce) is named, and the streamed request gets an error, not a finish:
    # the step's (the broken collective, when the scheduler fails the step before the
    # launcher shuts down) or the server's.
    assert re.search(r"(tp-rank-1|scheduler) process exited with code (-9|1): shutting", log)
    events = [json.loads(x[5:]) for x in rest.splitlines() if x.startswith("data: {")]
    message = events[-1]["error"]["message"]
    assert re.match(r"the server failed|internal error: RuntimeError: .*gloo", message), rest
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1]), rest[-1000:]
    with pytest.raises(httpx.TransportError):
        httpx.get(h.url + "/health", timeout=2)
    wait_gone(kids)
