"""Prompt modules on a real Engine (tiny random Llama, fp32; the embedded SmolLM2 under
-m slow): module K/V encoded once and shared, exact where the KV is identical, KV
accounting back to baseline, errors, concurrent requests sharing a module segment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import keep_every_segment

from radixserve import Engine
from radixserve.attention.tree_plan import TreePlan, batched_nodes
from radixserve.core.params import SamplingParams
from radixserve.core.request import TokenizedRequest
from radixserve.prompt import pml
from radixserve.scheduler import modules as modules_module

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hum ".split()


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


def docs_schema(name: str = "docs", words: int = 60) -> pml.Schema:
    return pml.schema(
        name,
        pml.role("system", "Answer from the documents."),
        *(pml.module(f"d{i}", pml.role("user", text(words, i))) for i in range(4)),
        pml.module("ask", "Question about ", pml.param("topic", 8), ":"),
        pml.union(pml.module("en", "In English."), pml.module("fr", "En francais.")),
    )


def make_engine(model_dir: Path | None, **kw: Any) -> Engine:
    cfg: dict[str, Any] = {"dtype": "float32", "max_total_tokens": 4096}
    cfg.update(kw)
    return Engine(None if model_dir is None else str(model_dir), **cfg)


def out_ids(result: Any) -> list[int]:
    assert isinstance(result, dict)
    return result["output_ids"]


def assert_baseline(engine: Engine, pinned: int) -> None:
    """Nothing held but the schemas' pinned K/V (and what the radix cache keeps)."""
    engine.check_integrity()
    stats = engine.scheduler.stats()
    assert (stats.kv_held_tokens, stats.kv_module_tokens) == (0, pinned)
    assert engine.flush_cache()
    pool = engine.scheduler.kv.pool
    assert pool.num_free == pool.capacity - pinned


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return make_engine(tiny_model_dir)


def check_one_module_is_exact(engine: Engine) -> None:
    """A module at position 0 followed by the prompt's text has the very K/V a prefill of
    the same tokens computes: greedy outputs equal, reused or not."""
    engine.register_schema(
        '<schema name="one"><module name="doc"><user>' + text(80, 1) + "</user></module></schema>"
    )
    prompt = '<prompt schema="one"><doc/><user>What is it about?</user><assistant/></prompt>'
    reused = engine.generate(pml=prompt, sampling_params=GREEDY)
    full = engine.generate(pml=prompt, sampling_params=GREEDY, module_reuse=False)
    compiled = engine.schemas.prompt(prompt)
    plain = engine.generate(input_ids=compiled.expanded, sampling_params=GREEDY)
    assert out_ids(reused) == out_ids(full) == out_ids(plain)
    assert isinstance(reused, dict) and isinstance(full, dict)
    module_tokens = len(compiled.input_ids) - len(compiled.use.positions)
    assert reused["meta_info"]["cached_tokens"] == module_tokens > 0
    assert reused["meta_info"]["prompt_tokens"] == full["meta_info"]["prompt_tokens"]
    assert_baseline(engine, module_tokens)
    engine.remove_schema("one")
    assert_baseline(engine, 0)


def test_one_module_at_start_equals_full_prefill(engine: Engine) -> None:
    check_one_module_is_exact(engine)


@pytest.mark.slow
def test_one_module_at_start_equals_full_prefill_smollm2() -> None:
    check_one_module_is_exact(make_engine(None, max_total_tokens=2048))


