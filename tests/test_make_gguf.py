"""benchmarks/make_gguf.py at tiny shapes of each architecture it writes: the tensors it lays
out are the converter's (names and shapes, against the `gguf` package's name map on tiny HF
models); its Q4_K_M type mix is llama.cpp's rule (layer by layer, the fallbacks for rows that
are not whole super-blocks) and, where llama-cpp-python is installed (the bench extra), what
llama.cpp's own quantizer picks. The files written directly in blocks load in radixserve with
every projection native and generate, as do the F16 files; llama.cpp loads and evaluates
each architecture's direct file (its metadata is what llama.cpp expects), and
benchmarks/bench_vs_llamacpp.py runs it on both sides."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_vs_llamacpp as bench
import make_gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from make_gguf import T
from test_bench_vs_llamacpp import TINY as BENCH_ARGS
from test_bench_vs_llamacpp import check_radixserve
from test_gguf_families import FAMILIES, llama_cpp_tensors

from radixserve import Engine
from radixserve.models.gguf_layout import gguf_architecture, tensor_dims
from radixserve.models.moe import QuantExperts
from radixserve.models.quant import QuantLinear

# Tiny versions of each architecture, hidden 256 (whole K-quant super-blocks). Qwen2: q/k/v
# biases; Qwen3: untied,
# head_dim 128 (2 x hidden in q), FFN 384 (ffn_down's rows are 1.5 super-blocks: llama.cpp's
# fallbacks); Gemma 3: 7 layers, the 6th global; SmolLM3: 4 layers, the last without RoPE;
# Qwen3-MoE, OLMoE and Mixtral: 4 experts, 2 per token (with 8, llama.cpp's quantizer gives
# Mixtral's attn_k / attn_v / attn_output types, which make_gguf does not model).
# No name holds "phi3" (make_gguf.SHAPES' comment).
TINY = {
    "tiny-llama": make_gguf.shape("llama", (256, 2, 4, 2, 512), 1024, 1e4, 1e-5, tied=True),
    "tiny-qwen2": make_gguf.shape("qwen2", (256, 2, 4, 2, 512), 1024, 1e6, 1e-6, tied=True),
    "tiny-qwen3": make_gguf.shape("qwen3", (256, 4, 4, 2, 384), 1024, 1e6, 1e-6, tied=False,
                                  head_dim=128),
    "tiny-gemma3": make_gguf.shape("gemma3_text", (256, 7, 4, 2, 512), 1024, 1e6, 1e-6,
                                   tied=True, head_dim=64, query_pre_attn_scalar=64,
                                   sliding_window=16, rope_parameters=make_gguf.gemma3_rope(8.0)),
    "tiny-phi-4-mini": make_gguf.shape("phi3", (256, 2, 4, 2, 512), 1024, 1e4, 1e-5, tied=True,
                                       sliding_window=2048, original_max_position_embeddings=256,
                                       rope_parameters=make_gguf.longrope(48, 64, 256)),
    "tiny-smollm3": make_gguf.shape("smollm3", (256, 4, 4, 2, 512), 1024, 5e6, 1e-6, tied=True),
    "tiny-qwen3moe": make_gguf.shape("qwen3_moe", (256, 2, 4, 2, 512), 1024, 1e6, 1e-6,
                                     tied=False, head_dim=64, num_experts=4,
                                     num_experts_per_tok=2, moe_intermediate_size=256,
                                     norm_topk_prob=True),
    "tiny-olmoe": make_gguf.shape("olmoe", (256, 2, 4, 4, 256), 1024, 1e4, 1e-5, tied=False,
                                  num_experts=4, num_experts_per_tok=2, norm_topk_prob=False),
    "tiny-mixtral": make_gguf.shape("mixtral", (256, 2, 4, 2, 256), 1024, 1e6, 1e-5,
                                    tied=False, num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=None),
}  # fmt: skip
VOCAB = 49152  # the embedded tokenizer's
# gpt-oss-20b's layout at hidden 256: 2 layers (sliding, full), 4 experts of 256 rows with
# biases, 2 a token, sinks, q/k/v/o biases; its vocabulary padded past the embedded one. YaRN
# at factor 1 (plain RoPE's rotation): llama.cpp's YaRN rounds its correction range to whole
# dimensions (ggml_rope_yarn_corr_dims), which gpt-oss's config (truncate false) and
# transformers do not, so at other factors the two models' logits differ by design
TINY_GPT_OSS = make_gguf.shape(
    "gpt_oss", (256, 2, 4, 2, 256), 1024, 150000.0, 1e-5, tied=False, head_dim=64,
    num_local_experts=4, num_experts_per_tok=2, sliding_window=16, swiglu_limit=7.0,
    attention_bias=True, vocab_size=VOCAB + 64,
    layer_types=["sliding_attention", "full_attention"],
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 1.0,
                     "original_max_position_embeddings": 256, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False},
)  # fmt: skip
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One radixserve cache for the module: the embedded tokenizer is converted once."""
    folder = tmp_path_factory.mktemp("make_gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXSERVE_CACHE", str(folder / "cache"))
        yield folder


