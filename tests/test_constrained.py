"""Constrained decoding (regex / json_schema through outlines-core and llguidance).

Fast tests use the tiny random Llama with the real SmolLM2 tokenizer (fp32): token bytes
round-trip exactly, packed masks round-trip exactly, the sampler masks exactly the tokens the
automaton forbids, and every constrained output fully matches its pattern -- greedy and
sampled, n > 1, in a continuous batch beside unconstrained requests (whose outputs stay
identical to their outputs alone), and across retraction. Patterns are bounded (\\d{1,8},
maxDigits, maxLength) so that every sample must finish with "stop" within max_new_tokens.
The slow tests repeat the pattern checks on the real SmolLM2 (bf16).
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import poll_until

from radixserve import Engine
from radixserve.constrained import (
    BACKENDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarCompiler,
    grammar,
    make_grammar_backend,
    pack_token_mask,
    token_bytes,
    token_mask_bias,
    tokenizer_kind,
    unpack_token_masks,
)
from radixserve.constrained.grammar import COMPILE_TIMEOUT_S, GrammarError
from radixserve.constrained.json_schema import parse_schema
from radixserve.constrained.outlines_backend import schema_to_regex
from radixserve.constrained.vocab import BYTE_LEVEL, SENTENCEPIECE, gpt2_unicode_to_byte
from radixserve.core.params import InvalidRequest, SamplingParams
from radixserve.core.request import FinishReason, TokenizedRequest
from radixserve.sampling import sampler
from radixserve.sampling.sampler import SamplingInfo, process_logits, sample

INTEGER = r"-?\d{1,8}"
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICE = r"(yes|no|maybe)"
PATTERNS = [INTEGER, DATE, CHOICE]
# maxDigits (an outlines extension) and maxLength bound the document: < 100 bytes, so it
# always completes within 128 tokens (every token adds >= 1 byte).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        # maxDigits bounds it for outlines, the range for llguidance (each ignores the other)
        "age": {"type": "integer", "maxDigits": 3, "minimum": -999, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
SCHEMA_REGEX = schema_to_regex(json.dumps(SCHEMA))  # what the automaton accepts
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 1.0, "seed": 7, "n": 3}


# ---- token bytes ---------------------------------------------------------------------


def test_gpt2_byte_table_is_a_bijection() -> None:
    table = gpt2_unicode_to_byte()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["a"] == ord("a")


def test_token_bytes_round_trip_smollm2(tokenizer: Any) -> None:
    assert tokenizer_kind(tokenizer) == BYTE_LEVEL
    tb = token_bytes(tokenizer)
    assert len(tb) == len(tokenizer) == 49152
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    assert {i for i, b in enumerate(tb) if b is None} == special
    # Every other token decodes to exactly its bytes (partial UTF-8 -> U+FFFD both ways).
    decoded = tokenizer.batch_decode(
        [[i] for i in range(len(tb))], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    wrong = [(i, tb[i], decoded[i]) for i in range(len(tb)) if tb[i] is not None]
    wrong = [w for w in wrong if w[1].decode("utf-8", "replace") != w[2]]
    assert wrong == []
    # Multi-byte characters split across tokens: the bytes concatenate to the exact text.
    for text in [
        "héllo wörld",
        "日本語のテキスト",
        "emoji 🤗🚀 done",
        "tabs\tand\nnewlines  x",
        "{'a': 1}",
    ]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(tb[i] for i in ids) == text.encode("utf-8"), text


def _sentencepiece_tokenizer() -> Any:
    """A tiny Llama-2-style tokenizer: Metaspace "▁", byte fallback <0xNN>, no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "h", "l", "o", "w", "r", "d", "▁hello", "▁wörld"]
    model = models.BPE(
        {p: i for i, p in enumerate(pieces)}, [], byte_fallback=True, unk_token="<unk>"
    )
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def test_token_bytes_sentencepiece() -> None:
    tok = _sentencepiece_tokenizer()
    assert tokenizer_kind(tok) == SENTENCEPIECE
    tb = token_bytes(tok)
    vocab = tok.get_vocab()
    assert tb[vocab["<0xE2>"]] == b"\xe2" and tb[vocab["<0x0A>"]] == b"\n"
    assert tb[vocab["▁hello"]] == b" hello" and tb[vocab["▁wörld"]] == " wörld".encode()
    assert tb[vocab["<s>"]] is None and tb[vocab["</s>"]] is None
    # "é" is not a piece: it falls back to its two UTF-8 bytes, which concatenate back.
    ids = tok.encode("hé wörld", add_special_tokens=False)
    assert b"".join(tb[i] for i in ids) == " hé wörld".encode()  # Metaspace prepends "▁"


