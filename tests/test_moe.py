"""Mixtures of experts (Qwen3-MoE, OLMoE, Mixtral; radixserve/models/moe.py) against HF
transformers (the oracle) on tiny random checkpoints built here (models/synthetic.py
TINY_FAMILIES: 8 experts, 2 a token; a dense layer among Qwen3-MoE's; Mixtral's sliding
window of 16), and GGUF files of llama.cpp's qwen3moe and olmoe architectures written here
the way its converter writes them. Tolerances:
    logits (float32): max abs diff <= 1e-4 x the largest |logit|; Q8_0 files 1e-3
    one MoE block in bf16: within 1% of its output's scale (measured: equal)
    greedy tokens: identical to HF generate(do_sample=False), 8 prompts x 32 tokens
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
import transformers
from helpers import alloc_slots, extend, make_pool
from safetensors.torch import save_file
from test_families import (
    REL_TOL,
    _one_thread,  # noqa: F401  (its autouse fixture: one torch thread)
    check_server_greedy,
    check_tensor_parallel_greedy,
    hf_logits_one_at_a_time,
    hf_model,
)
from test_gguf_families import (
    F32,
    MATH,
    Q8_0,
    VOCAB,
    as_converted,
    heads,
    hf_weights,
    llama_cpp_tensors,
    metadata,
    randomized,
    sizes,
    write_gguf,
)
from test_quant import check_native_layers_are_the_module_path

from radixserve.attention.flat import FlatBackend
from radixserve.attention.tree import TreeBackend
from radixserve.models import load_model, resolve_model_path
from radixserve.models.config import ModelConfig
from radixserve.models.gguf_config import config_from_metadata
from radixserve.models.gguf_layout import gguf_architecture, tensor_dims
from radixserve.models.gguf_weights import read_gguf_weights
from radixserve.models.llama import LlamaForCausalLM
from radixserve.models.moe import (
    Activation,
    Experts,
    MoE,
    QuantExperts,
    clamped_swiglu,
    grouped_experts,
    route,
    swiglu,
)
from radixserve.models.moe_weights import stack_experts
from radixserve.models.quant import QuantLinear, QuantStack, dequantize
from radixserve.models.sharding import check_tp_size
from radixserve.models.synthetic import build_tiny_model, random_blocks

FAMILIES = ["qwen3_moe", "olmoe", "mixtral"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {f: build_tiny_model(root / f, seed=i, family=f) for i, f in enumerate(FAMILIES)}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp folder, also the cache that GGUF files are converted into."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path


def our_logits(model: LlamaForCausalLM, ids: list[int], backend: Any = None) -> torch.Tensor:
    """Positions 0..19 prefill, 20..44 one extend over the cache, the rest decodes (scattered
    slots)."""
    backend = backend or FlatBackend()
    n = len(ids)
    pool = make_pool(model, n, isinstance(backend, TreeBackend))
    slots = alloc_slots(pool, n)[torch.randperm(n, generator=torch.Generator().manual_seed(1))]
    parts = [extend(model, backend, pool, slots, ids[:20], 0)]
    parts.append(extend(model, backend, pool, slots, ids[20:45], 20))
    parts += [extend(model, backend, pool, slots, [ids[p]], p) for p in range(45, n)]
    return torch.cat(parts)


def assert_close(ours: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    diff = (ours - want).abs().max().item()
    assert diff <= tol * want.abs().max().item(), f"{what}: max abs diff {diff:.2e}"


# ---------------------------------------------------------------- HF checkpoints


@pytest.mark.parametrize("family", FAMILIES)
def test_config_reads_the_family(checkpoints: dict[str, Path], family: str) -> None:
    _, cfg = load_model(checkpoints[family], torch.float32)
    expect = {
        "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          norm_topk_prob=True, moe_layers=(True, False, True), qk_norm=True,
                          qk_norm_full=False, intermediate_size=128),
        "olmoe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=False, moe_layers=(), qk_norm=True, qk_norm_full=True),
        "mixtral": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        norm_topk_prob=True, routing_weights_f32=True, sliding_window=16),
    }[family]  # fmt: skip
    assert {k: getattr(cfg, k) for k in expect} == expect


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf_through_prefill_extend_and_decode(
    checkpoints: dict[str, Path], family: str
) -> None:
    """Flat and tree attention, 80 positions (past Mixtral's window of 16)."""
    model, _ = load_model(checkpoints[family], torch.float32)
    assert not model.use_native_layers()
    ids = torch.randint(100, 20000, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    want = hf_logits_one_at_a_time(hf_model(checkpoints[family]), ids)
    for backend in (FlatBackend(), TreeBackend()):
        assert_close(our_logits(model, ids, backend), want, REL_TOL, family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_block_matches_hfs(
    checkpoints: dict[str, Path], family: str, dtype: torch.dtype
) -> None:
    """One MoE block over 40 tokens against HF's own block with the same weights (bf16:
    Mixtral's routing weights multiply in float32, the others' in bf16)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints[family], dtype=dtype)
    model, config = load_model(checkpoints[family], dtype, packed_linear=False)
    theirs, ours = hf.model.layers[0].mlp.eval(), model.model.layers[0].mlp
    assert isinstance(ours, MoE)
    x = torch.randn(1, 40, config.hidden_size, generator=torch.Generator().manual_seed(3))
    x = x.to(dtype)
    with torch.no_grad():
        want, got = theirs(x)[0].float(), ours(x[0]).float()
    assert_close(got, want, REL_TOL if dtype == torch.float32 else 1e-2, f"{family} {dtype}")


def test_a_tied_router_picks_the_experts_hfs_does(tmp_path: Path) -> None:
    """Router ties resolve as torch.topk resolves them on the same float32 scores: layer 0's
    router scores expert 0 by its row and the other seven 0 (a 7-way tie for the last slot,
    or for both), layer 2's scores every expert 0 (an 8-way tie)."""
    path = build_tiny_model(tmp_path / "tied", seed=9, family="qwen3_moe")
    hf = hf_model(path)
    routers = [hf.model.layers[i].mlp.gate.weight for i in (0, 2)]
    with torch.no_grad():
        routers[0][1:] = 0
        routers[1][:] = 0
    hf.save_pretrained(path)
    model, config = load_model(path, torch.float32)
    ids = torch.randint(100, 20000, (60,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_close(our_logits(model, ids), hf_logits_one_at_a_time(hf, ids), REL_TOL, "tied")
    x = torch.randn(50, config.hidden_size, generator=torch.Generator().manual_seed(2))
    for i in (0, 2):
        with torch.no_grad():
            _, want_w, want_ids = hf.model.layers[i].mlp.gate(x)
            logits = model.model.layers[i].mlp.gate(x)
        weights, got_ids = route(logits, config.num_experts_per_tok, config.norm_topk_prob)
        assert torch.equal(got_ids, want_ids) and torch.equal(weights, want_w), i
    assert len({tuple(r) for r in want_ids.tolist()}) == 1  # layer 2: one choice for all


def test_experts_in_transformers_fused_layout_load_alike(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint holding the experts as transformers holds them in memory
    (`mlp.experts.gate_up_proj` (E, 2I, hidden), `mlp.experts.down_proj`) loads to the same
    model as the per-expert tensors save_pretrained writes."""
    src = checkpoints["qwen3_moe"]
    state = hf_model(src).state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    fused, _ = load_model(tmp_path, torch.float32)
    per_expert, _ = load_model(src, torch.float32)
    assert fused.state_dict().keys() == per_expert.state_dict().keys()
    for name, t in per_expert.state_dict().items():
        assert torch.equal(fused.state_dict()[name], t), name


def test_a_missing_expert_is_named(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    src = checkpoints["olmoe"]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape("missing ['model.layers.1.mlp.experts.up_proj"
                                                   "']")):  # fmt: skip
        load_model(tmp_path, torch.float32)


# Qwen3-MoE's in the fast tier; the others (the same code path) in the slow.
SERVED = [pytest.param(f, marks=[] if f == "qwen3_moe" else [pytest.mark.slow]) for f in FAMILIES]


@pytest.mark.parametrize("family", SERVED)
def test_server_greedy_matches_hf_generate(checkpoints: dict[str, Path], family: str) -> None:
    """HF's greedy tokens for 8 prompts x 32 tokens from two engines: tree attention keeping
    every shared segment with speculative decoding, and flat attention with none."""
    check_server_greedy(checkpoints[family], seed=FAMILIES.index(family))


# ---------------------------------------------------------------- what is refused

MOE_BASE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 256, "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32}  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "field", "value"),
    [("Qwen3MoeForCausalLM", "shared_expert_intermediate_size", 512),
     ("Qwen3MoeForCausalLM", "n_shared_experts", 1),
     ("MixtralForCausalLM", "scoring_func", "sigmoid"),
     ("MixtralForCausalLM", "routed_scaling_factor", 2.5),
     ("OlmoeForCausalLM", "clip_qkv", 8.0)],
)  # fmt: skip
def test_unsupported_fields_are_named(arch: str, field: str, value: Any) -> None:
    cfg = {**MOE_BASE, "architectures": [arch], field: value}
    with pytest.raises(ValueError, match=re.escape(f"unsupported {field}={value!r}")):
        ModelConfig.from_hf(cfg)
    harmless = {"router_jitter_noise": 0.1, "output_router_logits": True}  # training only
    ModelConfig.from_hf({**MOE_BASE, "architectures": [arch], **harmless})


def test_more_experts_per_token_than_experts_is_refused() -> None:
    cfg = {**MOE_BASE, "architectures": ["MixtralForCausalLM"], "num_experts_per_tok": 9}
    with pytest.raises(ValueError, match="num_experts_per_tok=9 with 8 experts"):
        ModelConfig.from_hf(cfg)


def test_a_shared_expert_family_is_not_taken_for_another() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen2MoeForCausalLM'"):
        ModelConfig.from_hf({**MOE_BASE, "architectures": ["Qwen2MoeForCausalLM"]})


def test_tensor_parallel_sizes_are_checked() -> None:
    olmoe = ModelConfig.from_hf({**MOE_BASE, "architectures": ["OlmoeForCausalLM"]})
    with pytest.raises(ValueError, match="q/k norms span all heads"):
        check_tp_size(olmoe, 2)
    odd = ModelConfig.from_hf({**MOE_BASE, "architectures": ["Qwen3MoeForCausalLM"],
                               "moe_intermediate_size": 33})  # fmt: skip
    with pytest.raises(ValueError, match="does not divide expert intermediate size"):
        check_tp_size(odd, 2)
    check_tp_size(odd, 1)


# ---------------------------------------------------------------- GGUF files


def tiny_qwen3moe(vocab: int = VOCAB) -> Any:
    """3 layers, all with experts (llama.cpp's qwen3moe has no dense layers), renormalised
    (llama.cpp fixes it), head_dim 32."""
    config = transformers.Qwen3MoeConfig(
        **sizes(vocab), num_hidden_layers=3, head_dim=32, max_position_embeddings=512,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    return randomized(transformers.Qwen3MoeForCausalLM(config), 11)


def tiny_olmoe(vocab: int = VOCAB) -> Any:
    """2 layers, 8 experts of 64 rows, top-2 not renormalised; RMS epsilon 1e-5 (what the
    converter writes for every OLMoE)."""
    config = transformers.OlmoeConfig(
        **{**sizes(vocab), "intermediate_size": 64, "rms_norm_eps": 1e-5},
        num_hidden_layers=2, max_position_embeddings=512, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False,
    )  # fmt: skip
    return randomized(transformers.OlmoeForCausalLM(config), 12)


def tiny_mixtral(vocab: int = VOCAB) -> Any:
    """2 layers, 8 experts of 64 rows, top-2; no sliding window (llama.cpp's converter writes
    Mixtral as a llama file, which has none)."""
    config = transformers.MixtralConfig(
        **{**sizes(vocab), "intermediate_size": 64}, num_hidden_layers=2,
        max_position_embeddings=512, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None, tie_word_embeddings=False,
    )  # fmt: skip
    return randomized(transformers.MixtralForCausalLM(config), 13)


# keyed by family: Mixtral's file is llama.cpp's llama architecture with experts
GGUF_FAMILIES = {"qwen3moe": tiny_qwen3moe, "olmoe": tiny_olmoe, "mixtral": tiny_mixtral}
GGUF_MATH = {
    "qwen3_moe": ["head_dim", "attention_bias", "hidden_act", "num_experts",
                  "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "mlp_only_layers", "decoder_sparse_step", "use_sliding_window",
                  "sliding_window"],
    "olmoe": ["attention_bias", "hidden_act", "num_experts", "num_experts_per_tok",
              "norm_topk_prob", "clip_qkv"],
    "mixtral": ["hidden_act", "num_local_experts", "num_experts_per_tok", "sliding_window"],
}  # fmt: skip


def stacked(model: Any) -> dict[str, torch.Tensor]:
    """The HF model's weights under the loader's stacked expert names."""
    return {k.removesuffix(".weight") if ".experts." in k else k: v
            for k, v in as_converted(hf_weights(model)).items()}  # fmt: skip


@pytest.mark.parametrize("arch", GGUF_FAMILIES)
def test_tensor_layout_is_the_converters(arch: str) -> None:
    """gguf_layout's names and shapes (benchmarks' files) = the converter's: router, stacked
    experts, whole-projection q/k norms of OLMoE."""
    model = GGUF_FAMILIES[arch]()
    want = {name: x.shape for name, x in llama_cpp_tensors(model, gguf_architecture(model.config))}
    assert tensor_dims(model.config) == want
    assert want["blk.0.ffn_down_exps.weight"] == (8, 64, model.config.moe_intermediate_size
                                                  if arch == "qwen3moe" else 64)  # fmt: skip


@pytest.mark.parametrize("arch", GGUF_FAMILIES)
def test_gguf_config_and_weights_equal_the_hf_models(arch: str, cache: Path) -> None:
    model = GGUF_FAMILIES[arch]()
    file = write_gguf(model, cache / f"tiny-{arch}.gguf")
    folder = resolve_model_path(str(file))
    ours, theirs = transformers.AutoConfig.from_pretrained(folder), model.config
    assert ours.architectures == [type(model).__name__]
    for field in MATH + GGUF_MATH[theirs.model_type]:
        assert getattr(ours, field) == getattr(theirs, field), field
    weights, dequantized = read_gguf_weights(file, heads(model), torch.float32, quantized=False)
    want = stacked(model)
    assert dequantized == {} and set(weights) == set(want)
    for name, w in weights.items():
        assert torch.equal(w, want[name]), name
    assert json.loads((folder / "config.json").read_text())["num_experts_per_tok"] == 2


@pytest.mark.parametrize("quant", [F32, Q8_0])
@pytest.mark.parametrize("arch", GGUF_FAMILIES)
def test_a_gguf_file_runs_as_its_hf_model(
    arch: str, quant: gguf.GGMLQuantizationType, cache: Path
) -> None:
    """The file through the engine's loader gives the HF model's logits (prefill, extend,
    decodes). Q8_0: attention matrices and the 3-D experts stay in blocks (experts read in
    place by the native experts call), the router is F32; the HF model holds the same
    rounded weights."""
    hf = GGUF_FAMILIES[arch]()
    path = write_gguf(hf, cache / f"{arch}.gguf", quant)
    model, _ = load_model(resolve_model_path(str(path)), torch.float32)
    if quant == Q8_0:
        plain, _ = read_gguf_weights(path, heads(hf), torch.float32, quantized=False)
        for name, w in stack_experts(plain, load_model_config(path)).items():
            _assign(hf, name, w)
    assert (quant == Q8_0) == any(isinstance(m, QuantLinear) for m in model.modules())
    assert (quant == Q8_0) == any(isinstance(m, QuantExperts) for m in model.modules())
    assert (quant == Q8_0) == all(layer.native is not None for layer in model.model.layers)
    ids = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(7)).tolist()
    want = hf_logits_one_at_a_time(hf, ids)
    assert_close(our_logits(model, ids), want, REL_TOL if quant == F32 else 1e-3, arch)


@pytest.mark.parametrize("arch", GGUF_FAMILIES)
def test_native_moe_layers_compute_the_module_path(arch: str, cache: Path) -> None:
    """A Q8_0 file's layers run as two native calls each (quant_cpu.cpp pre_attention, with
    OLMoE's q/k norms over whole rows, and post_attention_moe: router, routing and the
    selected experts in one call), with the module path's logits bit for bit through a
    300-token extend (experts of ~75 rows: the GEMM) and a decode step (the loop)."""
    path = write_gguf(GGUF_FAMILIES[arch](), cache / f"{arch}.gguf", Q8_0)
    model, _ = load_model(resolve_model_path(str(path)), torch.float32)
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    check_native_layers_are_the_module_path(model, ids)


def _stacks(spec: list[tuple[str, str, int, int]], e: int) -> dict[str, QuantStack]:
    """Random stacks of `e` experts: (name, format, rows, K) each."""
    return {
        name: QuantStack(
            torch.from_numpy(random_blocks(e * rows, k, fmt, seed)).view(e, rows, -1), fmt, k
        )
        for seed, (name, fmt, rows, k) in enumerate(spec)
    }


def _per_expert(
    stacks: dict[str, QuantStack], bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    act: Activation = swiglu, activations: str = "int8",
) -> Any:  # fmt: skip
    """Each expert as QuantLinears over its views (the dense projections' kernels), with
    its rows of `bias` (gate/up (E, 2I), down (E, hidden)) as theirs."""
    gate, up, down = stacks["gate"], stacks["up"], stacks["down"]
    gate_up_bias, down_bias = bias if bias is not None else ([None] * len(gate),) * 2
    gate_up = [QuantLinear([gate[e], up[e]], gate_up_bias[e], activations)
               for e in range(len(gate))]  # fmt: skip
    downs = [QuantLinear([down[e]], down_bias[e], activations) for e in range(len(down))]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        g, u = gate_up[e](rows).chunk(2, dim=-1)
        return downs[e](act(g, u))

    return expert


def test_experts_in_k_quant_blocks_are_read_in_place_and_match_float_experts() -> None:
    """Q4_K gate / up and Q6_K down stacks (a Q4_K_M file's), used in place: a step's
    selected experts in the one native call equal each expert run as its own QuantLinears,
    bit for bit, and the float experts of the same dequantized weights, up to the kernels'
    int8 rounding of x (a wrong expert, slot or weight would be off by the output's whole
    size)."""
    e, hidden, inter = 4, 256, 512
    spec = [("gate", "q4_k", inter, hidden), ("up", "q4_k", inter, hidden),
            ("down", "q6_k", hidden, inter)]  # fmt: skip
    stacks = _stacks(spec, e)
    quant = QuantExperts(stacks["gate"], stacks["up"], stacks["down"], "int8")
    assert quant.get_buffer("up").data_ptr() == stacks["up"].blocks.data_ptr()
    plain = {n: dequantize(s.blocks.reshape(-1, s.blocks.shape[-1]), s.fmt, s.in_features)
             for n, s in stacks.items()}  # fmt: skip
    floats = Experts(e, hidden, inter, bias=False)
    gate, up = (plain[n].view(e, inter, hidden) for n in ("gate", "up"))
    floats.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
    floats.down_proj.copy_(plain["down"].view(e, hidden, inter))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, hidden, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(9)])  # (9, 2)
    weights = torch.rand(9, 2, generator=gen)
    got = quant.mix(x, ids, weights)
    assert torch.equal(got, grouped_experts(x, ids, weights, _per_expert(stacks), hidden))
    want = floats.mix(x, ids, weights)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=0.03 * scale)
    swapped = quant.mix(x, ids.flip(1), weights)
    assert float((swapped - want).abs().max()) > 0.1 * scale


@pytest.mark.parametrize("tokens", [1, 3, 60])
def test_experts_with_many_rows_take_each_experts_kernel_bit_for_bit(tokens: int) -> None:
    """Q8_0 experts (int16 x): at 60 tokens experts 0-2 have more rows than the streaming
    kernel's 32 and run the GEMM, as their QuantLinears would, while 3 and 4 share the one
    loop; the result is each expert as its own QuantLinears, bit for bit, at 1, 3 and 60
    tokens of 3 slots. bf16 x runs in float32 and comes back in bf16."""
    e, hidden, inter, k = 5, 64, 96, 3
    spec = [("gate", "q8_0", inter, hidden), ("up", "q8_0", inter, hidden),
            ("down", "q8_0", hidden, inter)]  # fmt: skip
    stacks = _stacks(spec, e)
    quant = QuantExperts(stacks["gate"], stacks["up"], stacks["down"], "int16")
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(tokens)])
    if tokens == 60:  # 60, 50, 50, 10 and 10 rows
        ids = torch.tensor([[0, 1, 2]] * 50 + [[3, 4, 0]] * 10)
    weights = torch.rand(tokens, k, generator=gen)
    want = grouped_experts(x, ids, weights, _per_expert(stacks), hidden)
    assert torch.equal(quant.mix(x, ids, weights), want)
    half = x.bfloat16()
    assert torch.equal(
        quant.mix(half, ids, weights), quant.mix(half.float(), ids, weights).bfloat16()
    )


@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("tokens", [1, 4, 70])
def test_mxfp4_experts_with_biases_and_clamped_swiglu_are_each_experts_linears(
    tokens: int, activations: str
) -> None:
    """gpt-oss's experts as its GGUF files hold them: MXFP4 stacks, a bias row per expert
    for gate/up and down, the clamped SwiGLU (alpha 1.702, limit 7). The one native call
    equals each expert run as its own QuantLinears (biases theirs) and moe.clamped_swiglu,
    bit for bit, at 1, 4 and 70 tokens (70 x 2 slots over 4 experts: some experts past
    small_m, in the GEMM), with x rounded to int8 (up to small_m rows) or int16; without
    the native build, the dequantized experts agree up to the rounding of x. A wrong bias
    row or a plain SwiGLU would be off by the output's size."""
    e, hidden, inter = 4, 96, 64
    spec = [("gate", "mxfp4", inter, hidden), ("up", "mxfp4", inter, hidden),
            ("down", "mxfp4", hidden, inter)]  # fmt: skip
    stacks = _stacks(spec, e)
    gen = torch.Generator().manual_seed(tokens)
    bias = (torch.randn(e, 2 * inter, generator=gen), torch.randn(e, hidden, generator=gen))
    act = functools.partial(clamped_swiglu, alpha=1.702, limit=7.0)
    g, u, d = stacks["gate"], stacks["up"], stacks["down"]
    quant = QuantExperts(g, u, d, activations, bias, (1.702, 7.0))
    x = torch.randn(tokens, hidden, generator=gen) * 4  # some gate/up values past the limit
    ids = torch.stack([torch.randperm(e, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    got = quant.mix(x, ids, weights)
    each = _per_expert(stacks, bias, act, activations)
    assert torch.equal(got, grouped_experts(x, ids, weights, each, hidden))
    reference = grouped_experts(x, ids, weights, quant._dequantized_expert, hidden)
    scale = float(reference.abs().max())
    atol = (2e-2 if activations == "int8" else 1e-4) * scale  # x's int8 or int16 steps
    torch.testing.assert_close(got, reference, rtol=0, atol=atol)
    swapped = (bias[0].flip(0), bias[1])
    for wrong in (_per_expert(stacks, bias), _per_expert(stacks, swapped, act)):
        off = grouped_experts(x, ids, weights, wrong, hidden)
        assert float((off - got).abs().max()) > 0.05 * scale


def test_expert_ids_out_of_range_are_an_error_naming_them() -> None:
    spec = [("gate", "q8_0", 32, 32), ("up", "q8_0", 32, 32), ("down", "q8_0", 32, 32)]
    stacks = _stacks(spec, 2)
    quant = QuantExperts(stacks["gate"], stacks["up"], stacks["down"], "int16")
    x, weights = torch.randn(1, 32), torch.ones(1, 1)
    with pytest.raises(RuntimeError, match=re.escape("expert id 2 out of range [0, 2)")):
        quant.mix(x, torch.tensor([[2]]), weights)


def load_model_config(path: Path) -> ModelConfig:
    from radixserve.models.loader import load_config

    return load_config(resolve_model_path(str(path)))


def _assign(hf: Any, name: str, w: torch.Tensor) -> None:
    """Copy a stacked-name weight into the HF model (its experts fused as gate_up)."""
    stem, _, part = name.rpartition(".")
    if not stem.endswith("mlp.experts") or part == "down_proj":
        hf.get_parameter(name).data.copy_(w)
        return
    gate_up = hf.get_parameter(f"{stem}.gate_up_proj").data  # (E, 2I, hidden)
    rows = gate_up.shape[1] // 2
    (gate_up[:, :rows] if part == "gate_proj" else gate_up[:, rows:]).copy_(w)


@pytest.mark.parametrize(
    ("arch", "key", "value"),
    [("qwen3moe", "expert_shared_count", 1), ("qwen3moe", "expert_gating_func", 2),
     ("qwen3moe", "expert_weights_norm", False), ("olmoe", "expert_weights_norm", True),
     ("olmoe", "expert_weights_scale", 2.5), ("olmoe", "attention.clamp_kqv", 8.0),
     ("llama", "expert_weights_norm", False), ("llama", "expert_shared_count", 1),
     ("llama", "expert_feed_forward_length", 32)],
)  # fmt: skip
def test_gguf_metadata_the_config_cannot_express_raises_naming_it(
    arch: str, key: str, value: Any
) -> None:
    """qwen3moe, olmoe, and llama with experts (Mixtral)."""
    keys = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32}
    if arch != "qwen3moe":
        del keys["expert_feed_forward_length"]
    meta = metadata(arch, **keys, **{key: value})
    shapes = {"token_embd.weight": (VOCAB, 64)}
    with pytest.raises(ValueError, match=re.escape(f"{arch}.{key} = {value!r} in the GGUF")):
        config_from_metadata(arch, meta, shapes, {})
    del meta[f"{arch}.{key}"]
    assert config_from_metadata(arch, meta, shapes, {})["num_experts"] == 8


def test_a_mixtral_file_with_attention_biases_is_refused() -> None:
    meta = metadata("llama", expert_count=8, expert_used_count=2)
    shapes = {"token_embd.weight": (VOCAB, 64), "blk.0.attn_q.bias": (64,)}
    with pytest.raises(ValueError, match=re.escape("blk.0.attn_q.bias in a Mixtral GGUF")):
        config_from_metadata("llama", meta, shapes, {})
    del shapes["blk.0.attn_q.bias"]
    assert config_from_metadata("llama", meta, shapes, {})["architectures"] == [
        "MixtralForCausalLM"
    ]


# ---------------------------------------------------------------- tensor parallel


@pytest.mark.slow  # a two-process engine per family: ~5-9 s each
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tensor_parallel_greedy_matches_hf(checkpoints: dict[str, Path], family: str) -> None:
    """Two ranks, each with half of every expert's rows (and half the heads): HF's greedy
    tokens."""
    check_tensor_parallel_greedy(checkpoints[family], seed=FAMILIES.index(family))