def written(cache: Path, name: str, ftype: str) -> Path:
    """The tiny `name` file of `ftype` (written once per module)."""
    path = cache / f"{name}-{ftype}.gguf"
    if not path.exists():
        make_gguf.write_random(TINY[name], ftype, path, seed=0)
    return path


def types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}


def quant_linears(engine: Engine) -> list[QuantLinear]:
    return [m for m in engine.worker.model.modules() if isinstance(m, QuantLinear)]


# ---------------------------------------------------------------- layout and type mix


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_layout_is_the_converters(family: str) -> None:
    """gguf_layout's names and shapes = those of tiny HF models named by the gguf package's
    map (test_gguf_families' converter)."""
    model = FAMILIES[family]()
    arch = gguf_architecture(model.config)
    want = {name: x.shape for name, x in llama_cpp_tensors(model, arch)}
    assert tensor_dims(model.config) == want


def test_no_file_name_makes_llama_cpp_look_for_phi3s_tokens() -> None:
    """llama.cpp sets attributes of Phi-3's own tokens in any file whose general.name holds
    "phi3" or "phi-3"; the embedded vocabulary lacks them (loading fails)."""
    assert not [name for name in [*make_gguf.SHAPES, *TINY] if re.search("phi-?3", name)]


def test_q4_k_m_mix_follows_llama_cpps_rule_at_a_real_shape() -> None:
    """Llama-3.1-8B (32 layers): attn_v and ffn_down Q6_K in the first and last 4 layers
    and every third between (use_more_bits), the untied output Q6_K, the rest Q4_K."""
    cfg = make_gguf.hf_config(make_gguf.SHAPES["llama-3.1-8b"], VOCAB)
    dims = tensor_dims(cfg)
    got = {name: make_gguf.tensor_type(name, d, "Q4_K_M", 32, tied=False)
           for name, d in dims.items()}  # fmt: skip
    six = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
    for i in range(32):
        for kind in ("attn_v", "ffn_down"):
            assert got[f"blk.{i}.{kind}.weight"] == (T.Q6_K if i in six else T.Q4_K), (i, kind)
        assert got[f"blk.{i}.attn_q.weight"] == T.Q4_K and got[f"blk.{i}.ffn_norm.weight"] == T.F32
    assert got["output.weight"] == T.Q6_K and got["token_embd.weight"] == T.Q4_K


def test_q4_k_m_mix_of_a_mixture_of_experts() -> None:
    """Qwen3-30B-A3B (48 layers): the router F32, the stacked experts' ffn_down_exps Q6_K in
    the use_more_bits layers as a dense ffn_down, their gate / up Q4_K."""
    cfg = make_gguf.hf_config(make_gguf.SHAPES["qwen3-30b-a3b"], VOCAB)
    dims = tensor_dims(cfg)
    got = {name: make_gguf.tensor_type(name, d, "Q4_K_M", 48, tied=False)
           for name, d in dims.items()}  # fmt: skip
    assert dims["blk.0.ffn_down_exps.weight"] == (128, 2048, 768)
    for i in range(48):
        assert got[f"blk.{i}.ffn_gate_inp.weight"] == T.F32
        assert got[f"blk.{i}.ffn_gate_exps.weight"] == got[f"blk.{i}.ffn_up_exps.weight"] == T.Q4_K
        assert got[f"blk.{i}.ffn_down_exps.weight"] == (
            T.Q6_K if make_gguf.more_bits(i, 48) else T.Q4_K
        )