# ---- masks and the sampler -----------------------------------------------------------


@pytest.mark.parametrize("vocab", [13, 64, 49152])
def test_mask_pack_unpack_exact(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    sets = [torch.randperm(vocab, generator=g)[: k % vocab + 1].tolist() for k in (1, 7, 5000)]
    packed = torch.stack([pack_token_mask(s, vocab) for s in sets])  # (3, ceil(V / 8))
    assert packed.shape == (3, (vocab + 7) // 8) and packed.dtype == torch.uint8
    flags = unpack_token_masks(packed, vocab)  # (3, V)
    for row, s in zip(flags, sets):
        assert row.nonzero()[:, 0].tolist() == sorted(set(s))
    bias = token_mask_bias(packed, vocab, torch.float32)  # (3, V): 0 allowed, -inf not
    assert torch.equal(bias, torch.zeros(3, vocab).masked_fill(~flags, float("-inf")))


@pytest.mark.parametrize("vocab", [13, 49152])
def test_native_mask_equals_the_bias_formula(vocab: int) -> None:
    """sample_cpu.cpp's mask_logits_ (the sampler's CPU path) against token_mask_bias (its
    torch fallback) on random masks, all-allowed and all-forbidden bytes included, applied
    to a subset of the rows; the rows not listed and the allowed logits stay bit-exact."""
    mod = sampler.native_ops()
    if mod is None:
        pytest.skip("native sampling kernels cannot be built here")
    g = torch.Generator().manual_seed(vocab)
    packed = torch.randint(0, 256, (3, (vocab + 7) // 8), dtype=torch.uint8, generator=g)
    packed[0, :2], packed[1, :2] = 0xFF, 0
    packed[:, -1] &= (1 << (vocab - 8 * (packed.shape[1] - 1))) - 1  # no bits past V
    logits = torch.randn(5, vocab, generator=g)
    rows = [3, 0, 4]
    got = logits.clone()
    mod.mask_logits_(got, torch.tensor(rows), packed)
    want = logits.clone()
    want[rows] += token_mask_bias(packed, vocab, torch.float32)
    assert torch.equal(got, want)
    assert torch.isinf(got[0, :16]).all() and torch.equal(got[3, :16], logits[3, :16])


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    """The outlines backend: these tests read its automaton."""
    return GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer), backend="outlines")


def test_sampler_masks_exactly_the_forbidden_tokens(compiler: GrammarCompiler) -> None:
    V = compiler.vocab_size
    grammar = compiler.compile(SamplingParams(regex=CHOICE))
    assert grammar is not None
    allowed = sorted(grammar.index.get_allowed_tokens(grammar.initial))  # "y", "ye", "no", ...
    assert 3 <= len(allowed) < 50 and compiler.end_id not in allowed
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    logits[:, 100] = 50.0  # the unconstrained favourite, forbidden by the pattern

    def info(**params: Any) -> SamplingInfo:
        sp = SamplingParams(**params)
        return SamplingInfo(sp, grammar=compiler.new_state(sp))

    infos = [info(regex=CHOICE, temperature=0), info(regex=CHOICE, seed=3), info(temperature=0)]
    work = process_logits(logits, infos)
    expect = torch.full((V,), float("-inf"))  # row 0 after masking: only `allowed` is left
    expect[allowed] = logits[0, allowed]
    assert torch.equal(work[0], expect) and torch.equal(work[2], logits[2])
    res = sample(logits, infos)
    assert res.next_ids[0].item() == allowed[int(logits[0, allowed].argmax())]
    assert res.next_ids[2].item() == 100
    for seed in range(16):  # sampled constrained rows only ever draw allowed tokens
        infos[1] = info(regex=CHOICE, temperature=1.0, seed=seed)
        assert sample(logits, infos).next_ids[1].item() in allowed
    free = logits[2:]
    assert process_logits(free, infos[2:]) is free  # unconstrained rows: no copy, no mask


def test_grammar_state_walks_and_terminates(compiler: GrammarCompiler, tokenizer: Any) -> None:
    state = compiler.new_state(SamplingParams(regex=CHOICE))
    assert state is not None and not state.terminated
    for tok in tokenizer.encode("maybe", add_special_tokens=False):
        allowed = unpack_token_masks(state.allowed_tokens().unsqueeze(0), compiler.vocab_size)
        assert bool(allowed[0, tok]) and not bool(allowed[0, compiler.end_id])
        state.advance(tok)
    assert state.terminated  # "maybe" is complete: nothing but eos may follow
    with pytest.raises(GrammarError, match="terminated"):
        state.allowed_tokens()


# ---- every backend, one interface -----------------------------------------------------


@pytest.fixture(scope="module")
def backends(tokenizer: Any) -> dict[str, GrammarBackend]:
    eos = frozenset({tokenizer.eos_token_id})
    out = {}
    for name in BACKENDS:
        if name == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
            continue  # an optional extra
        out[name] = make_grammar_backend(
            name, tokenizer, tokenizer.eos_token_id, eos, len(tokenizer)
        )
    return out


@pytest.mark.parametrize(
    ("field", "pattern", "document"),
    [
        ("regex", CHOICE, "maybe"),
        # [0-9], not \d: outlines reads \d as any Unicode digit, xgrammar as ASCII
        ("regex", "[0-9]{4}-[0-9]{2}-[0-9]{2}", "2024-01-31"),
        ("regex", "-?[0-9]{1,8}", "-1234"),
        ("ebnf", 'root ::= ("yes" | "no") ", " [0-9]', "no, 7"),
    ],
    ids=["choice", "date", "int", "ebnf"],
)
def test_backends_allow_the_same_tokens(
    backends: dict[str, GrammarBackend], tokenizer: Any, field: str, pattern: str, document: str
) -> None:
    """Walking one document, every backend allows exactly the same tokens at every step
    (eos included where the pattern is complete) and terminates where nothing can follow."""
    V = len(tokenizer)
    ids = tokenizer.encode(document, add_special_tokens=False)
    walks: dict[str, list[list[int]]] = {}
    for name, backend in backends.items():
        if name == "outlines" and field == "ebnf":
            with pytest.raises(InvalidRequest, match="^ebnf: .*--grammar-backend llguidance"):
                backend.compile(field, pattern)
            continue
        state = backend.compile(field, pattern).new_state()
        steps = []
        for tok in ids:
            allowed = unpack_token_masks(state.allowed_tokens().unsqueeze(0), V)[0]
            steps.append(allowed.nonzero()[:, 0].tolist())
            assert tok in steps[-1], (name, tok)
            state.advance(tok)
        if not state.terminated:  # "\d{1,8}" may go on: eos is allowed, the walk ends
            allowed = unpack_token_masks(state.allowed_tokens().unsqueeze(0), V)[0]
            assert bool(allowed[tokenizer.eos_token_id]), name
            state.advance(tokenizer.eos_token_id)
        assert state.terminated, name
        walks[name] = steps
    reference = next(iter(walks.values()))
    assert len(walks) >= 2 and all(w == reference for w in walks.values()), list(walks)
    assert max(len(step) for step in reference) > 1  # the masks do choose among tokens


@pytest.mark.parametrize("pattern", ["\U00040000", "0\U00040000"])
def test_a_pattern_llguidance_cannot_follow_fails_its_request_with_422(
    tiny_model_dir: Path, pattern: str
) -> None:
    """A 4-byte UTF-8 character against SmolLM2's byte-level vocabulary: llguidance's mask
    offers a continuation byte its matcher then refuses. The request fails alone with a 422
    naming the field (not a 500), and the engine serves the next request."""
    engine = Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=512)
    try:
        with pytest.raises(ValueError, match=r"^regex: the grammar engine cannot follow"):
            engine.generate("0", {"regex": pattern, "max_new_tokens": 8})
        out = engine.generate("0", {"regex": "[a-c]{2}", "max_new_tokens": 8})
        assert len(out["text"]) == 2 and set(out["text"]) <= set("abc")
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"regex": "a("}, r"^regex: invalid regular expression 'a\(': missing \)"),
        ({"regex": "(?=a)b"}, r"^regex: cannot compile '\(\?=a\)b' for constrained decoding"),
        ({"regex": ""}, r"^regex: the pattern matches only the empty string"),
        ({"regex": "a{5000}"}, r"^regex: repetition '\{5000\}' exceeds the limit of 1000"),
        # An escaped backslash before the bound (used to slip past a textual check).
        ({"regex": "\\\\{100000}"}, r"^regex: repetition '\{100000\}' exceeds the limit"),
        ({"regex": "(a{1000}){1000}"}, r"^regex: the pattern is too large to compile: 1000000"),
        ({"regex": "(" * 5000 + ")" * 5000}, r"^regex: the pattern is nested too deeply"),
        ({"regex": "x{99999999999}"}, r"^regex: repetition '\{99999999999\}' exceeds"),
        ({"json_schema": "[" * 60000}, r"^json_schema: the schema is nested too deeply"),
        ({"json_schema": '{"type": "object",'}, r"^json_schema: not valid JSON \(Expecting"),
        ({"json_schema": '{"type": "foo"}'}, r"^json_schema: unsupported schema: .*foo"),
        (
            {"json_schema": '{"type": "string", "pattern": "(("}'},
            r"^json_schema: invalid regular expression",
        ),
    ],
)
def test_invalid_pattern_names_the_field(
    compiler: GrammarCompiler, params: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        compiler.compile(SamplingParams.from_dict(params))


def test_compile_async_runs_off_the_calling_thread(
    compiler: GrammarCompiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pattern not in the cache builds on a compile thread while the caller goes on (the
    scheduler keeps stepping); a cached one, or none, is done at once; failures arrive
    through the future."""
    params = SamplingParams(regex="[a-z]{200}q")
    release = threading.Event()
    builders: list[str] = []
    build = compiler._build

    def held(field: str, text: str) -> CompiledGrammar:  # the real build, once released
        builders.append(threading.current_thread().name)
        assert release.wait(30), "the build was never released"
        return build(field, text)

    monkeypatch.setattr(compiler, "_build", held)
    future = compiler.compile_async(params)
    poll_until(lambda: builders, 30, "the build started")
    assert builders == ["grammar-compile"] and not future.done()  # the caller went on
    release.set()
    assert future.result(timeout=60) is compiler.compile(params)
    assert compiler.compile_async(params).done()
    assert compiler.compile_async(SamplingParams()).result() is None
    bad = compiler.compile_async(SamplingParams(regex="(a{1000}){1000}"))
    assert isinstance(bad.exception(timeout=30), InvalidRequest)


def test_compiles_run_on_a_bounded_number_of_threads(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Patterns that never finish building hold COMPILE_THREADS threads, however many
    arrive; the others wait their turn, and one that waited past its deadline is dropped
    unbuilt."""
    comp = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer))
    release = threading.Event()
    built: list[str] = []

    def stuck(field: str, text: str) -> CompiledGrammar:
        built.append(text)
        release.wait()
        raise InvalidRequest(f"{field}: released")

    monkeypatch.setattr(comp, "_build", stuck)
    before = set(threading.enumerate())
    futures = [comp.compile_async(SamplingParams(regex=f"slow{i}")) for i in range(2)]
    poll_until(lambda: len(built) == 2, 30, lambda: f"both threads building: {built}")
    monkeypatch.setattr(grammar, "COMPILE_TIMEOUT_S", -1.0)  # past its deadline once queued
    futures += [comp.compile_async(SamplingParams(regex=f"slow{i}")) for i in range(2, 12)]
    started = [t for t in set(threading.enumerate()) - before if t.name == "grammar-compile"]
    assert len(started) == 2, started  # grammar.COMPILE_THREADS
    release.set()
    for f in futures[2:]:
        assert isinstance(f.exception(timeout=30), TimeoutError)
    assert built == ["slow0", "slow1"]
    assert all(isinstance(f.exception(timeout=30), InvalidRequest) for f in futures[:2])


