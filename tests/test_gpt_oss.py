"""gpt-oss (`GptOssForCausalLM`) against HF transformers (the oracle) on a tiny random
checkpoint built here (models/synthetic.py TINY_FAMILIES["gpt_oss"]: 4 layers alternating
sliding (window 8) and full, 8 experts with biases, 2 a token, head_dim 32 in a hidden of 64,
YaRN past an original context of 64, random biases and sinks). Tolerances:
    logits (float32): max abs diff <= 1e-4 x the largest |logit| (measured ~2e-5: the float32
                      rounding of transformers' eager attention against our kernels, as far
                      apart as transformers' own whole-prompt and one-token-at-a-time runs)
    one MoE block: float32 equal; bf16 within 1% of its output's scale
    RMSNorm, RoPE tables, router choices: equal
    greedy tokens: identical to HF generate(do_sample=False), 8 prompts x 32 tokens
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import transformers
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
    metadata,
    randomized,
    sizes,
    write_tokenizer,
)
from test_moe import assert_close, our_logits
from test_quant import check_native_layers_are_the_module_path
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixserve.attention.flat import FlatBackend
from radixserve.attention.tree import TreeBackend
from radixserve.models import load_model, resolve_model_path
from radixserve.models.config import ModelConfig
from radixserve.models.gguf_config import config_from_metadata
from radixserve.models.gguf_layout import tensor_dims, write_metadata
from radixserve.models.gguf_weights import gguf_tensors
from radixserve.models.moe import MoE, QuantExperts, route
from radixserve.models.quant import B8_CODES, PACKED_CODES, QuantLinear
from radixserve.models.quant import ops as quant_ops
from radixserve.models.rope import inv_freq
from radixserve.models.synthetic import build_tiny_model

SLIDING, FULL = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("gpt_oss") / "tiny", seed=3, family="gpt_oss")


def test_config_reads_the_family(checkpoint: Path) -> None:
    _, cfg = load_model(checkpoint, torch.float32)
    expect = dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_layers=(),
        router_bias=True, topk_softmax=True, expert_bias=True, swiglu_alpha=1.702,
        swiglu_limit=7.0, attn_sinks=True, norm_weight_f32=True, qkv_bias=True, o_bias=True,
        head_dim=32, sliding_window=8, layer_types=(SLIDING, FULL, SLIDING, FULL),
        rope_theta=150000.0,
    )  # fmt: skip
    assert {k: getattr(cfg, k) for k in expect} == expect
    s = cfg.rope_scaling
    assert s is not None and (s.type, s.factor, s.original_max_position_embeddings) == (
        "yarn", 16.0, 64
    )  # fmt: skip
    assert not s.truncate and cfg.uniform_rope
    assert [cfg.window(i) for i in range(4)] == [8, 0, 8, 0]


# ---------------------------------------------------------------- YaRN

YARN_BASE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "max_position_embeddings": 4096, "num_hidden_layers": 2,
             "num_local_experts": 4, "num_experts_per_tok": 2}  # fmt: skip


@pytest.mark.parametrize(
    "params",
    [
        {"factor": 32.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
         "beta_slow": 1.0, "truncate": False},  # gpt-oss's own (scaled down)
        {"factor": 8.0, "original_max_position_embeddings": 512},  # truncated bounds
        {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 16,
         "beta_slow": 2, "attention_factor": 0.9},
        {"factor": 4.0, "original_max_position_embeddings": 1024, "mscale": 0.8,
         "mscale_all_dim": 0.6},
        {"factor": None, "original_max_position_embeddings": 256},  # 4096 / 256
        {"factor": 1.0, "original_max_position_embeddings": 4096},  # no attention factor
    ],
)  # fmt: skip
def test_yarn_frequencies_and_attention_factor_are_transformers(params: dict[str, Any]) -> None:
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **params}
    theirs = transformers.GptOssConfig(**YARN_BASE, rope_parameters=rope)
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    ours = ModelConfig.from_hf({**theirs.to_dict(), "architectures": ["GptOssForCausalLM"]})
    assert ours.rope_scaling is not None and ours.rope_scaling.type == "yarn"
    assert ours.rope_scaling.attention_factor == factor
    assert torch.equal(inv_freq(ours.rope), want)


def test_rope_theta_defaults_to_the_familys() -> None:
    cfg = {**YARN_BASE, "architectures": ["GptOssForCausalLM"], "intermediate_size": 32,
           "vocab_size": 256}  # fmt: skip
    assert ModelConfig.from_hf(cfg).rope_theta == 150000.0
    assert ModelConfig.from_hf({**cfg, "rope_theta": 5e5}).rope_theta == 5e5


# ---------------------------------------------------------------- against transformers


def test_logits_match_hf_through_prefill_extend_and_decode(checkpoint: Path) -> None:
    """Flat attention over the slots, and tree attention over sliding rows of their own: 80
    positions (prefill 20, extend 25, decode 35), ten windows and past YaRN's original
    context."""
    model, _ = load_model(checkpoint, torch.float32)
    assert not model.use_native_layers()
    ids = torch.randint(100, 20000, (80,), generator=torch.Generator().manual_seed(5)).tolist()
    want = hf_logits_one_at_a_time(hf_model(checkpoint), ids)
    for backend in (FlatBackend(), TreeBackend()):
        assert_close(our_logits(model, ids, backend), want, REL_TOL, backend.name)


def test_the_sinks_matter(checkpoint: Path) -> None:
    """Zeroed sinks move the logits far past the tolerance: the logits test checks them."""
    model, _ = load_model(checkpoint, torch.float32)
    ids = torch.randint(100, 20000, (30,), generator=torch.Generator().manual_seed(6)).tolist()
    want = hf_logits_one_at_a_time(hf_model(checkpoint), ids)
    for layer in model.model.layers:
        assert layer.self_attn.sinks is not None
        layer.self_attn.sinks.zero_()
    diff = (our_logits(model, ids) - want).abs().max().item()
    assert diff > 100 * REL_TOL * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_block_matches_hfs(checkpoint: Path, dtype: torch.dtype) -> None:
    """One MoE block over 40 tokens against HF's own block with the same weights: the
    experts' biases, interleaved gate / up columns and clamped SwiGLU (large inputs, so the
    clamps bind)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
    model, config = load_model(checkpoint, dtype, packed_linear=False)
    for i in range(config.num_layers):
        theirs, ours = hf.model.layers[i].mlp.eval(), model.model.layers[i].mlp
        assert isinstance(ours, MoE)
        x = torch.randn(1, 40, config.hidden_size, generator=torch.Generator().manual_seed(i))
        x = (4 * x).to(dtype)
        with torch.no_grad():
            want, got = theirs(x)[0].float(), ours(x[0]).float()
            gate_up = hf_gate_up(x[0].float(), hf.model.layers[i].mlp.experts)
        assert gate_up.abs().max() > 7.0  # the clamp at swiglu_limit 7 binds
        if dtype == torch.float32:
            assert torch.equal(got, want[0]), i
        else:
            assert_close(got, want[0], 1e-2, f"layer {i} {dtype}")