def test_rows_that_are_not_whole_blocks_take_llama_cpps_fallbacks() -> None:
    """576 weights a row (SmolLM2's hidden): Q4_K -> Q5_0, Q6_K -> Q8_0; a tied embedding
    Q8_0; 48 (not whole 32-blocks either) F16."""
    q4km = make_gguf.tensor_type
    assert q4km("blk.0.attn_q.weight", (576, 576), "Q4_K_M", 30, tied=True) == T.Q5_0
    assert q4km("blk.0.attn_v.weight", (192, 576), "Q4_K_M", 30, tied=True) == T.Q8_0
    assert q4km("token_embd.weight", (VOCAB, 576), "Q4_K_M", 30, tied=True) == T.Q8_0
    assert q4km("token_embd.weight", (VOCAB, 576), "Q4_0", 30, tied=True) == T.Q8_0
    assert q4km("token_embd.weight", (VOCAB, 512), "Q4_0", 30, tied=True) == T.Q6_K
    assert make_gguf.fallback(T.Q4_K, 48) == T.F16


@pytest.mark.slow  # an F16 file per architecture, quantized 5 ways by llama.cpp (~30 s)
@pytest.mark.parametrize("name", TINY)
def test_direct_types_are_those_llama_cpps_quantizer_picks(name: str, cache: Path) -> None:
    pytest.importorskip("llama_cpp")  # the bench extra
    f16 = written(cache, name, "F16")
    cfg = make_gguf.hf_config(TINY[name], VOCAB)
    for ftype in make_gguf.BASE_TYPES:
        out = cache / f"{name}-{ftype}-by-llama-cpp.gguf"
        make_gguf.quantize(f16, out, ftype, threads=2)
        got = types(out)
        want = {n: make_gguf.tensor_type(n, d, ftype, cfg.num_hidden_layers,
                                         cfg.tie_word_embeddings).name
                for n, d in tensor_dims(cfg).items()}  # fmt: skip
        assert {n: got[n] for n in want} == want, ftype
        out.unlink()


# ---------------------------------------------------------------- the files in radixserve


def check_loads_and_generates(path: Path, fields: dict[str, Any]) -> Engine:
    engine = Engine(str(path), dtype="float32", max_total_tokens=256)
    mc = engine.worker.model_config
    sizes = (fields["hidden_size"], fields["num_hidden_layers"],
             fields["num_attention_heads"], fields["num_key_value_heads"])  # fmt: skip
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == sizes
    assert mc.intermediate_size == fields["intermediate_size"]
    assert mc.vocab_size == VOCAB
    # Gemma's tokenizer class adds its <mask>, which the SmolLM2 vocabulary lacks
    assert len(engine.tokenizer) == VOCAB + (mc.architecture == "Gemma3ForCausalLM")
    chat = engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.endswith("<|im_start|>assistant\n")  # the embedded tokenizer's template
    assert len(engine.generate(chat, GREEDY)["output_ids"]) == 8
    return engine


@pytest.mark.slow  # a file written and loaded per architecture (~5 s each)
@pytest.mark.parametrize("name", TINY)
def test_direct_q4_k_m_file_runs_every_projection_native(name: str, cache: Path) -> None:
    """4 QuantLinear a layer (qkv, o, gate/up, down; with experts qkv and o, and the
    experts' three stacks read in place from the file's), the output (+ the untied
    embedding), in Q4_K_M's formats (Qwen3's narrow ffn_down in Q5_0 / Q8_0)."""
    fields = TINY[name]
    engine = check_loads_and_generates(written(cache, name, "Q4_K_M"), fields)
    linears = quant_linears(engine)
    experts = [m for m in engine.worker.model.modules() if isinstance(m, QuantExperts)]
    tied, layers = fields["tie_word_embeddings"], fields["num_hidden_layers"]
    moe = "num_experts" in fields or "num_local_experts" in fields
    assert len(experts) == (layers if moe else 0)
    assert len(linears) == (2 if moe else 4) * layers + (1 if tied else 2)
    formats = {f.name for m in linears for f in m.formats} | {f for m in experts for f in m.formats}
    assert {"q4_k", "q6_k"} <= formats <= {"q4_k", "q6_k", "q5_0", "q8_0"}, formats
    if formats == {"q4_k", "q6_k"}:  # every matmul rounds x to int8: float32, native layers
        assert engine.worker.dtype == torch.float32
        assert all(layer.native is not None for layer in engine.worker.model.model.layers)