def test_index_cache_is_lru(tokenizer: Any) -> None:
    comp = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], len(tokenizer), cache_size=2)
    a, b = (SamplingParams(regex=r) for r in ("a+", "b+"))
    ga, gb = comp.compile(a), comp.compile(b)
    assert comp.compile(a) is ga  # hit; "a+" is now the most recent
    comp.compile(SamplingParams(regex="c+"))  # evicts "b+", the least recent
    assert comp.compile(a) is ga and comp.compile(b) is not gb
    assert comp.compile(SamplingParams()) is None  # unconstrained: nothing to compile


# ---- end to end on the tiny model ------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=4096)


def check_output(out: dict[str, Any], pattern: str, tb: list[bytes | None]) -> str:
    """Assert the sample finished "stop", fully matches, and its text is its tokens' bytes."""
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop", (out["text"], reason)
    text = out["text"]
    assert re.fullmatch(pattern, text), (pattern, text)
    ids = out["output_ids"]
    ids = ids[:-1] if isinstance(reason["matched"], int) else ids  # the eos is not text
    assert b"".join(tb[i] or b"" for i in ids) == text.encode("utf-8")
    return text


def check_json(text: str) -> None:
    doc = json.loads(text)
    assert set(doc) == {"name", "age", "ok"}, doc
    assert isinstance(doc["name"], str) and len(doc["name"]) <= 12
    assert type(doc["age"]) is int and abs(doc["age"]) < 1000
    assert isinstance(doc["ok"], bool)