def test_modules_any_order_subset_with_argument(engine: Engine) -> None:
    names = engine.register_schema(docs_schema())
    assert names == ["d0", "d1", "d2", "d3", "ask", "en", "fr"]
    pinned = engine.scheduler.kv.modules.num_slots
    a = pml.prompt("docs", pml.use("d2"), pml.use("d0"), pml.use("ask", topic="foxes"), "Go")
    b = pml.to_pml(
        pml.prompt("docs", pml.use("d0"), pml.use("ask", topic="foxes"), pml.use("d2"), "Go")
    )
    ra, rb = engine.generate(pml=[a, b], sampling_params=GREEDY)
    assert out_ids(ra) == out_ids(rb)  # the order of imports does not matter
    assert ra["meta_info"]["cached_tokens"] > ra["meta_info"]["prompt_tokens"] // 2
    # chunked own text and n > 1 (samples prefill their own text) give the same tokens
    chunked = make_engine(Path(engine.config.model or ""), chunked_prefill_size=16)
    chunked.register_schema(docs_schema())
    long_text = pml.prompt("docs", pml.use("d1"), text(30, 3))
    want = out_ids(engine.generate(pml=long_text, sampling_params=GREEDY))
    assert out_ids(chunked.generate(pml=long_text, sampling_params=GREEDY)) == want
    both = engine.generate(pml=long_text, sampling_params={**GREEDY, "n": 2})
    assert [out_ids(r) for r in both] == [want, want]
    assert_baseline(engine, pinned)
    engine.remove_schema("docs")
    assert_baseline(engine, 0)


def test_concurrent_requests_share_module_segment(engine: Engine) -> None:
    """Nine requests import d3 after none, one or two other documents: d3 sits at three
    offsets in them, and is still ONE segment attended once for all nine (with the system
    text; ~240 tokens, kept here by thresholds at 1: the defaults keep 1024 and up)."""
    engine.register_schema(docs_schema("big", words=230))
    imports = [[pml.use(f"d{j}") for j in range(i % 3)] + [pml.use("d3")] for i in range(9)]
    prompts = [pml.prompt("big", *uses, f"question {i}") for i, uses in enumerate(imports)]
    alone = [out_ids(engine.generate(pml=p, sampling_params=GREEDY)) for p in prompts]
    with keep_every_segment(engine.worker.backend):
        together = engine.generate(pml=prompts, sampling_params=GREEDY)
    assert [out_ids(r) for r in together] == alone
    batch = engine.scheduler.last_batch  # the last decode step: all nine ran together
    assert batch is not None and batch.num_requests == 9
    system, d3 = batch.paths[0]  # one node per module: the system text (""), then d3
    assert all(p[0] == system and p[-1] == d3 for p in batch.paths)
    assert len({sum(n for _, n in p[:-1]) for p in batch.paths}) == 3  # d3's offsets
    plan = batch.attn_plan
    assert isinstance(plan, TreePlan)
    [seg] = [s for s in plan.segments if d3[0] in s.nodes]
    assert seg.requests == tuple(range(9)) and seg.nodes == (system[0], d3[0])
    assert {system[0], d3[0]} <= batched_nodes(batch)
    assert_baseline(engine, engine.scheduler.kv.modules.num_slots)
    engine.remove_schema("big")
    assert_baseline(engine, 0)