def hf_gate_up(x: torch.Tensor, experts: Any) -> torch.Tensor:
    """Every expert's gate/up projection of x (T, hidden), HF's layout -> (E, T, 2I)."""
    w, b = experts.gate_up_proj.float(), experts.gate_up_proj_bias.float()  # (E, h, 2I), (E, 2I)
    return torch.einsum("th,ehi->eti", x, w) + b[:, None]


def test_norms_multiply_by_their_weight_in_float32(checkpoint: Path) -> None:
    """bf16: gpt-oss's norm multiplies the float32 normalised rows by its weight (promoted to
    float32) before the cast back, where Llama's casts first; ours does the same."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    model, config = load_model(checkpoint, torch.bfloat16, packed_linear=False)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1, 30, config.hidden_size, generator=g) * 3).to(torch.bfloat16)
    with torch.no_grad():
        for name in ("input_layernorm", "post_attention_layernorm"):
            theirs = getattr(hf.model.layers[1], name)
            theirs.weight.copy_(torch.randn(config.hidden_size, generator=g))
            ours = getattr(model.model.layers[1], name)
            ours.weight.copy_(theirs.weight)
            assert torch.equal(ours(x[0]), theirs(x)[0]), name


def test_a_tied_router_picks_the_experts_hfs_does(tmp_path: Path) -> None:
    """Ties resolve as torch.topk resolves them on the same logits: layer 0's router scores
    expert 0 by its row and the other seven alike (weights 0, biases equal: a 7-way tie for
    the last slot, or both), layer 2's scores every expert alike (an 8-way tie)."""
    path = build_tiny_model(tmp_path / "tied", seed=9, family="gpt_oss")
    hf = hf_model(path)
    routers = [hf.model.layers[i].mlp.router for i in (0, 2)]
    with torch.no_grad():
        routers[0].weight[1:] = 0
        routers[0].bias[1:] = 0.25
        routers[1].weight[:] = 0
        routers[1].bias[:] = -0.5
    hf.save_pretrained(path)
    model, config = load_model(path, torch.float32)
    ids = torch.randint(100, 20000, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_close(our_logits(model, ids), hf_logits_one_at_a_time(hf, ids), REL_TOL, "tied")
    x = torch.randn(50, config.hidden_size, generator=torch.Generator().manual_seed(2))
    for i in (0, 2):
        with torch.no_grad():
            _, want_w, want_ids = hf.model.layers[i].mlp.router(x)
            logits = model.model.layers[i].mlp.gate(x)
        weights, got_ids = route(logits, 2, True, topk_softmax=True)
        assert torch.equal(got_ids, want_ids) and torch.equal(weights, want_w), i
    # layer 2: one choice for all, weighted alike
    assert len({tuple(r) for r in want_ids.tolist()}) == 1 and want_w[0].tolist() == [0.5, 0.5]


@pytest.mark.slow  # a server of its own (~3 s)
def test_server_greedy_matches_hf_generate(checkpoint: Path) -> None:
    """HF's greedy tokens for 8 prompts x 32 tokens (17-31 tokens each: past the window)
    from two engines: tree attention keeping every shared segment with speculative decoding,
    and flat attention with none."""
    check_server_greedy(checkpoint, seed=11)


@pytest.mark.slow  # a two-process engine: ~10 s
def test_tensor_parallel_greedy_matches_hf(checkpoint: Path) -> None:
    """Two ranks, each with half of the heads (and their sinks) and half of every expert's
    rows (and biases; the down bias added once): HF's greedy tokens."""
    check_tensor_parallel_greedy(checkpoint, seed=12)


# ---------------------------------------------------------------- what is refused

BASE = {"architectures": ["GptOssForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "intermediate_size": 32, "vocab_size": 256, "num_local_experts": 8,
        "num_experts_per_tok": 2, "sliding_window": 8,
        "layer_types": [SLIDING, FULL]}  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("quantization_config", {"quant_method": "mxfp4"}, "unsupported quantization_config="),
     ("num_experts_per_tok", 9, "unsupported num_experts_per_tok=9 with 8 experts"),
     ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0},
      "unsupported rope scaling type 'dynamic'"),
     ("layer_types", [SLIDING, "chunked_attention"], "unsupported layer_types"),
     ("hidden_act", "gelu", "unsupported hidden_act 'gelu'"),
     ("n_shared_experts", 1, "unsupported n_shared_experts=1")],
)  # fmt: skip
def test_unsupported_fields_are_named(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf({**BASE, field: value})
    training_only = {"router_aux_loss_coef": 0.9, "output_router_logits": True,
                     "attention_dropout": 0.1}  # fmt: skip
    assert ModelConfig.from_hf({**BASE, **training_only}).num_experts == 8


def test_a_missing_expert_bias_is_named(checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((checkpoint / name).read_bytes())
    state = load_file(str(checkpoint / "model.safetensors"))
    del state["model.layers.1.mlp.experts.gate_up_proj_bias"]
    del state["model.layers.0.self_attn.sinks"]
    save_file(state, str(tmp_path / "model.safetensors"))
    missing = ["model.layers.0.self_attn.sinks", "model.layers.1.mlp.experts.gate_proj_bias",
               "model.layers.1.mlp.experts.up_proj_bias"]  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(f"missing {missing}")):
        load_model(tmp_path, torch.float32)


# ---------------------------------------------------------------- GGUF files

MXFP4 = gguf.GGMLQuantizationType.MXFP4


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp folder, also the cache that GGUF files are converted into."""
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path


GGUF_MATH = ["head_dim", "attention_bias", "sliding_window", "layer_types", "num_local_experts",
             "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"]  # fmt: skip


def tiny_for_gguf() -> Any:
    """2 layers (sliding, full), untied (llama.cpp's gpt-oss needs `output`), experts of 128
    rows (MXFP4 blocks of 32), every parameter random."""
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
            "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False}  # fmt: skip
    config = transformers.GptOssConfig(
        **sizes(VOCAB), num_hidden_layers=2, head_dim=32, max_position_embeddings=512,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        tie_word_embeddings=False, rope_parameters=rope,
    )  # fmt: skip
    return randomized(transformers.GptOssForCausalLM(config), 13)


def converted(model: Any) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 values) of the model's tensors as llama.cpp's converter writes a
    float gpt-oss checkpoint: `sinks` + `.weight`; gate_up_proj transposed to (E, 2I, hidden)
    and split into its even (gate) and odd (up) rows, its bias alike; down_proj transposed to
    (E, hidden, I); names through the gguf package's map."""
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, model.config.num_hidden_layers)
    out = []
    for hf, t in model.state_dict().items():
        for name, v in _split(hf, t.float()).items():
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            out.append((gguf_name, v.contiguous().numpy()))
    return out


def _split(hf: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One HF tensor as the converter's tensors, under the names it maps (`converted`)."""
    stem, _, part = hf.rpartition(".")
    if part == "sinks":
        return {f"{hf}.weight": x}
    if part == "gate_up_proj":
        rows = x.transpose(1, 2)  # (E, 2I, hidden)
        return {f"{stem}.gate_proj.weight": rows[:, ::2], f"{stem}.up_proj.weight": rows[:, 1::2]}
    if part == "gate_up_proj_bias":
        return {f"{stem}.gate_proj.bias": x[:, ::2], f"{stem}.up_proj.bias": x[:, 1::2]}
    if part == "down_proj":
        return {f"{stem}.down_proj.weight": x.transpose(1, 2)}
    if part == "down_proj_bias":
        return {f"{stem}.down_proj.bias": x}
    return {hf: x}


def write_gpt_oss_gguf(model: Any, out: Path, experts: Any = F32, matrices: Any = F32) -> Path:
    """`model` as a gpt-oss GGUF: its experts' weights in `experts`, the layers' other
    matrices in `matrices` (the router F32, as the converter keeps it), the rest F32."""
    w = gguf.GGUFWriter(str(out), "gpt-oss")
    write_metadata(w, model.config)
    write_tokenizer(w)
    for name, x in converted(model):
        kind = experts if name.endswith("_exps.weight") else matrices
        if x.ndim == 2 and (not name.startswith("blk.") or ".ffn_gate_inp." in name):
            kind = F32
        kind = kind if x.ndim >= 2 and name.endswith(".weight") else F32
        if kind == F32:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_gguf_tensor_layout_is_the_converters() -> None:
    model = tiny_for_gguf()
    assert tensor_dims(model.config) == {name: x.shape for name, x in converted(model)}


def test_gguf_config_and_weights_equal_the_hf_models(cache: Path) -> None:
    """The converted folder's config equals the HF model's on every field that changes the
    math, and the model loaded from the file equals the one loaded from the HF folder."""
    hf = tiny_for_gguf()
    file = write_gpt_oss_gguf(hf, cache / "tiny-gpt-oss.gguf")
    folder = resolve_model_path(str(file))
    ours, theirs = transformers.AutoConfig.from_pretrained(folder), hf.config
    assert ours.architectures == ["GptOssForCausalLM"]
    for field in MATH + GGUF_MATH:
        assert getattr(ours, field) == getattr(theirs, field), field
    hf.save_pretrained(cache / "hf")
    from_gguf, _ = load_model(folder, torch.float32)
    from_hf, _ = load_model(cache / "hf", torch.float32)
    want = from_hf.state_dict()
    assert from_gguf.state_dict().keys() == want.keys()
    for name, t in from_gguf.state_dict().items():
        assert torch.equal(t, want[name]), name


@pytest.mark.parametrize(("experts", "matrices"), [(F32, F32), (MXFP4, Q8_0)])
def test_a_gguf_file_runs_as_its_hf_model(experts: Any, matrices: Any, cache: Path) -> None:
    """The file through the engine's loader gives the HF model's logits (prefill, extend,
    decodes past the window). MXFP4 experts (as llama.cpp's gpt-oss files hold them) and
    Q8_0 attention matrices stay in their blocks; the HF model gets the same rounded
    weights. x is rounded to int16 here (`activations="int16"`): the default int8 x of
    MXFP4's decode kernels moves these tiny random logits past this bound (tests/test_quant.py
    bounds that rounding)."""
    hf = tiny_for_gguf()
    path = write_gpt_oss_gguf(hf, cache / "gpt-oss.gguf", experts, matrices)
    kinds = {t.tensor_type for t in gguf_tensors(path).tensors if t.name.endswith("exps.weight")}
    assert kinds == {experts}
    model, _ = load_model(resolve_model_path(str(path)), torch.float32, activations="int16")
    assert (matrices == Q8_0) == any(isinstance(m, QuantLinear) for m in model.modules())
    assert (experts == MXFP4) == any(isinstance(m, QuantExperts) for m in model.modules())
    if matrices == Q8_0:
        plain, _ = load_model(resolve_model_path(str(path)), torch.float32, quantization="none")
        exact = {name: torch.from_numpy(x) for name, x in converted(hf)}
        for i in range(hf.config.num_hidden_layers):  # the experts dequantized in place
            got = plain.state_dict()[f"model.layers.{i}.mlp.experts.gate_up_proj"]
            want = torch.cat([exact[f"blk.{i}.ffn_{g}_exps.weight"] for g in ("gate", "up")], 1)
            assert (got - want).norm() < 0.2 * want.norm(), i  # MXFP4's error, not a mix-up
        set_hf_weights(hf, plain)
    ids = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(7)).tolist()
    want = hf_logits_one_at_a_time(hf, ids)
    assert_close(our_logits(model, ids), want, REL_TOL if matrices == F32 else 1e-3, "gguf")


def test_native_layers_compute_the_module_path(cache: Path) -> None:
    """MXFP4 experts and Q8_0 attention: every layer runs as two native calls around
    attention (pre_attention with the q/k/v biases; the backend's attention with the sinks
    and the sliding window; post_attention_moe with o's bias, the router's bias, top-k then
    softmax, and the MXFP4 experts with their biases and the clamped SwiGLU), with the module
    path's logits bit for bit through a 300-token extend (experts of ~75 rows) and a decode
    step; the experts' rows are whole 16-row tiles, packed at load."""
    path = write_gpt_oss_gguf(tiny_for_gguf(), cache / "gpt-oss.gguf", MXFP4, Q8_0)
    model, _ = load_model(resolve_model_path(str(path)), torch.float32)
    experts = [layer.mlp.experts for layer in model.model.layers]
    assert all(isinstance(e, QuantExperts) and e.formats == ["mxfp4"] * 3 for e in experts)
    native = quant_ops()
    tiles = PACKED_CODES["mxfp4"] if native is not None and native.packs else B8_CODES["mxfp4"]
    (_, gate_up, _), (_, down, _) = experts[0].native_arg()[:2]
    assert gate_up + down == [tiles] * 3
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    check_native_layers_are_the_module_path(model, ids)


def set_hf_weights(hf: Any, ours: Any) -> None:
    """Our (dequantized) model's weights into the HF model, in transformers' layout: q/k/v
    and the experts' gate/up unfused, gate/up columns interleaved, down transposed."""
    state = ours.state_dict()
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            p, a = f"model.layers.{i}.", layer.self_attn
            q, k, v = state[p + "self_attn.qkv_proj.weight"].split(
                [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
            )
            a.q_proj.weight.copy_(q), a.k_proj.weight.copy_(k), a.v_proj.weight.copy_(v)
            a.o_proj.weight.copy_(state[p + "self_attn.o_proj.weight"])
            e = layer.mlp.experts
            gate, up = state[p + "mlp.experts.gate_up_proj"].chunk(2, dim=1)  # (E, I, hidden)
            e.gate_up_proj[..., ::2] = gate.transpose(1, 2)
            e.gate_up_proj[..., 1::2] = up.transpose(1, 2)
            e.down_proj.copy_(state[p + "mlp.experts.down_proj"].transpose(1, 2))


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [("rope.scaling.type", "linear", "gpt-oss's RoPE is YaRN"),
     ("expert_feed_forward_length", 64, "differs from .feed_forward_length"),
     ("rope.freq_base_swa", 5e5, "the HF model has one RoPE base"),
     ("expert_weights_scale", 2.0, "radixserve does not read this gpt-oss key")],
)  # fmt: skip
def test_gguf_metadata_the_config_cannot_express_raises_naming_it(
    key: str, value: Any, why: str
) -> None:
    keys = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 128,
            "attention.sliding_window": 8, "rope.scaling.type": "yarn",
            "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 64}  # fmt: skip
    shapes = {"token_embd.weight": (VOCAB, 64)}
    meta = metadata("gpt-oss", **{**keys, key: value})
    with pytest.raises(ValueError, match=re.escape(f"gpt-oss.{key} = {value!r} in the GGUF")):
        config_from_metadata("gpt-oss", meta, shapes, {})
    with pytest.raises(ValueError, match=why):
        config_from_metadata("gpt-oss", meta, shapes, {})
    cfg = config_from_metadata("gpt-oss", metadata("gpt-oss", **keys), shapes, {})
    assert cfg["layer_types"] == [SLIDING, FULL] and cfg["rope_parameters"]["truncate"] is False