def as_list(out: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return out if isinstance(out, list) else [out]


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled-n3"])
@pytest.mark.parametrize("pattern", PATTERNS, ids=["int", "date", "choice"])
def test_regex_output_matches(engine: Engine, sampling: dict, pattern: str) -> None:
    tb = token_bytes(engine.tokenizer)
    params = {"regex": pattern, "max_new_tokens": 40, **sampling}
    outs = as_list(engine.generate("The answer is", params))
    assert len(outs) == sampling.get("n", 1)
    for out in outs:
        check_output(out, pattern, tb)
    engine.check_integrity()


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled-n3"])
def test_json_schema_output_parses(engine: Engine, sampling: dict) -> None:
    tb = token_bytes(engine.tokenizer)
    params = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 128, **sampling}
    for out in as_list(engine.generate("A person as JSON:", params)):
        check_json(check_output(out, SCHEMA_REGEX, tb))


def test_ignore_eos_still_stops_when_complete(engine: Engine) -> None:
    out = engine.generate("Pick:", {"regex": CHOICE, "temperature": 0, "ignore_eos": True})
    assert isinstance(out, dict) and out["text"] in ("yes", "no", "maybe")
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": None}


def test_invalid_pattern_via_engine(engine: Engine) -> None:
    with pytest.raises(ValueError, match="^regex: "):
        engine.generate("x", {"regex": "[a-"})
    with pytest.raises(ValueError, match="^json_schema: "):
        engine.generate("x", {"json_schema": "{not json"})
    assert not engine.scheduler.waiting and not engine.scheduler.running
    engine.check_integrity()