def test_errors(engine: Engine) -> None:
    engine.register_schema(docs_schema())
    with pytest.raises(ValueError, match="already registered"):
        engine.register_schema(docs_schema())
    with pytest.raises(ValueError, match="no schema 'nope' is registered"):
        engine.generate(pml='<prompt schema="nope">x</prompt>')
    with pytest.raises(ValueError, match="members of one union"):
        engine.generate(pml=pml.prompt("docs", pml.use("en"), pml.use("fr"), "x"))
    with pytest.raises(ValueError, match="is [0-9]+ tokens; its param holds 8"):
        engine.generate(pml=pml.prompt("docs", pml.use("ask", topic="a " * 9), "x"))
    with pytest.raises(ValueError, match="exactly one of prompt, input_ids or pml"):
        engine.generate("x", pml=pml.prompt("docs", "x"))
    with pytest.raises(ValueError, match="positions, the context holds"):
        engine.register_schema(pml.schema("huge", pml.module("m", "x", pml.param("p", 5000))))
    with pytest.raises(ValueError, match="no prompt logprobs with prompt modules"):
        engine.generate(pml=pml.prompt("docs", "x"), return_logprob=True, logprob_start_len=0)
    # a queued request keeps its schema alive
    ids, use = engine.schemas.token_ids(pml.prompt("docs", pml.use("d0"), "x"), True)
    sched = engine.scheduler
    sched.add_request(TokenizedRequest("held", ids, SamplingParams(max_new_tokens=2), modules=use))
    with pytest.raises(ValueError, match="used by 1 queued or running samples"):
        engine.remove_schema("docs")
    # tokens that are not the schema's modules are refused by the scheduler
    bad = TokenizedRequest(
        "bad", [ids[0] + 1, *ids[1:]], SamplingParams(max_new_tokens=2), modules=use
    )
    with pytest.raises(ValueError, match="not the tokens of schema 'docs'"):
        sched.add_request(bad)
    sched.abort_request("held")
    list(sched.run_until_idle())
    engine.remove_schema("docs")
    with pytest.raises(ValueError, match="no schema 'docs' is registered"):
        engine.remove_schema("docs")
    assert_baseline(engine, 0)


def test_dsl_program_imports_modules(engine: Engine) -> None:
    import radixserve as rs

    backend = rs.EngineBackend(engine)
    names = rs.register_schema(docs_schema("dsl"), backend=backend)
    assert names[:2] == ["d0", "d1"]

    @rs.function
    def ask(s: Any, topic: str) -> None:
        s += rs.imports("dsl", "d1", rs.use("ask", topic=topic))
        s += "Tell me."
        s += rs.gen("answer", max_tokens=8, temperature=0, ignore_eos=True)

    state = ask.run(topic="foxes", backend=backend)
    direct = engine.generate(
        pml=pml.prompt("dsl", pml.use("d1"), pml.use("ask", topic="foxes"), "Tell me."),
        sampling_params=GREEDY,
    )
    assert isinstance(direct, dict)
    assert state["answer"] == direct["text"]
    assert state.get_meta_info("answer")["cached_tokens"] > 0

    @rs.function
    def late(s: Any) -> None:
        s += "text first"
        s += rs.imports("dsl", "d0")

    with pytest.raises(ValueError, match="must come first"):
        late.run(backend=backend)
    backend.call(lambda: engine.remove_schema("dsl"))
    assert_baseline(engine, 0)


def test_retraction_recomputes_own_tokens_at_their_positions(
    engine: Engine, tiny_model_dir: Path
) -> None:
    prompts = [pml.prompt("docs", pml.use(f"d{i % 4}"), f"question {i}") for i in range(6)]
    params = {**GREEDY, "max_new_tokens": 70}
    engine.register_schema(docs_schema())
    alone = [out_ids(engine.generate(pml=p, sampling_params=params)) for p in prompts]
    engine.remove_schema("docs")
    small = make_engine(tiny_model_dir, max_total_tokens=570)  # ~280 pinned, 6 x 73 needed
    small.register_schema(docs_schema())
    pinned = small.scheduler.kv.modules.num_slots
    own = sum(len(small.schemas.prompt(p).use.positions) for p in prompts)
    together = small.generate(pml=prompts, sampling_params=params)
    assert [out_ids(r) for r in together] == alone
    # without retraction: each prompt's own tokens once, then 69 decode steps each; a
    # retracted sample computes its own tokens and its outputs so far again
    assert small.scheduler.stats().computed_tokens_total > own + 6 * 69
    assert_baseline(small, pinned)