@pytest.mark.slow  # a file written and loaded per architecture (~5 s each)
@pytest.mark.parametrize("name", TINY)
def test_f16_file_loads_and_generates(name: str, cache: Path) -> None:
    check_loads_and_generates(written(cache, name, "F16"), TINY[name])


@pytest.mark.slow  # llama.cpp's quantizer (~10 s)
def test_via_f16_llama_cpp_quantizes_to_q4_k_m_and_every_projection_loads_native(
    cache: Path,
) -> None:
    pytest.importorskip("llama_cpp")  # the bench extra
    q4km = cache / "via-f16-Q4_K_M.gguf"
    make_gguf.quantize(written(cache, "tiny-llama", "F16"), q4km, "Q4_K_M", threads=2)
    engine = Engine(str(q4km), dtype="float32", max_total_tokens=256)
    linears = quant_linears(engine)
    assert len(linears) == 2 * 4 + 1  # 4 projections a layer, the tied embedding
    assert {"q4_k", "q6_k"} <= {f.name for m in linears for f in m.formats}
    assert len(engine.generate("Hello", GREEDY)["output_ids"]) == 8


# ---------------------------------------------------------------- the files in llama.cpp


@pytest.mark.slow  # a file written and loaded per architecture (~4 s each)
@pytest.mark.parametrize("name", TINY)
def test_llama_cpp_evaluates_the_direct_file(name: str, cache: Path) -> None:
    """llama.cpp takes each architecture's metadata and tensors: finite logits over the
    whole vocabulary at every position."""
    llama_cpp = pytest.importorskip("llama_cpp")  # the bench extra
    path = written(cache, name, "Q4_K_M")
    assert types(path)["blk.0.attn_output.weight"] == GGMLQuantizationType.Q4_K.name
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
    llm.eval(list(range(1, 9)))
    scores = np.asarray(llm.scores[: llm.n_tokens])  # (8, vocab)
    assert scores.shape == (8, VOCAB) and np.isfinite(scores).all()
    assert (np.abs(scores).max(axis=1) > 0).all()  # every row written


@pytest.mark.slow  # a file written, loaded and run in radixserve and llama.cpp (~10 s each)
@pytest.mark.parametrize("name", ["tiny-qwen3moe", "tiny-olmoe", "tiny-mixtral"])
def test_moe_file_picks_llama_cpps_top_1(name: str, cache: Path) -> None:
    """A mixture of experts' direct Q4_K_M file: over a 200-token teacher-forced sequence
    llama.cpp and radixserve pick the same top-1 token at 99 in 100 positions or more."""
    pytest.importorskip("llama_cpp")  # the bench extra
    path = written(cache, name, "Q4_K_M")
    model = Engine(str(path), dtype="float32", max_total_tokens=256).worker.model
    agree = top_1_agreement(model, path, tokens=200)
    assert agree >= 0.99, agree


