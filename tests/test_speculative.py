"""Speculative decoding (radixserve/scheduler/speculative.py) on a tiny random Llama (fp32):
the same tokens with and without drafts (greedy and seeded sampling, alone and batched,
n > 1, stop strings, logprobs, a regex, a small pool that retracts), drafts really accepted
(from the radix cache and from the sample's own tokens), and no KV slot leaked."""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_all_free, run_under_triton_interpreter
from hypothesis import given
from hypothesis import strategies as st

from radixserve import Engine, kernels
from radixserve.cli import build_parser, config_from_args
from radixserve.config import EngineConfig
from radixserve.core.params import SamplingParams
from radixserve.core.request import TokenizedRequest
from radixserve.kvcache.pool import KVPool
from radixserve.kvcache.radix import RadixCache
from radixserve.models.synthetic import build_tiny_model
from radixserve.sampling.stop import StopChecker
from radixserve.scheduler import draft_model, speculative
from radixserve.scheduler.draft_model import DraftModel
from radixserve.scheduler.draft_tree import ROOT, Draft
from radixserve.scheduler.ngram import CANDIDATES, MAX_MATCH, MIN_MATCH, NgramIndex
from radixserve.scheduler.sample import Sample
from radixserve.scheduler.speculative import MAX_PAUSE, MAX_ROWS, MIN_DRAFT, Speculator

TOPK = EngineConfig.speculative_topk
GREEDY = {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 5, "max_new_tokens": 48, "ignore_eos": True}


def make_engine(model_dir: Path, algorithm: str, **kw: Any) -> Engine:
    cfg: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 4096}
    return Engine(str(model_dir), speculative_algorithm=algorithm, **{**cfg, **kw})


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 20000, (16 + 5 * i,), generator=g).tolist() for i in range(n)]


def ids_of(out: Any) -> list[list[int]]:
    return [o["output_ids"] for o in (out if isinstance(out, list) else [out])]


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> Engine:
    return make_engine(tiny_model_dir, "none")


@pytest.fixture(scope="module")
def spec(tiny_model_dir: Path) -> Engine:
    return make_engine(tiny_model_dir, "auto")


