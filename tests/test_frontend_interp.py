"""The frontend interpreter without a model: programs run on the TracingBackend, which
records each request (exact prompt text and sampling parameters) and answers with
placeholders ("{name}" for a gen, the first option for a select). Also: role markup derived
from real chat templates, and the choice methods of select."""

from __future__ import annotations

import json
import math
import random
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import poll_until

import radixserve.frontend as rs
from radixserve.frontend.choices import ChoiceScores, choose
from radixserve.frontend.ir import (
    REGEX_INT,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    Text,
    convert_value,
)
from radixserve.prompt.roles import RoleTemplate, template_for

PLAIN_DEFAULTS = {
    "max_new_tokens": 128,
    "stop": [],
    "stop_token_ids": [],
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": False,
}


def gens(trace: rs.Trace) -> list[Any]:
    return [e.request for e in trace.of_kind("gen")]


# ---------------------------------------------------------------- expressions and params


def test_concatenation_builds_flat_expression_lists() -> None:
    e = "Q: " + rs.gen("a") + "\nA: " + rs.select("b", ["x", "y"])
    assert isinstance(e, ExprList)
    kinds = [type(x) for x in e.items]
    assert kinds == [Text, Gen, Text, Select]
    assert [x.value for x in e.items if isinstance(x, Text)] == ["Q: ", "\nA: "]
    u = rs.user("hi" + rs.gen("r"))
    assert isinstance(u, ExprList)
    assert [type(x) for x in u.items] == [RoleBegin, ExprList, RoleEnd]
    with pytest.raises(TypeError, match="cannot append int"):
        _ = rs.gen("a") + 3  # type: ignore[operator]


def test_sampling_parameters_layer_run_defaults_then_gen() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "A" + rs.gen("a")
        s += "B" + rs.gen("b", max_tokens=3, stop="\n", temperature=0, top_k=5, seed=11)

    t = prog.trace(temperature=0.3, max_new_tokens=7, stop=["##"], ignore_eos=True)
    a, b = gens(t)
    assert a.prompt == "A" and b.prompt == "A{a}B"
    assert a.sampling == {
        **PLAIN_DEFAULTS,
        "temperature": 0.3,
        "max_new_tokens": 7,
        "stop": ["##"],
        "ignore_eos": True,
    }
    assert b.sampling == {
        **PLAIN_DEFAULTS,
        "temperature": 0.0,
        "max_new_tokens": 3,
        "stop": ["\n"],
        "top_k": 5,
        "seed": 11,
        "ignore_eos": True,
    }
    assert t.state.text() == "A{a}B{b}"
    assert (t.state["a"], t.state["b"]) == ("{a}", "{b}")


def test_logprob_options_are_request_level() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "x" + rs.gen("a", return_logprob=True, top_logprobs_num=3, logprob_start_len=0)

    (req,) = gens(prog.trace())
    assert (req.return_logprob, req.top_logprobs_num, req.logprob_start_len) == (True, 3, 0)
    assert "return_logprob" not in req.sampling and "top_logprobs_num" not in req.sampling


def test_regex_and_json_schema_reach_the_request() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}

    @rs.function
    def prog(s: Any) -> None:
        s += "a" + rs.gen("r", regex=r"\d{3}")
        s += "b" + rs.gen("j", json_schema=schema)
        s += "c" + rs.gen("k", json_schema='{"type": "string"}')
        s += "d" + rs.gen("t", dtype=int, regex=r"[0-9]")  # an explicit regex wins

    r, j, k, t = gens(prog.trace())
    assert r.sampling["regex"] == r"\d{3}" and "json_schema" not in r.sampling
    assert json.loads(j.sampling["json_schema"]) == schema and "regex" not in j.sampling
    assert k.sampling["json_schema"] == '{"type": "string"}'
    assert t.sampling["regex"] == "[0-9]" and t.sampling["stop"] == [" ", "\n"]
    with pytest.raises(re.error):
        rs.gen("bad", regex="(unclosed")


@pytest.mark.parametrize(
    ("dtype", "regex", "stop", "placeholder_value"),
    [
        (int, REGEX_INT, [" ", "\n"], 0),
        ("float", r"[-+]?[0-9]*\.?[0-9]+[ \n]*", [" ", "\n"], 0.0),
        (bool, r"(True|False)", [], True),
        (str, r"\"[\w\d\s]*\"", [], ""),
    ],
)
def test_typed_gen_adds_regex_and_converts(
    dtype: Any, regex: str, stop: list, placeholder_value: Any
) -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "v=" + rs.gen("v", dtype=dtype)

    t = prog.trace()
    (req,) = gens(t)
    assert req.sampling["regex"] == regex and req.sampling["stop"] == stop
    value = t.state["v"]
    assert value == placeholder_value and type(value) is type(placeholder_value)