def top_1_agreement(model: Any, path: Path, tokens: int) -> float:
    """The fraction of a random teacher-forced sequence's positions at which `model` (the
    file at `path` as radixserve loaded it) and llama.cpp pick the same top-1 token."""
    import llama_cpp
    from helpers import alloc_slots, extend, make_pool

    from radixserve.attention.flat import FlatBackend

    ids = torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    pool = make_pool(model, len(ids), sliding_rows=True)
    ours = extend(model, FlatBackend(), pool, alloc_slots(pool, len(ids)), ids, 0)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=tokens, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = torch.from_numpy(np.asarray(llm.scores[: llm.n_tokens]))  # (tokens, vocab)
    assert theirs.shape == ours.shape
    return (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()


@pytest.mark.slow  # both engines through the benchmark at its test sizes (~15 s each)
@pytest.mark.parametrize("name", [n for n in TINY if n != "tiny-llama"])
def test_bench_vs_llamacpp_takes_the_direct_file(name: str, cache: Path) -> None:
    """Nothing in the benchmark assumes Llama: each architecture's file runs on both sides,
    every row with the tokens asked for."""
    pytest.importorskip("llama_cpp")  # the bench extra
    model = bench.main([*BENCH_ARGS, "--no-memory", "--model", str(written(cache, name, "Q4_K_M"))])
    (res,) = model["models"]
    check_radixserve(res)
    for row in res["rows"]:
        want = [row["new_tokens"]] * row["batch"]
        assert row["llamacpp_tokens_per_seq"] == {"off": want, "on": want}, row["name"]


@pytest.mark.slow  # a tiny mixture of experts through bench_moe.py (~20 s)
def test_bench_moe_counts_distinct_experts_and_load(cache: Path) -> None:
    """Decode rows at B = 1 and 4 (a step's distinct experts: k at B = 1, at most E) and the
    load of 2 GSM8K questions over every layer's experts."""
    import bench_moe

    model = written(cache, "tiny-qwen3moe", "Q4_K_M")
    data = Path(__file__).resolve().parent / "data" / "gsm8k"
    args = ["--model", str(model), "--batch", "1", "4", "--prompt", "64", "--new-tokens", "4"]
    res = bench_moe.main([*args, "--questions", "2", "--data-path", str(data)])
    one, four = res["decode"]
    fields = TINY["tiny-qwen3moe"]
    k, e = fields["num_experts_per_tok"], fields["num_experts"]
    assert one["distinct_experts_per_layer_step"] == k
    assert k <= four["distinct_experts_per_layer_step"] <= e
    assert one["decode_tok_s"] > 0 and four["step_bytes"] >= one["step_bytes"]
    load = res["load"]
    per_layer = torch.tensor(load["tokens_per_expert"]).sum(dim=1)
    assert len(load["tokens_per_expert"]) == fields["num_hidden_layers"]
    assert torch.equal(per_layer, torch.full_like(per_layer, load["tokens"] * k))


# ---------------------------------------------------------------- gpt-oss in MXFP4


def test_mxfp4_mix_of_gpt_oss() -> None:
    """gpt-oss-20b (24 layers): experts MXFP4, their biases, the router, sinks and norms F32,
    every other matrix Q8_0; the vocabulary is the model's 201088 tokens."""
    cfg = make_gguf.hf_config(make_gguf.SHAPES["gpt-oss-20b"], VOCAB)
    dims = tensor_dims(cfg)
    got = {name: make_gguf.tensor_type(name, d, "MXFP4", 24, tied=False)
           for name, d in dims.items()}  # fmt: skip
    assert dims["blk.0.ffn_down_exps.weight"] == (32, 2880, 2880)
    assert dims["output.weight"] == (201088, 2880)
    for name, qtype in got.items():
        want = (T.MXFP4 if name.endswith("_exps.weight") else
                T.F32 if len(dims[name]) == 1 or name.endswith(".bias") or "ffn_gate_inp" in name
                else T.Q8_0)  # fmt: skip
        assert qtype == want, name


@pytest.mark.slow  # a tiny gpt-oss written, loaded and run in radixserve and llama.cpp (~10 s)
def test_gpt_oss_mxfp4_file_runs_its_experts_in_mxfp4(cache: Path) -> None:
    """The tiny gpt-oss MXFP4 file (its vocabulary padded with unused tokens) loads with
    every expert stack kept in MXFP4 blocks read in place, every layer native, and generates;
    llama.cpp, where installed, picks the same top-1 token at 9 in 10 positions or more of a
    teacher-forced sequence past the window (both round x for the matmuls, differently: on
    random weights their logits differ by 1-12 %)."""
    path = cache / "tiny-gpt-oss-MXFP4.gguf"
    make_gguf.write_random(TINY_GPT_OSS, "MXFP4", path, seed=0)
    kinds = types(path)
    assert kinds["blk.0.ffn_gate_exps.weight"] == kinds["blk.1.ffn_down_exps.weight"] == "MXFP4"
    engine = Engine(str(path), dtype="float32", max_total_tokens=256)
    model = engine.worker.model
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    assert len(experts) == 2 and all(e.formats == ["mxfp4"] * 3 for e in experts)
    assert all(layer.native is not None for layer in model.model.layers)
    assert model.config.vocab_size == VOCAB + 64
    assert len(engine.generate("Hello there", GREEDY)["output_ids"]) == 8
    pytest.importorskip("llama_cpp")  # the bench extra
    agree = top_1_agreement(model, path, tokens=48)
    assert agree >= 0.9, agree