def test_a_request_compiling_holds_nothing(engine: Engine) -> None:
    """While its pattern compiles (off the scheduler thread) a request can be aborted, or
    run out of time: either way all its n samples end (abort / error 400)."""
    sched = engine.scheduler
    fast = sched.grammars  # llguidance compiles this in milliseconds: outlines takes seconds
    sched.grammars = GrammarCompiler(
        engine.tokenizer, sched.eos_ids, fast.vocab_size, backend="outlines"
    )
    try:
        _compiling_holds_nothing(engine)
    finally:
        sched.grammars = fast


def _compiling_holds_nothing(engine: Engine) -> None:
    sched = engine.scheduler
    sched.add_request(_request("compiling", "x", engine, regex="[0-9]{41}z", n=2))
    assert len(sched.compiling) == 1 and sched.stats().num_queued == 1
    sched.abort_request("compiling")
    outs = list(sched.run_until_idle())
    assert sorted(o.index for o in outs if o.finished) == [0, 1]
    assert {o.finish_reason.type for o in outs if o.finish_reason} == {"abort"}
    sched.compiling.timeout_s = 0.0
    try:
        sched.add_request(_request("too-slow", "x", engine, regex="[0-9]{42}z"))
        (out,) = sched.run_until_idle()
    finally:
        sched.compiling.timeout_s = COMPILE_TIMEOUT_S
    assert out.finish_reason == FinishReason("error", "regex: did not compile in 0 s", 400)
    assert not sched.has_work()
    engine.check_integrity()