@pytest.mark.parametrize(
    ("text", "dtype", "value"),
    [
        (" 42\n", "int", 42),
        ("-7", "int", -7),
        ("3.25 ", "float", 3.25),
        ("False", "bool", False),
        ('"hi there"', "str", "hi there"),
        ("plain", None, "plain"),
    ],
)
def test_convert_value(text: str, dtype: str | None, value: Any) -> None:
    assert convert_value(text, dtype, "v") == value


def test_convert_value_failure_names_the_gen() -> None:
    with pytest.raises(ValueError, match=r"gen 'count' with dtype=int: the model produced 'many'"):
        convert_value("many", "int", "count")
    with pytest.raises(ValueError, match="dtype must be int, float, str or bool"):
        rs.gen("x", dtype=list)


def test_gen_with_choices_is_a_select() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "Pick: " + rs.gen("c", choices=["red", "blue"])

    t = prog.trace()
    (sel,) = t.of_kind("select")
    assert (sel.prompt, sel.choices) == ("Pick: ", ["red", "blue"])
    assert t.state["c"] == "red" and t.state.text() == "Pick: red"
    assert t.of_kind("gen") == []


# ---------------------------------------------------------------- roles


def test_roles_plain_markup_and_messages() -> None:
    @rs.function
    def as_calls(s: Any) -> None:
        s += rs.system("Be brief.")
        s += rs.user("Hi")
        s += rs.assistant(rs.gen("r"))

    @rs.function
    def as_blocks(s: Any) -> None:
        with s.system():
            s += "Be brief."
        s.user("Hi")
        with s.assistant():
            s += rs.gen("r")

    for prog in (as_calls, as_blocks):
        t = prog.trace()
        assert t.state.text() == "SYSTEM: Be brief.\nUSER: Hi\nASSISTANT: {r}\n"
        assert gens(t)[0].prompt == "SYSTEM: Be brief.\nUSER: Hi\nASSISTANT: "
        assert t.state.messages() == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "{r}"},
        ]


@pytest.mark.parametrize(
    ("exprs", "message"),
    [
        ([rs.user_begin(), rs.assistant_begin()], "role 'assistant' begins inside role 'user'"),
        ([rs.user_begin(), rs.assistant_end()], "role 'assistant' ends but the open role is"),
    ],
)
def test_role_misuse_fails_the_program(exprs: list, message: str) -> None:
    @rs.function
    def prog(s: Any) -> None:
        for e in exprs:
            s += e

    with pytest.raises(ValueError, match=message):
        prog.trace()


def _render(tokenizer: Any, messages: list[dict[str, str]], gen_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)


CONVERSATIONS = [
    [("system", "Be kind."), ("user", "Hi there"), ("assistant", "Hello!"), ("user", "Bye")],
    [("user", "Hi there"), ("assistant", "Hello!"), ("user", "Bye")],  # default system text
]
# A zephyr-like template: no default system message, a BOS at the start.
ZEPHYR = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.mark.parametrize("template", [None, ZEPHYR], ids=["smollm2", "zephyr"])
@pytest.mark.parametrize("turns", CONVERSATIONS, ids=["with-system", "no-system"])
def test_role_markup_reproduces_the_chat_template(
    tiny_model_dir: Path, template: str | None, turns: list[tuple[str, str]]
) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    if template is not None:
        tok.chat_template = template
    markup = template_for(tok)
    text = ""
    for i, (role, content) in enumerate(turns):
        text += markup.begin(role, first=i == 0) + content + markup.end(role)
    messages = [{"role": r, "content": c} for r, c in turns]
    assert text == _render(tok, messages, False)
    # A gen after `assistant` sees exactly the template's generation prompt.
    assert text + markup.begin("assistant", first=False) == _render(tok, messages, True)