def check_encoding_goes_beside_decoding(model_dir: Path | None, words: int) -> None:
    """Registering encodes one chunk per step beside the running requests: a generating
    request gets a token every step of the encoding; a prompt importing the schema
    meanwhile is refused as still being encoded; KV accounting stays exact."""
    small = make_engine(model_dir, chunked_prefill_size=32, max_prefill_tokens=64)
    sched = small.scheduler
    params = SamplingParams(temperature=0, max_new_tokens=1000, ignore_eos=True)
    sched.add_request(TokenizedRequest("running", small.tokenizer.encode("Count: 1 2 3"), params))
    got: list[int] = []
    while not got:
        got += [t for o in sched.step() for t in o.new_token_ids]
    done: list[str | None] = []
    names = small.begin_schema(docs_schema(words=words), done.append)
    need = sum(len(m.token_ids) for m in sched.kv.modules.encoding["docs"].compiled.modules)
    assert names[:2] == ["d0", "d1"] and need > 4 * 32
    use = pml.prompt("docs", pml.use("d0"), "x")
    with pytest.raises(ValueError, match="'docs' is still being encoded"):
        small.generate(pml=use)
    steps = 0
    while not done:
        before = len(got)
        got += [t for o in sched.step() for t in o.new_token_ids]
        assert len(got) == before + 1  # the running request advanced in this step too
        sched.check_integrity()  # the schema's slots count as pinned from the start
        steps += 1
    assert done == [None] and steps >= need // 32  # one chunk (<= 32 tokens) a step
    sched.abort_request("running")
    list(sched.run_until_idle())
    want = out_ids(small.generate(pml=use, sampling_params=GREEDY))
    fresh = make_engine(model_dir)
    fresh.register_schema(docs_schema(words=words))  # encoded alone, in other chunks
    assert out_ids(fresh.generate(pml=use, sampling_params=GREEDY)) == want
    assert_baseline(small, sched.kv.modules.num_slots)


def test_schema_encodes_over_steps_while_a_request_decodes(tiny_model_dir: Path) -> None:
    check_encoding_goes_beside_decoding(tiny_model_dir, 60)


@pytest.mark.slow
def test_schema_encodes_over_steps_while_a_request_decodes_smollm2() -> None:
    check_encoding_goes_beside_decoding(None, 300)


def test_schema_removed_while_encoding(tiny_model_dir: Path) -> None:
    small = make_engine(tiny_model_dir, chunked_prefill_size=16, max_prefill_tokens=16)
    done: list[str | None] = []
    small.begin_schema(docs_schema("late"), done.append)
    with pytest.raises(ValueError, match="already registered"):
        small.register_schema(docs_schema("late"))
    small.scheduler.step()
    assert not done and small.scheduler.schemas()[0]["status"] == "encoding"
    small.remove_schema("late")
    assert done == ["schema 'late' was deleted while it was being encoded"]
    assert not small.scheduler.has_work()
    with pytest.raises(ValueError, match="no schema 'late' is registered"):
        small.generate(pml=pml.prompt("late", pml.use("d0"), "x"))
    assert_baseline(small, 0)
    assert small.register_schema(docs_schema("late"))[:1] == ["d0"]  # the name is free again


def test_schemas_pin_at_most_half_the_pool_and_a_bounded_number(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Schemas are pinned for good: past MAX_SCHEMA_SHARE of the pool, or MAX_SCHEMAS of
    them, a registration is refused and the pool keeps the rest for requests."""
    small = make_engine(tiny_model_dir, max_total_tokens=1000)
    small.register_schema(docs_schema("first"))
    pinned = small.scheduler.kv.modules.num_slots
    assert 250 < pinned <= 500
    with pytest.raises(ValueError, match=r"at most 500 \(50% of the pool\) may be pinned"):
        small.register_schema(docs_schema("second"))
    monkeypatch.setattr(modules_module, "MAX_SCHEMAS", 1)
    with pytest.raises(ValueError, match="1 schemas are registered already"):
        small.register_schema(pml.schema("tiny", pml.module("m", "x")))
    assert small.scheduler.kv.modules.num_slots == pinned
    out = small.generate("a request still fits", {"max_new_tokens": 4, "temperature": 0})
    assert isinstance(out, dict) and out["meta_info"]["completion_tokens"] == 4