def _drive(engine: Engine, arrivals: dict[int, list[TokenizedRequest]]) -> dict[tuple, Any]:
    """Run the scheduler, adding arrivals[k] before step k: {(rid, index): (ids, reason)}."""
    sched, got, reasons = engine.scheduler, {}, {}
    step = 0
    while step <= max(arrivals) or sched.has_work():
        for req in arrivals.get(step, []):
            sched.add_request(req)
        for out in sched.step():
            got.setdefault((out.rid, out.index), []).extend(out.new_token_ids)
            if out.finished:
                reasons[(out.rid, out.index)] = out.finish_reason
        step += 1
    sched.check_integrity()
    return {k: (ids, reasons[k]) for k, ids in got.items()}


def _request(rid: str, text: str, engine: Engine, **params: Any) -> TokenizedRequest:
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    return TokenizedRequest(rid=rid, input_ids=ids, sampling=SamplingParams(**params))


def test_continuous_batch_beside_unconstrained(engine: Engine) -> None:
    free = {
        "free-greedy": (
            "Once upon a time",
            dict(temperature=0, max_new_tokens=24, ignore_eos=True),
        ),
        "free-seeded": (
            "In a galaxy",
            dict(temperature=1.0, seed=11, n=2, max_new_tokens=20, ignore_eos=True),
        ),
    }
    alone = {}
    for rid, (text, p) in free.items():
        engine.flush_cache()
        alone.update(_drive(engine, {0: [_request(rid, text, engine, **p)]}))
    engine.flush_cache()
    constrained = [
        _request("c-int", "Count:", engine, regex=INTEGER, temperature=0, max_new_tokens=40),
        _request("c-date", "Date:", engine, regex=DATE, temperature=1.0, seed=2, n=2),
        _request("c-json", "JSON:", engine, json_schema=json.dumps(SCHEMA), max_new_tokens=128),
        _request("c-choice", "Pick:", engine, regex=CHOICE, temperature=1.0, seed=4, n=3),
    ]
    first = [_request(rid, text, engine, **p) for rid, (text, p) in free.items()]
    # Constrained requests join while the free ones are decoding (steps 2 and 5).
    mixed = _drive(engine, {0: first, 2: constrained[:2], 5: constrained[2:]})
    for key, (ids, reason) in alone.items():
        assert mixed[key][0] == ids and mixed[key][1] == reason, key
    tb = token_bytes(engine.tokenizer)
    patterns = {"c-int": INTEGER, "c-date": DATE, "c-json": SCHEMA_REGEX, "c-choice": CHOICE}
    assert {k for k in mixed if k[0].startswith("c-")} == {
        ("c-int", 0), ("c-date", 0), ("c-date", 1), ("c-json", 0),
        ("c-choice", 0), ("c-choice", 1), ("c-choice", 2),
    }  # fmt: skip
    for (rid, index), (ids, reason) in mixed.items():
        if rid.startswith("c-"):
            assert reason.type == "stop", (rid, index, reason)
            body = ids[:-1] if isinstance(reason.matched, int) else ids
            text = b"".join(tb[i] or b"" for i in body).decode("utf-8")
            assert re.fullmatch(patterns[rid], text), (rid, text)
            if rid == "c-json":
                check_json(text)