def test_template_without_chat_template_is_plain(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = None
    assert template_for(tok) == RoleTemplate.plain()


# ---------------------------------------------------------------- fork and join


def test_fork_commits_the_prefix_once_and_join_gathers_in_order() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "Shared prefix. "
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Branch {i}: " + rs.gen("x")
            f["i"] = i
        forks.join()
        s += "Done."

    t = prog.trace()
    assert [e.prompt for e in t.of_kind("commit")] == ["Shared prefix. "]
    prompts = sorted(r.prompt for r in gens(t))
    assert prompts == [f"Shared prefix. Branch {i}: " for i in range(3)]
    assert t.state["x"] == ["{x}", "{x}", "{x}"]
    assert t.state["i"] == [0, 1, 2]  # fork order, whatever order the children finished in
    assert t.state.text() == "Shared prefix. Done."  # gather_variable does not touch text
    assert (
        t.state.get_meta_info("x")
        == [{"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}] * 3
    )


def test_nested_fork_gathers_lists_of_lists() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "Q. "
        outer = s.fork(2)
        for i, a in enumerate(outer):
            a += f"A{i}. "
            inner = a.fork(3)
            for j, b in enumerate(inner):
                b["leaf"] = (i, j)
                b += rs.gen("g")
            inner.join()
        outer.join()

    t = prog.trace()
    assert t.state["leaf"] == [[(0, 0), (0, 1), (0, 2)], [(1, 0), (1, 1), (1, 2)]]
    assert t.state["g"] == [["{g}"] * 3] * 2
    assert sorted(e.prompt for e in t.of_kind("commit")) == ["Q. ", "Q. A0. ", "Q. A1. "]


def test_group_add_per_child_list_and_concat_join() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "P|"
        forks = s.fork(2)
        forks += ["a" + rs.gen("x"), "b"]
        forks += "!"
        forks.join(mode="concate_and_append")

    t = prog.trace()
    assert t.state.text() == "P|a{x}!b!"
    with pytest.raises(ValueError, match="3 expressions for 2 fork children"):

        @rs.function
        def bad(s: Any) -> None:
            s.fork(2).__iadd__(["a", "b", "c"])

        bad.trace()


def test_joined_children_are_closed() -> None:
    @rs.function
    def prog(s: Any) -> None:
        forks = s.fork(1)
        forks.join()
        forks[0] += "late"

    with pytest.raises(RuntimeError, match="closed"):
        prog.trace()


# ---------------------------------------------------------------- programs


def test_first_parameter_must_be_s_and_bind_and_subroutines() -> None:
    with pytest.raises(TypeError, match="must be 's'"):
        rs.function(lambda state: None)

    @rs.function
    def greet(s: Any, name: str, punct: str = "!") -> str:
        s += f"Hello {name}{punct} " + rs.gen("reply")
        return name.upper()

    @rs.function
    def outer(s: Any) -> None:
        greet(s, "Ann", punct="?")  # a subroutine: runs on this state
        greet(s, "Bo")

    t = outer.trace()
    assert t.state.text() == "Hello Ann? {reply}Hello Bo! {reply}"
    bound = greet.bind(punct=".")
    assert bound.trace("Cy").state.text() == "Hello Cy. {reply}"
    assert bound.trace("Cy").state.ret_value == "CY"
    with pytest.raises(TypeError, match=r"no parameters \['nope'\]"):
        greet.bind(nope=1)


def test_missing_variable_names_the_known_ones() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += rs.gen("a")

    state = prog.trace().state
    with pytest.raises(
        KeyError, match=r"no variable 'b' in this program state \(defined: \['a'\]\)"
    ):
        state["b"]
    assert "a" in state and "b" not in state


def test_run_batch_dicts_tuples_and_isolated_failures() -> None:
    @rs.function
    def prog(s: Any, word: str, n: int = 1) -> None:
        if word == "boom":
            raise RuntimeError("boom in the body")
        s += word * n + rs.gen("g")

    tracer = rs.TracingBackend()
    states = prog.run_batch(
        [{"word": "a"}, ("b", 2), {"word": "boom"}, ("c",)], backend=tracer, num_threads=2
    )
    assert [st.error() is None for st in states] == [True, True, False, True]
    assert str(states[2].error()) == "boom in the body"
    assert [states[i].text() for i in (0, 1, 3)] == ["a{g}", "bb{g}", "c{g}"]
    assert sorted(e.prompt for e in tracer.events if e.kind == "gen") == ["a", "bb", "c"]
    with pytest.raises(TypeError, match="3 arguments"):
        prog.run_batch([("a", 1, 2)], backend=tracer)
    assert prog.run_batch([], backend=tracer) == []


def test_run_batch_progress_bar_and_sampling_defaults(capsys: pytest.CaptureFixture) -> None:
    @rs.function
    def prog(s: Any, word: str) -> None:
        s += word + rs.gen("g")

    tracer = rs.TracingBackend()
    states = prog.run_batch(
        [("x",), ("y",), ("z",)], backend=tracer, progress_bar=True, temperature=0.5
    )
    assert [st.text() for st in states] == ["x{g}", "y{g}", "z{g}"]
    assert all(e.request.sampling["temperature"] == 0.5 for e in tracer.events)
    assert "3/3" in capsys.readouterr().err  # tqdm's counter
    with pytest.raises(TypeError, match=r"run_batch: unknown keywords \['seed'\]"):
        prog.run_batch([("x",)], backend=tracer, seed=1)  # seed is per-gen only


def test_stream_text_iter_all_and_one_variable() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += rs.user("Hi")
        s += rs.assistant(rs.gen("r"))
        s += "tail" + rs.gen("t")

    tracer = rs.TracingBackend()
    state = prog.run(stream=True, backend=tracer)
    pieces = list(state.text_iter())
    assert pieces == ["USER: ", "Hi", "\n", "ASSISTANT: ", "{r}", "\n", "tail", "{t}"]
    assert "".join(pieces) == state.text()
    assert list(state.text_iter("r")) == ["{r}"]


def waiting_in(thread: threading.Thread, function: str) -> bool:
    """Whether `thread` is alive and `function` is on its stack (e.g. blocked inside it)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None and frame.f_code.co_name != function:
        frame = frame.f_back
    return frame is not None


def test_reading_a_streamed_state_waits_for_its_body() -> None:
    """The body is held until a reader outside it is blocked joining the body's thread:
    the read began before the body submitted anything, and still sees its variable."""
    go = threading.Event()

    @rs.function
    def prog(s: Any) -> None:
        assert go.wait(30), "the body was never released"
        s += "late " + rs.gen("x")
        s += "and " + s["x"]  # inside the body, reading must not wait for the body itself

    state = prog.run(stream=True, backend=rs.TracingBackend())
    read: dict[str, Any] = {}
    reader = threading.Thread(target=lambda: read.update(x=state["x"]))
    reader.start()
    poll_until(lambda: waiting_in(reader, "join"), 30, "the read waiting for the body")
    go.set()
    reader.join(30)
    assert read == {"x": "{x}"}
    assert state.text() == "late {x}and {x}"


def test_stream_reraises_the_program_failure_at_the_end() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "before "
        s += rs.user_end()

    state = prog.run(stream=True, backend=rs.TracingBackend())
    it = state.text_iter()
    assert next(it) == "before "
    with pytest.raises(ValueError, match="role 'user' ends"):
        next(it)


def test_default_backend_and_missing_backend() -> None:
    @rs.function
    def prog(s: Any) -> None:
        s += "x" + rs.gen("g")

    import radixserve.frontend.api as api

    previous = rs.get_default_backend()
    try:
        api._default_backend = None
        with pytest.raises(RuntimeError, match="no backend"):
            prog.run()
        tracer = rs.TracingBackend()
        rs.set_default_backend(tracer)
        assert prog.run()["g"] == "{g}" and len(tracer.events) == 1
        with pytest.raises(TypeError, match="a backend must be"):
            rs.set_default_backend("http://nope")
    finally:
        api._default_backend = previous


# ---------------------------------------------------------------- choice methods


def scores(*options: list[tuple[int, float]]) -> ChoiceScores:
    return ChoiceScores(
        [f"c{i}" for i in range(len(options))],
        [[t for t, _ in o] for o in options],
        [[lp for _, lp in o] for o in options],
    )


def test_token_length_normalized_picks_best_mean() -> None:
    sc = scores([(1, -2.0), (2, -2.0)], [(3, -1.0), (4, -4.0)], [(5, -1.9)])
    assert sc.normalized == [-2.0, -2.5, -1.9]
    assert rs.token_length_normalized.decide(sc) == 2
    tie = scores([(1, -1.0)], [(2, -1.0)])
    assert rs.token_length_normalized.decide(tie) == 0  # ties: the first


def test_greedy_token_selection_follows_the_greedy_path() -> None:
    # Options 0 and 1 share their first token (7); option 2's first token is less likely.
    # Greedy takes token 7, then prefers option 1's second token.
    sc = scores([(7, -0.1), (8, -3.0)], [(7, -0.1), (9, -0.5)], [(5, -0.2)])
    assert rs.greedy_token_selection.decide(sc) == 1
    assert rs.token_length_normalized.decide(sc) == 2  # the methods really differ here
    # An option that ended competes with its mean against the best next token.
    short = scores([(7, -0.1)], [(7, -0.1), (9, -0.5)])
    assert rs.greedy_token_selection.decide(short) == 0


def test_select_temperature_samples_softmax_of_means() -> None:
    sc = scores([(1, -1.0)], [(2, -2.0)], [(3, -3.0)])
    assert choose(sc, rs.token_length_normalized, 0.0, random.Random(0)) == 0
    rng = random.Random(1234)
    draws = [choose(sc, rs.token_length_normalized, 1.0, rng) for _ in range(6000)]
    z = sum(math.exp(-k) for k in (1, 2, 3))
    for i in range(3):
        expected = math.exp(-(i + 1)) / z
        # 6000 draws: binomial std <= 0.0065; 0.025 is ~4 std.
        assert abs(draws.count(i) / len(draws) - expected) < 0.025, (i, expected)


def test_select_needs_choices() -> None:
    with pytest.raises(ValueError, match="non-empty list of choices"):
        rs.select("x", [])