CASES = {
    "greedy-batch": (prompts(6), GREEDY, {}),
    "seeded-batch": (prompts(6, seed=1), SEEDED, {}),
    "greedy-n4": (prompts(1, seed=2)[0], {**GREEDY, "n": 4}, {}),
    "seeded-n4": (prompts(1, seed=3)[0], {**SEEDED, "n": 4}, {}),
    "logprobs": (prompts(2, seed=4), GREEDY, {"return_logprob": True, "top_logprobs_num": 3}),
    "penalties": (prompts(3, seed=5), {**GREEDY, "repetition_penalty": 1.3}, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_tokens_with_and_without_drafts(plain: Engine, spec: Engine, case: str) -> None:
    """Run twice with drafts: the second run finds the first one's outputs in the radix cache
    and drafts them whole."""
    ids, params, kw = CASES[case]
    reference = plain.generate(input_ids=ids, sampling_params=params, **kw)
    before = spec.scheduler.stats().accepted_draft_tokens_total
    for _ in range(2):
        out = spec.generate(input_ids=ids, sampling_params=params, **kw)
        assert ids_of(out) == ids_of(reference)
    assert spec.scheduler.stats().accepted_draft_tokens_total > before
    if kw.get("return_logprob"):
        for o, r in zip(out, reference):
            got = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
            want = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(want, abs=1e-4)
    assert_all_free(spec)
    assert_all_free(plain)


def random_tree(rng: random.Random, truth: list[int], k: int) -> tuple[Draft, int]:
    """A tree of k nodes under random parents: a node under one on the path of `truth` (the
    tokens plain decoding draws next) holds truth's next token half the time, else a token
    off it; and the depth of truth's path in the tree."""
    tokens: list[int] = []
    parents: list[int] = []
    on_truth = {ROOT: 0}  # the nodes on truth's path, by depth
    while len(tokens) < k:
        parent = rng.choice([ROOT, *range(len(tokens))])
        taken = {t for t, p in zip(tokens, parents) if p == parent}
        depth = on_truth.get(parent)
        want = truth[depth] if depth is not None and depth < len(truth) else None
        if want is not None and want not in taken and rng.random() < 0.5:
            on_truth[len(tokens)] = depth + 1 if depth is not None else 0
            token = want
        else:
            token = rng.randrange(100, 20000)
            if token in taken or token == want:
                continue
        tokens.append(token)
        parents.append(parent)
    return Draft(tokens, parents), max(on_truth.values())


def check_random_trees(plain: Engine, spec: Engine, case: str, seed: int) -> None:
    """Every step drafts random trees holding part of what plain decoding draws (the
    oracle), on random branches: the output is the oracle's, and each step keeps exactly
    the depth of the oracle's path in its tree."""
    ids, params, kw = CASES[case]
    reference = ids_of(plain.generate(input_ids=ids, sampling_params=params, **kw))
    prompts_of = [ids] if isinstance(ids[0], int) else ids
    n = params.get("n", 1)
    truth = {
        (tuple(p), i): reference[j * n + i] for j, p in enumerate(prompts_of) for i in range(n)
    }
    rng = random.Random(seed)
    expected = 0  # tokens the trees' oracle paths hold

    def propose(samples: list[Sample], room: int) -> list[Draft]:
        nonlocal expected
        drafts = []
        for req in samples:
            out = req.output_ids
            left = req.sampling.max_new_tokens - len(out) - 1
            tree, depth = random_tree(
                rng,
                truth[(tuple(req.prompt_ids), req.index)][len(out) :],
                min(rng.randint(1, 8), room, left),
            )
            drafts.append(tree)
            room -= len(tree)
            expected += depth
        return drafts

    speculator = spec.scheduler.speculator
    speculator.propose = propose  # type: ignore[method-assign]
    try:
        before = spec.scheduler.stats().accepted_draft_tokens_total
        out = spec.generate(input_ids=ids, sampling_params=params, **kw)
    finally:
        del speculator.propose
    assert ids_of(out) == reference
    assert spec.scheduler.stats().accepted_draft_tokens_total - before == expected > 0
    assert_all_free(spec)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("case", ["greedy-batch", "seeded-batch", "greedy-n4", "seeded-n4"])
def test_random_trees_keep_what_plain_decoding_draws(
    plain: Engine, spec: Engine, case: str, seed: int
) -> None:
    check_random_trees(plain, spec, case, seed)


TRITON_TREE_CASES = ("greedy-batch", "seeded-n4")


def run_triton_trees(model_dir: Path) -> None:
    """Child side of the test below: random trees through the Triton attention kernels."""
    plain = make_engine(model_dir, "none", attention_kernels="triton")
    spec = make_engine(model_dir, "auto", attention_kernels="triton")
    for case in TRITON_TREE_CASES:
        check_random_trees(plain, spec, case, seed=0)
        print(f"ok {case}", flush=True)
    assert kernels.resolve_impl(torch.empty(0)) == "triton"
    assert "radixserve.kernels.triton_ops" in sys.modules  # imported by the first op call


@pytest.mark.slow  # the Triton kernels under the interpreter, in a subprocess (~1 min)
def test_random_trees_through_the_triton_kernels(tiny_model_dir: Path) -> None:
    """The Triton path (its kernels run by Triton's CPU interpreter) verifies tree rows as
    the native kernels do: random trees give plain decoding's tokens and keep exactly the
    oracle's depth; in a child process (this file run as a script)."""
    out = run_under_triton_interpreter(__file__, "--triton-trees", str(tiny_model_dir), timeout=600)
    assert out.split() == [w for c in TRITON_TREE_CASES for w in ("ok", c)], out


def test_a_repeated_request_is_drafted_from_the_radix_cache(plain: Engine, spec: Engine) -> None:
    ids = prompts(1, seed=9)[0]
    first = spec.generate(input_ids=ids, sampling_params=GREEDY)
    stats = spec.scheduler.stats()
    computed = stats.computed_tokens_total
    second = spec.generate(input_ids=ids, sampling_params=GREEDY)
    after = spec.scheduler.stats()
    want = plain.generate(input_ids=ids, sampling_params=GREEDY)
    assert ids_of(second) == ids_of(first) == ids_of(want)
    # 47 tokens after the first in 6 steps (5 with 8 draft tokens, the last with 1), every
    # draft token accepted
    accepted = after.accepted_draft_tokens_total - stats.accepted_draft_tokens_total
    assert accepted == after.draft_tokens_total - stats.draft_tokens_total == 41
    assert after.computed_tokens_total - computed == 1 + 47  # nothing computed twice
    assert_all_free(spec)


def test_a_step_with_drafts_holds_at_most_max_rows(
    plain: Engine, spec: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 repeated requests, every one drafted whole from the radix cache: the drafts of a
    step share MAX_ROWS rows with the decoding samples' own, and the tokens stay the same."""
    ids = prompts(12, seed=8)
    reference = plain.generate(input_ids=ids, sampling_params=GREEDY)
    spec.generate(input_ids=ids, sampling_params=GREEDY)  # now in the radix cache
    widths = drafted_step_rows(spec, monkeypatch)
    assert ids_of(spec.generate(input_ids=ids, sampling_params=GREEDY)) == ids_of(reference)
    assert widths and max(widths) <= MAX_ROWS, widths
    assert_all_free(spec)


def drafted_step_rows(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the rows of each step of `engine` with drafts (all of them: the
    running samples', drafts, admissions and encode chunks)."""
    widths: list[int] = []
    schedule = engine.scheduler._schedule

    def recorded() -> Any:
        work, chunks = schedule()
        if any(w.req.draft for w in work):
            widths.append(sum(w.n for w in work) + sum(c.n for c in chunks))
        return work, chunks

    monkeypatch.setattr(engine.scheduler, "_schedule", recorded)
    return widths


def test_no_drafts_beside_a_prefill(
    plain: Engine, spec: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repeated request decodes with drafts from the radix cache while 8 requests that
    share an uncached prefix are admitted one step after the first of them: no step holds
    those drafts beside their prefills (in a bf16 model such a step's rows take bf16 tiles,
    which round otherwise than the plain steps that compute those positions)."""
    spec.flush_cache()
    repeated, shared = prompts(1, seed=9)[0], prompts(1, seed=10)[0] * 3  # 48 tokens
    batch = [repeated] + [shared + p[:4] for p in prompts(8, seed=11)]
    spec.generate(input_ids=repeated, sampling_params=GREEDY)  # now in the radix cache
    widths = drafted_step_rows(spec, monkeypatch)
    before = spec.scheduler.stats().accepted_draft_tokens_total
    out = spec.generate(input_ids=batch, sampling_params=GREEDY)
    assert ids_of(out) == ids_of(plain.generate(input_ids=batch, sampling_params=GREEDY))
    assert spec.scheduler.stats().accepted_draft_tokens_total > before
    assert widths and max(widths) <= MAX_ROWS, widths
    assert_all_free(spec)


def test_stop_string_inside_an_accepted_draft(plain: Engine, spec: Engine) -> None:
    ids = prompts(1, seed=6)[0]
    full = plain.generate(input_ids=ids, sampling_params=GREEDY)
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    params = {**GREEDY, "stop": [stop]}
    want = plain.generate(input_ids=ids, sampling_params=params)
    spec.generate(input_ids=ids, sampling_params=GREEDY)  # the whole output is cached now
    got = spec.generate(input_ids=ids, sampling_params=params)
    assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
    assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert_all_free(spec)


def test_a_regex_constrains_every_drafted_position(plain: Engine, spec: Engine) -> None:
    """A draft token the grammar forbids is never drawn: the draft (the unconstrained
    output, cached) ends there."""
    ids = prompts(1, seed=7)[0]
    params = {"temperature": 0, "max_new_tokens": 40, "regex": "[a-z ]{1,60}"}
    spec.generate(input_ids=ids, sampling_params=GREEDY)
    want = plain.generate(input_ids=ids, sampling_params=params)
    got = spec.generate(input_ids=ids, sampling_params=params)
    assert got["output_ids"] == want["output_ids"]
    assert_all_free(spec)


def test_drafts_in_a_pool_that_retracts(tiny_model_dir: Path, plain: Engine) -> None:
    small = make_engine(tiny_model_dir, "auto", max_total_tokens=160)
    ids = prompts(8)
    want = ids_of(plain.generate(input_ids=ids, sampling_params=GREEDY))
    for _ in range(2):
        assert ids_of(small.generate(input_ids=ids, sampling_params=GREEDY)) == want
    assert_all_free(small)


def test_a_sample_repeating_itself_is_drafted_from_its_own_tokens(
    tiny_model_dir: Path, plain: Engine
) -> None:
    """A regex that makes the output repeat a phrase: the n-gram drafter proposes the
    phrase's next tokens from the sample's own output (no radix cache to draft from)."""
    ngram = make_engine(tiny_model_dir, "ngram", disable_radix_cache=True)
    ids = prompts(1, seed=8)[0]
    params = {"temperature": 0, "max_new_tokens": 64, "regex": "(radix tree )+"}
    want = plain.generate(input_ids=ids, sampling_params=params)
    got = ngram.generate(input_ids=ids, sampling_params=params)
    assert got["output_ids"] == want["output_ids"]
    assert got["text"].startswith("radix tree radix tree radix tree")
    stats = ngram.scheduler.stats()  # the random model spells the phrase several ways
    assert stats.draft_tokens_total > stats.accepted_draft_tokens_total > 0
    assert_all_free(ngram)


@pytest.mark.slow
def test_the_embedded_model_copies_code_with_drafts() -> None:
    """bf16 where the CPU has it: a rewrite of a function in the prompt, the same tokens
    with n-gram drafts as without, most of them drafted."""
    code = (
        "def add_numbers(first_value, second_value):\n"
        "    total = first_value + second_value\n"
        "    print('the total is', total)\n"
        "    return total\n"
    )
    text = f"Rewrite this function with first_value renamed to a:\n\n{code}"
    params = {"temperature": 0, "max_new_tokens": 96}
    outs = []
    for algorithm in ("none", "ngram"):
        engine = Engine(None, speculative_algorithm=algorithm, max_total_tokens=4096)
        outs.append(engine.generate(prompt=text, sampling_params=params))
        stats = engine.scheduler.stats()
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert stats.accepted_draft_tokens_total > 0


# ---------------------------------------------------------------- a draft model


@pytest.fixture
def free_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draft model's steps measured as taking no time: the tiny draft models cost as
    much as the tiny model they draft for, and would otherwise draft only for a sample
    decoding alone (test_a_draft_model_drafts_only_where_it_pays)."""
    monkeypatch.setattr(draft_model, "ema", lambda average, sample: 0.0)


@pytest.fixture(scope="module")
def self_drafted(tiny_model_dir: Path) -> Engine:
    """Drafts from a model of the same weights: every greedy draft is kept."""
    return make_engine(
        tiny_model_dir, "draft-model", speculative_draft_model_path=str(tiny_model_dir)
    )


@pytest.fixture(scope="module")
def other_drafted(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """Drafts from a model of other weights: nearly every draft fails at once."""
    other = build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1)
    return make_engine(tiny_model_dir, "draft-model", speculative_draft_model_path=str(other))


@pytest.mark.usefixtures("free_drafts")
@pytest.mark.parametrize("case", list(CASES))
def test_same_tokens_with_a_draft_model(
    plain: Engine,
    self_drafted: Engine,
    other_drafted: Engine,
    case: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy, a draft model of the same weights has its chain (each node's first child,
    its likeliest) kept whole, and none of the leaves beside it."""
    ids, params, kw = CASES[case]
    reference = plain.generate(input_ids=ids, sampling_params=params, **kw)
    chains = drafted_chains(self_drafted, monkeypatch)
    kept = []
    for engine in (self_drafted, other_drafted):
        before = engine.scheduler.stats()
        out = engine.generate(input_ids=ids, sampling_params=params, **kw)
        after = engine.scheduler.stats()
        assert ids_of(out) == ids_of(reference)
        proposed = after.draft_tokens_total - before.draft_tokens_total
        kept.append(after.accepted_draft_tokens_total - before.accepted_draft_tokens_total)
        assert proposed > 0
        assert_all_free(engine)
        if kw.get("return_logprob"):
            for o, r in zip(out, reference):
                got = [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
                want = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]]
                assert got == pytest.approx(want, abs=1e-4)
        if engine is self_drafted and params["temperature"] == 0 and case != "penalties":
            assert kept[0] == sum(chains) < proposed  # greedy drafts of the model itself
    assert kept[0] > kept[1]


def drafted_chains(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the length of the chain of first children of each tree `engine`
    drafts."""
    chains: list[int] = []
    propose = engine.scheduler.speculator.propose

    def recorded(samples: list[Sample], room: int) -> list[Draft]:
        drafts = propose(samples, room)
        for tree in drafts:
            at, n = ROOT, 0
            while (at := next((i for i, p in enumerate(tree.parents) if p == at), -2)) >= 0:
                n += 1
            chains.append(n)
        return drafts

    monkeypatch.setattr(engine.scheduler.speculator, "propose", recorded)
    return chains


@pytest.mark.usefixtures("free_drafts")
def test_a_draft_model_drafts_in_a_pool_that_retracts(tiny_model_dir: Path, plain: Engine) -> None:
    small = make_engine(
        tiny_model_dir,
        "draft-model",
        speculative_draft_model_path=str(tiny_model_dir),
        max_total_tokens=160,
    )
    ids = prompts(8)
    want = ids_of(plain.generate(input_ids=ids, sampling_params=GREEDY))
    assert ids_of(small.generate(input_ids=ids, sampling_params=GREEDY)) == want
    assert small.scheduler.stats().accepted_draft_tokens_total > 0
    drafter = small.scheduler.speculator.drafter
    assert drafter is not None and drafter.agree > 0.9  # its own weights: measured so
    assert_all_free(small)


@pytest.mark.usefixtures("free_drafts")
def test_samples_of_one_prompt_share_its_draft_model_kv(
    plain: Engine, self_drafted: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = prompts(1, seed=11)[0] * 12  # 192 tokens
    params = {**SEEDED, "n": 4}
    drafter = self_drafted.scheduler.speculator.drafter
    assert drafter is not None
    held: list[int] = []
    draft = drafter.draft

    def recorded(wants: list[tuple[Sample, int]], topk: int) -> list[Draft]:
        out = draft(wants, topk)
        held.append(drafter.worker.pool.capacity - drafter.worker.pool.num_free)
        return out

    monkeypatch.setattr(drafter, "draft", recorded)
    out = self_drafted.generate(input_ids=ids, sampling_params=params)
    assert ids_of(out) == ids_of(plain.generate(input_ids=ids, sampling_params=params))
    # the prompt once, and each sample's own tokens (48 at most, and a draft's 8)
    assert 4 * 56 > max(held) - len(ids) > 0
    assert_all_free(self_drafted)


def test_a_draft_model_drafts_only_where_it_pays(self_drafted: Engine) -> None:
    """A draft model step that costs as much as one row of the model's step pays alone (a
    step's own cost is STEP_ROWS rows), not beside STEP_ROWS - 1 other rows."""
    assert self_drafted.scheduler.speculator.drafter is not None
    worker = self_drafted.scheduler.speculator.drafter.worker
    speculator = Speculator(
        "draft-model", 8, TOPK, self_drafted.scheduler.cache, DraftModel(worker)
    )
    params = SamplingParams(max_new_tokens=100)
    req = Sample(TokenizedRequest("r", prompts(1)[0], params), 0, StopChecker(params, [], None))
    req.append_output(11)
    for rows, drafts in [
        (1, True),
        (speculative.STEP_ROWS - 1, True),
        (speculative.STEP_ROWS, False),
    ]:
        speculator.next_step(rows)
        speculator.row_s = speculator.drafter.step_s = 1e-3  # as if measured
        assert bool(speculator.propose([req], room=8)[0]) == drafts, rows
    speculator.keep_only([])
    assert worker.pool.num_free == worker.pool.capacity


def test_a_draft_model_must_share_the_vocabulary(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.vocab_size += 64
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="speculative_draft_model_path: .* vocabulary"):
        make_engine(tiny_model_dir, "draft-model", speculative_draft_model_path=str(tmp_path))
    with pytest.raises(ValueError, match="go together"):
        make_engine(tiny_model_dir, "draft-model")
    with pytest.raises(ValueError, match="go together"):
        make_engine(tiny_model_dir, "auto", speculative_draft_model_path=str(tiny_model_dir))


def test_a_draft_model_must_give_each_id_the_same_token(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Same vocabulary size, two token ids swapped: refused, naming the id and both tokens."""
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    tokenizer = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    by_id = {i: token for token, i in vocab.items()}
    vocab[by_id[1000]], vocab[by_id[1001]] = 1001, 1000
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer))
    want = f"token id 1000 is {by_id[1001]!r} in the draft model's tokenizer, {by_id[1000]!r}"
    with pytest.raises(ValueError, match=re.escape(want)):
        make_engine(tiny_model_dir, "draft-model", speculative_draft_model_path=str(tmp_path))


@pytest.mark.usefixtures("free_drafts")
def test_drafts_stop_where_the_draft_models_context_ends(
    tiny_model_dir: Path,
    plain: Engine,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model's own weights with a context of 64 positions: samples that run past it
    get the draft model's drafts until then and none after, with the same tokens."""
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with caplog.at_level(logging.WARNING):
        short = make_engine(
            tiny_model_dir, "draft-model", speculative_draft_model_path=str(tmp_path)
        )
    assert "the draft model's context is 64 positions, the model's 1024" in caplog.text
    drafter = short.scheduler.speculator.drafter
    assert drafter is not None
    ends: list[int] = []  # of each draft: its sample's tokens and the draft's depth
    draft = drafter.draft

    def recorded(wants: list[tuple[Sample, int]], topk: int) -> list[Draft]:
        trees = draft(wants, topk)
        ends.extend(req.seq_len + tree.depth for (req, _), tree in zip(wants, trees) if tree)
        return trees

    monkeypatch.setattr(drafter, "draft", recorded)
    ids = prompts(3)  # 16, 21 and 26 tokens, then 48 each
    out = short.generate(input_ids=ids, sampling_params=GREEDY)
    assert ids_of(out) == ids_of(plain.generate(input_ids=ids, sampling_params=GREEDY))
    # the last drafted token the draft model was fed sits at position seq_len + depth - 2
    assert ends and max(ends) - 2 <= 63
    assert short.scheduler.stats().accepted_draft_tokens_total > 0
    assert_all_free(short)


def test_a_draft_model_step_that_raises_fails_its_requests_only(
    plain: Engine, self_drafted: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft model's forward raises: the requests of that step end with an error naming
    it, both pools' slots come back, and the next request is served with drafts."""
    drafter = self_drafted.scheduler.speculator.drafter
    assert drafter is not None
    forward = drafter.worker.forward
    calls = itertools.count()

    def faulty(batch: Any, rows: torch.Tensor) -> torch.Tensor:
        if next(calls) == 3:
            raise RuntimeError("injected fault")
        return forward(batch, rows)

    monkeypatch.setattr(drafter.worker, "forward", faulty)
    with pytest.raises(RuntimeError, match="internal error: RuntimeError: injected fault"):
        self_drafted.generate(input_ids=prompts(2, seed=7), sampling_params=GREEDY)
    assert_all_free(self_drafted)
    ids = prompts(1, seed=8)[0]
    out = self_drafted.generate(input_ids=ids, sampling_params=GREEDY)
    assert ids_of(out) == ids_of(plain.generate(input_ids=ids, sampling_params=GREEDY))
    assert_all_free(self_drafted)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"speculative_topk": 0}, r"speculative_topk must be in \[1, 16\]"),
        ({"speculative_topk": 17}, r"speculative_topk must be in \[1, 16\]"),
        ({"speculative_num_draft_tokens": 65}, r"speculative_num_draft_tokens must be in"),
    ],
)
def test_speculative_settings_are_checked(
    kw: dict[str, Any], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """By the engine, and by the CLI as a usage error naming the setting."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)
    parser = build_parser()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    with pytest.raises(SystemExit):
        config_from_args(parser.parse_args(["serve", *flags]), parser)
    assert re.search(message, capsys.readouterr().err)


# ---------------------------------------------------------------- drafters alone


def direct_draft(ids: list[int], k: int) -> tuple[int, list[list[int]]]:
    """NgramIndex.draft's rule by a direct search: of the latest CANDIDATES earlier
    occurrences of the last two tokens, the longest matches (up to MAX_MATCH), latest
    first."""
    last = len(ids) - 1
    if last < MIN_MATCH or k == 0:
        return 0, []
    ends = [e for e in range(1, last) if ids[e - 1 : e + 1] == ids[last - 1 :]][-CANDIDATES:]

    def match(e: int) -> int:
        m = 0
        while m < MAX_MATCH and m <= e and ids[e - m] == ids[last - m]:
            m += 1
        return m

    if not ends:
        return 0, []
    best = max(map(match, ends))
    return best, [ids[e + 1 : e + 1 + k] for e in reversed(ends) if match(e) == best]


@given(st.lists(st.integers(0, 4), max_size=120), st.integers(1, 10), st.integers(0, 120))
def test_ngram_draft_follows_the_longest_of_the_latest_matches(
    ids: list[int], k: int, grown_from: int
) -> None:
    """Drafted on the whole list at once, or after drafting on a prefix of it (the index
    grows with the list), against the direct search."""
    index = NgramIndex()
    index.draft(ids[:grown_from], k)
    assert index.draft(ids, k) == NgramIndex().draft(ids, k) == direct_draft(ids, k)


def test_continuations_follow_every_branch_the_most_recent_first() -> None:
    pool = KVPool(64, 1, 1, 4, torch.float32)
    cache = RadixCache(pool)

    def insert(tokens: list[int]) -> None:
        slots = pool.alloc(len(tokens))
        assert slots is not None
        cache.insert(tokens, slots)

    insert([1, 2, 3, 4, 5])
    insert([1, 2, 3, 9, 9, 9])
    assert cache.continuations([1, 2], 10) == [[3, 9, 9, 9], [3, 4, 5]]  # the newer first
    assert cache.continuations([1, 2], 2) == [[3, 9], [3, 4]]
    assert cache.continuations([1, 2, 3, 4], 10) == [[5]]
    assert cache.continuations([1, 2, 3, 4, 5], 10) == []  # nothing extends it
    assert cache.continuations([1, 2, 7], 10) == []  # not cached
    assert cache.continuations([1], 2) == [[2, 3]]
    assert cache.continuations([1], 0) == []
    cache.match_prefix([1, 2, 3, 4])  # touched: now the most recent branch
    assert cache.continuations([1, 2, 3], 10) == [[4, 5], [9, 9, 9]]


def test_the_draft_length_follows_what_was_kept() -> None:
    """A request whose last two tokens began its prompt can always be drafted 64 tokens; the
    pace caps them: it starts at the flag, falls to one more than the tokens kept after a
    draft cut short (never below MIN_DRAFT), doubles after a draft kept whole, and a
    MIN_DRAFT draft of which nothing was kept pauses the request 2, 4, ... steps; beside
    other rows, one kept too little to pay for its rows."""
    pool = KVPool(64, 1, 1, 4, torch.float32)
    speculator = Speculator("ngram", 8, TOPK, RadixCache(pool))
    params = SamplingParams(max_new_tokens=1000)
    prompt = [*range(10, 90), 10]
    req = Sample(TokenizedRequest("r", prompt, params), 0, StopChecker(params, [], None))
    req.append_output(11)

    def step(kept: int | None = None, rows: int = 1) -> int:
        """The length of the next step's draft, in a step of `rows` rows without it; `kept`
        of it are then recorded kept."""
        speculator.next_step(rows)
        speculator.keep_only([req])
        [draft] = speculator.propose([req], room=64)
        if draft and kept is not None:
            speculator.record(req, draft, list(range(kept)))  # a chain's first nodes
        return len(draft)

    assert step(kept=3) == 8  # the flag
    assert step(kept=4) == 4  # 3 + 1
    assert step(kept=0) == 8  # kept whole: doubled, within the flag
    assert step(kept=0) == MIN_DRAFT
    assert [step() for _ in range(2)] == [0, MIN_DRAFT]  # a miss at MIN_DRAFT: 2 steps
    assert step(kept=0) == MIN_DRAFT
    assert [step() for _ in range(4)] == [0, 0, 0, MIN_DRAFT]  # a second one: 4
    assert step(kept=1) == MIN_DRAFT
    assert step(kept=0) == MIN_DRAFT  # the count restarted: 2 steps again
    assert [step() for _ in range(2)] == [0, MIN_DRAFT]
    for _ in range(10):
        step(kept=0)
    assert [step() for _ in range(MAX_PAUSE)][-1] == MIN_DRAFT  # never longer than MAX_PAUSE
    assert step(kept=1) == MIN_DRAFT  # alone, half kept pays
    assert step(kept=1, rows=8) == MIN_DRAFT  # beside 7 other rows it does not
    assert [step() for _ in range(2)] == [0, MIN_DRAFT]
    assert step(kept=MIN_DRAFT, rows=8) == MIN_DRAFT
    assert step() == 2 * MIN_DRAFT
    speculator.keep_only([])  # the request is gone: its pace with it
    assert speculator.paces == {}


def test_a_sample_is_drafted_from_text_cached_under_another_prefix() -> None:
    """`radix` drafts what followed the sample's last tokens anywhere in the cache when no
    cached sequence extends its own; `auto` takes that or the sample's own earlier text,
    whichever matches more of its end (its own on a tie); `ngram` never reads the cache."""
    pool = KVPool(256, 1, 1, 4, torch.float32)
    cache = RadixCache(pool, index_suffixes=True)
    answer = [*range(500, 540)]
    cached = [1, 2, 3, *answer]  # an earlier request's prompt and answer
    slots = pool.alloc(len(cached))
    assert slots is not None
    cache.insert(cached, slots)
    params = SamplingParams(max_new_tokens=100)

    def draft(algorithm: str, prompt: list[int], output: list[int]) -> list[int]:
        speculator = Speculator(algorithm, 8, TOPK, cache)
        req = Sample(TokenizedRequest("r", prompt, params), 0, StopChecker(params, [], None))
        for token in output:
            req.append_output(token)
        speculator.next_step(1)
        [found] = speculator.propose([req], room=64)
        assert found.parents == list(range(-1, len(found) - 1))  # one occurrence: a chain
        return found.tokens

    # another prefix (a date), then the start of the same answer
    assert draft("radix", [9, 9, 3], answer[:5]) == answer[5:13]
    assert draft("auto", [9, 9, 3], answer[:5]) == answer[5:13]
    assert draft("ngram", [9, 9, 3], answer[:5]) == []
    # the sample's own text matches 5 tokens of its end (its prompt holds them), the cache 6
    assert draft("auto", [7, *answer[:5], 600, 601, 3], answer[:5]) == answer[5:13]
    # 6 tokens either way: its own text
    own = [3, *answer[:5], 600, 601, 3]
    assert draft("auto", own, answer[:5]) == [600, 601, 3, *answer[:5]]


if __name__ == "__main__" and sys.argv[1:2] == ["--triton-trees"]:
    run_triton_trees(Path(sys.argv[2]))