def test_constrained_survives_retraction(tiny_model_dir: Path) -> None:
    eng = Engine(str(tiny_model_dir), dtype="float32", max_total_tokens=160)
    tb = token_bytes(eng.tokenizer)
    prompts = [f"Record number {i} of the list, written as JSON:" for i in range(6)]
    params = {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 128}
    params_list = [{**params, "temperature": 1.0, "seed": i} for i in range(6)]
    outs = eng.generate(prompts, params_list)
    assert isinstance(outs, list) and len(outs) == 6
    for out in outs:
        check_json(check_output(out, SCHEMA_REGEX, tb))
    lens = [len(eng.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    computed_alone = sum(n + len(o["output_ids"]) - 1 for n, o in zip(lens, outs))
    # Retraction re-queues samples, whose evicted K/V is computed again.
    assert eng.scheduler.stats().computed_tokens_total > computed_alone
    eng.check_integrity()


# ---- the real SmolLM2 (slow) -----------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> Engine:
    return Engine()


def _chat(engine: Engine, question: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": question}])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("question", "pattern"),
    [
        ("How many legs does a spider have? Answer with a number.", INTEGER),
        ("On which date did the Apollo 11 landing happen? Answer as YYYY-MM-DD.", DATE),
        ("Is the sky blue on a clear day? Answer yes, no or maybe.", CHOICE),
    ],
    ids=["int", "date", "choice"],
)
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled-n3"])
def test_smollm2_regex(smol: Engine, question: str, pattern: str, sampling: dict) -> None:
    tb = token_bytes(smol.tokenizer)
    params = {"regex": pattern, "max_new_tokens": 40, **sampling}
    for out in as_list(smol.generate(_chat(smol, question), params)):
        check_output(out, pattern, tb)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled-n3"])
def test_smollm2_json_schema(smol: Engine, sampling: dict) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer"},
            "city": {"type": "string", "maxLength": 20},
        },
        "required": ["name", "age", "city"],
    }
    tb = token_bytes(smol.tokenizer)
    question = "Describe Alice, a 30 year old from Paris, as a JSON object."
    params = {"json_schema": json.dumps(schema), "max_new_tokens": 96, **sampling}
    for out in as_list(smol.generate(_chat(smol, question), params)):
        doc = json.loads(check_output(out, schema_to_regex(json.dumps(schema)), tb))
        assert set(doc) == {"name", "age", "city"}, doc
        assert isinstance(doc["name"], str) and isinstance(doc["city"], str)
        assert type(doc["age"]) is int


NO_FINITE_DOCUMENT = {
    "required self-reference": {"type": "object", "properties": {"x": {"$ref": "#"}},
                                "required": ["x"]},
    "required cycle through $defs": {
        "$ref": "#/$defs/a",
        "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}},
                        "required": ["b"]},
                  "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                        "required": ["a"]}},
    },
    "a $ref to itself": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "every anyOf branch cycles": {"anyOf": [{"$ref": "#"}, {"type": "array", "minItems": 1,
                                                          "items": {"$ref": "#"}}]},
}  # fmt: skip
FINITE = {
    "an optional child": {"type": "object", "properties": {"child": {"$ref": "#"}}},
    "a list that may end": {
        "$defs": {"node": {"type": "object", "required": ["next"], "properties": {
            "next": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/node"}]}}}},
        "$ref": "#/$defs/node",
    },
    "an array that may be empty": {"type": "array", "items": {"$ref": "#"}},
}  # fmt: skip


@pytest.mark.parametrize("name", list(NO_FINITE_DOCUMENT))
def test_a_schema_without_finite_documents_is_refused_by_every_backend(
    backends: dict[str, GrammarBackend], name: str
) -> None:
    text = json.dumps(NO_FINITE_DOCUMENT[name])
    for backend in backends.values():
        with pytest.raises(InvalidRequest, match="^json_schema: no finite document matches it"):
            backend.compile("json_schema", text)


@pytest.mark.parametrize("name", list(FINITE))
def test_recursive_schemas_with_an_exit_compile(name: str) -> None:
    assert parse_schema(json.dumps(FINITE[name])) == FINITE[name]
