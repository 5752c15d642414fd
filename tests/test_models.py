"""Our Llama-family model and loader against HF transformers (the oracle), in float32.

Tiny random checkpoints (hidden 64, 2 layers, 4 heads / 2 KV heads, vocab 256) are built with
the transformers classes, randomised with a fixed seed (weights large enough that logits are
far from ties), saved with save_pretrained, and loaded by our loader. Tolerances:
    float32 logits vs HF: max abs diff <= 1e-4 (measured ~1e-6)
    greedy tokens: identical to HF generate(do_sample=False)
The embedded SmolLM2 tests are marked slow (they load a 135M model twice).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from helpers import alloc_slots, extend, greedy_generate, make_pool
from safetensors.torch import load_file, save_file

from radixserve import kernels
from radixserve.attention.flat import FlatBackend
from radixserve.core.batch import ForwardBatch
from radixserve.models import ModelConfig, load_model, load_tokenizer, resolve_model_path
from radixserve.models.llama import Linear, LlamaForCausalLM, packed_linear_supported
from radixserve.models.resolve import gguf_source

TOL = 1e-4
VOCAB = 256
BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
# name -> (config class, extra kwargs). original_max_position_embeddings=64 puts the 8 RoPE
# wavelengths of head_dim 16 in all three llama3 bands (kept, smoothed, divided).
VARIANTS: dict[str, tuple[type, dict]] = {
    "llama": (transformers.LlamaConfig, {"tie_word_embeddings": False}),
    "llama_tied": (transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "llama3_rope": (
        transformers.LlamaConfig,
        {
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama_linear_rope_bias": (
        transformers.LlamaConfig,
        {
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": True, "rope_theta": 1e6}),
    # head_dim 32 != hidden / heads = 16: q_size 128 differs from hidden 64.
    "mistral": (transformers.MistralConfig, {"head_dim": 32, "sliding_window": None}),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: on this shared 2-core box, OpenMP spin-waiting between busy
    processes made float32 SmolLM2 decode steps 10-30x slower with 2 threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Linear weights ~ N(0, 1/fan_in), embeddings and biases N(0, 0.09), norms 1 +- 0.2."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif p.dim() == 2 and "embed" not in name:
                # Residual branches 3x louder than the embedding, else tied models echo input.
                gain = 3.0 if ("o_proj" in name or "down_proj" in name) else 1.0
                p.copy_(gain * noise / p.shape[1] ** 0.5)
            else:  # embeddings and biases
                p.copy_(0.3 * noise)  # small embeddings: layers, not the input token, dominate


def _build(folder: Path, name: str, seed: int) -> torch.nn.Module:
    cls, extra = VARIANTS[name]
    config = cls(**BASE, **extra)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(hf, seed)
    hf.generation_config.eos_token_id = None  # random models: always generate the full length
    hf.generation_config.pad_token_id = 0
    hf.save_pretrained(folder)
    return hf.eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    """name -> (checkpoint folder, HF model) for every variant."""
    root = tmp_path_factory.mktemp("ckpt")
    return {n: (root / n, _build(root / n, n, seed=i)) for i, n in enumerate(VARIANTS)}


def _hf_logits(hf: object, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # type: ignore[operator]


def _random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_matches_hf(checkpoints: dict, name: str) -> None:
    path, hf = checkpoints[name]
    _, cfg = load_model(path, torch.float32)
    hc = hf.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size) == (64, 2, VOCAB)
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)
    assert cfg.head_dim == (32 if name == "mistral" else 16)
    assert cfg.tie_word_embeddings == hc.tie_word_embeddings
    assert cfg.qkv_bias == (name in ("qwen2", "llama_linear_rope_bias"))
    assert cfg.o_bias == cfg.mlp_bias == (name == "llama_linear_rope_bias")
    assert cfg.rope_theta == hc.rope_parameters["rope_theta"]
    expected_scaling = {"llama3_rope": "llama3", "llama_linear_rope_bias": "linear"}.get(name)
    assert (cfg.rope_scaling.type if cfg.rope_scaling else None) == expected_scaling


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_logits_match_hf(checkpoints: dict, name: str) -> None:
    path, hf = checkpoints[name]
    model, _ = load_model(path, torch.float32)
    ids = _random_ids(40, seed=1)
    pool = make_pool(model, len(ids))
    slots = alloc_slots(pool, len(ids))
    ours = extend(model, FlatBackend(), pool, slots, ids, 0)
    diff = (ours - _hf_logits(hf, ids)).abs().max().item()
    assert diff <= TOL, f"{name}: max abs logit diff {diff:.2e}"
    assert ours.dtype == torch.float32 and ours.shape == (40, VOCAB)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefix_then_extend_then_decode_match_hf(checkpoints: dict, name: str) -> None:
    """Positions 0..12 prefill, 13..24 one extend over the cached prefix, 25..34 decodes."""
    path, hf = checkpoints[name]
    model, _ = load_model(path, torch.float32)
    ids = _random_ids(35, seed=2)
    pool = make_pool(model, 40)
    slots = alloc_slots(pool, 40)[torch.randperm(40)]  # scattered slots: indexing must follow them
    backend = FlatBackend()
    parts = [extend(model, backend, pool, slots, ids[:13], 0)]
    parts.append(extend(model, backend, pool, slots, ids[13:25], 13))
    parts += [extend(model, backend, pool, slots, [ids[p]], p) for p in range(25, 35)]
    diff = (torch.cat(parts) - _hf_logits(hf, ids)).abs().max().item()
    assert diff <= TOL, f"{name}: max abs logit diff {diff:.2e}"


def test_mixed_batch_of_requests_matches_hf(checkpoints: dict) -> None:
    """One step holding a decode, an extend over a cached prefix and a fresh prefill."""
    path, hf = checkpoints["llama3_rope"]
    model, _ = load_model(path, torch.float32)
    backend = FlatBackend()
    seqs = [_random_ids(n, seed=10 + n) for n in (20, 17, 9)]
    cached = [19, 5, 0]  # tokens already in the KV cache per request
    pool = make_pool(model, sum(len(s) for s in seqs))
    slots = [alloc_slots(pool, len(s)) for s in seqs]
    for s, sl, c in zip(seqs, slots, cached):
        if c:
            extend(model, backend, pool, sl, s[:c], 0)
    batch = ForwardBatch(
        input_ids=torch.tensor([t for s, c in zip(seqs, cached) for t in s[c:]]),
        positions=torch.cat([torch.arange(c, len(s)) for s, c in zip(seqs, cached)]),
        out_cache_loc=torch.cat([sl[c:] for sl, c in zip(slots, cached)]),
        seq_lens=[len(s) for s in seqs],
        extend_lens=[len(s) - c for s, c in zip(seqs, cached)],
        kv_indices=slots,
        paths=[[], [], []],
        kv_pool=pool,
    )
    backend.plan(batch)
    logits = model.compute_logits(model.forward(batch, backend))
    expected = torch.cat([_hf_logits(hf, s)[c:] for s, c in zip(seqs, cached)])
    diff = (logits - expected).abs().max().item()
    assert diff <= TOL, f"max abs logit diff {diff:.2e}"


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_matches_hf_generate(checkpoints: dict, name: str) -> None:
    path, hf = checkpoints[name]
    model, _ = load_model(path, torch.float32)
    lengths = torch.randint(3, 24, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    seen: set[int] = set()
    for i, n in enumerate(lengths):
        prompt = _random_ids(n, seed=100 + i)
        ours = greedy_generate(model, prompt, 16, FlatBackend())
        ids = torch.tensor([prompt])
        with torch.no_grad():  # explicit mask: HF would otherwise mask prompt tokens == pad id
            ref = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
            )
        assert ours == ref[0, n:].tolist(), f"{name} prompt {i}"
        seen |= set(ours)
    assert len(seen) >= 20, f"degenerate generations ({len(seen)} distinct tokens) prove little"


def test_bfloat16_close_to_hf_bfloat16(checkpoints: dict) -> None:
    """bf16 is not bit-exact with HF (fused matmuls reduce in another order); bound it."""
    path, _ = checkpoints["llama"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model, _ = load_model(path, torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = _random_ids(32, seed=4)
    pool = make_pool(model, len(ids))
    ours = extend(model, FlatBackend(), pool, alloc_slots(pool, len(ids)), ids, 0)
    ref = _hf_logits(hf, ids)
    scale = ref.abs().max().item()
    diff = (ours - ref).abs().max().item()
    assert diff <= 0.05 * scale, f"bf16 max abs diff {diff:.3f} vs logit scale {scale:.2f}"
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


@pytest.mark.skipif(
    not packed_linear_supported(torch.bfloat16, "cpu"), reason="no oneDNN bf16 on this CPU"
)
@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2"])
def test_packed_linear_matches_plain_bfloat16(checkpoints: dict, name: str) -> None:
    """The oneDNN packed fast path vs plain F.linear, both bf16: same math, other kernels."""
    path, _ = checkpoints[name]
    plain, _ = load_model(path, torch.bfloat16, packed_linear=False)
    packed, _ = load_model(path, torch.bfloat16)  # auto: packed for bf16 on CPU
    qkv = packed.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, Linear) and qkv.packed is not None and not hasattr(qkv, "weight")
    assert (packed.lm_head is None) == (packed.tied_head_packed is not None)
    ids = _random_ids(30, seed=5)
    logits = []
    for model in (plain, packed):
        pool = make_pool(model, len(ids) + 4)
        slots = alloc_slots(pool, len(ids) + 4)
        parts = [extend(model, FlatBackend(), pool, slots, ids, 0)]
        parts += [
            extend(model, FlatBackend(), pool, slots, [7 + i], len(ids) + i) for i in range(4)
        ]
        logits.append(torch.cat(parts))
    scale = logits[0].abs().max().item()
    diff = (logits[0] - logits[1]).abs().max().item()
    assert diff <= 0.02 * scale, f"packed vs plain bf16: max abs diff {diff:.3f}, scale {scale:.2f}"
    greedy = [greedy_generate(m, ids[:12], 12, FlatBackend()) for m in (plain, packed)]
    assert greedy[0] == greedy[1]


# ---- loader ---------------------------------------------------------------------------------


def test_sharded_checkpoint_loads_identically(checkpoints: dict, tmp_path: Path) -> None:
    path, hf = checkpoints["qwen2"]
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3, "expected several shards"
    sharded, _ = load_model(tmp_path, torch.float32)
    single, _ = load_model(path, torch.float32)
    for (n1, p1), (n2, p2) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def _copy_with_weights(src: Path, dst: Path, edit: dict[str, torch.Tensor | None]) -> None:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    weights = load_file(str(src / "model.safetensors"))
    for name, value in edit.items():
        if value is None:
            del weights[name]
        else:
            weights[name] = value
    save_file(weights, str(dst / "model.safetensors"))


def test_missing_weight_is_named(checkpoints: dict, tmp_path: Path) -> None:
    path, _ = checkpoints["llama"]
    _copy_with_weights(path, tmp_path / "m", {"model.layers.1.mlp.down_proj.weight": None})
    with pytest.raises(ValueError, match=r"missing \['model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(tmp_path / "m", torch.float32)


def test_unexpected_weight_is_named(checkpoints: dict, tmp_path: Path) -> None:
    path, _ = checkpoints["llama"]
    _copy_with_weights(
        path, tmp_path / "u", {"model.layers.0.self_attn.q_proj.bias": torch.ones(64)}
    )
    with pytest.raises(ValueError, match=r"unexpected \['model\.layers\.0\.self_attn\.q_proj"):
        load_model(tmp_path / "u", torch.float32)


def test_tied_checkpoint_with_redundant_lm_head_loads(checkpoints: dict, tmp_path: Path) -> None:
    path, hf = checkpoints["llama_tied"]
    embed = hf.model.embed_tokens.weight.detach().clone()
    _copy_with_weights(path, tmp_path / "t", {"lm_head.weight": embed})
    model, _ = load_model(tmp_path / "t", torch.float32)
    assert model.lm_head is None
    hidden = torch.randn(3, 64)
    assert torch.equal(model.compute_logits(hidden), hidden @ embed.T)


def test_unsupported_architecture_and_rope_raise() -> None:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
    }
    with pytest.raises(ValueError, match="supported: LlamaForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf({**cfg, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="unsupported rope scaling type 'dynamic'"):
        ModelConfig.from_hf({**cfg, "rope_scaling": {"type": "dynamic", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf({**cfg, "hidden_act": "gelu"})


def test_old_and_new_rope_layouts_and_eos_parse_alike() -> None:
    base = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 256,
        "eos_token_id": [7, 2],
    }
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}  # fmt: skip
    old = ModelConfig.from_hf(
        {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama3}},
        {"eos_token_id": 9},
    )
    new = ModelConfig.from_hf(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}},
        {"eos_token_id": [2, 9]},
    )
    assert old == new
    assert old.eos_token_ids == (7, 2, 9)
    assert old.rope_theta == 5e5 and old.rope_scaling is not None
    assert old.rope_scaling.original_max_position_embeddings == 8192
    assert old.num_kv_heads == 4 and old.head_dim == 16  # defaults: MHA, hidden / heads


def test_resolve_model_path_rejects_non_model_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path


# ---- embedded SmolLM2-135M-Instruct (slow) --------------------------------------------------

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[LlamaForCausalLM, object, object, ModelConfig]:
    path = resolve_model_path(None)
    # The dequantized weights, as HF loads them (tests/test_quant.py covers the quantized path):
    # the converted folder holds no weights, so HF reads the GGUF with its own loader.
    model, cfg = load_model(path, torch.float32, quantization="none")
    gguf = gguf_source(path)
    assert gguf is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    return model, hf, load_tokenizer(path), cfg


def _chat_ids(tokenizer: object, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids  # type: ignore[operator]


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["cpu", "reference"])
def test_smollm2_logits_match_hf(smollm2: tuple, impl: str) -> None:
    """Both attention kernels: "cpu" is the same SDPA kernel HF uses (measured diff 0.0),
    "reference" is plain einsum math (measured ~8e-5)."""
    model, hf, tok, cfg = smollm2
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    ids = _chat_ids(tok, CHATS[0])
    pool = make_pool(model, len(ids))
    before = kernels.get_impl()
    kernels.set_impl(impl)
    try:
        ours = extend(model, FlatBackend(), pool, alloc_slots(pool, len(ids)), ids, 0)
    finally:
        kernels.set_impl(before)
    diff = (ours - _hf_logits(hf, ids)).abs().max().item()
    print(f"SmolLM2 float32 prefill ({len(ids)} tokens, {impl}): max abs logit diff {diff:.2e}")
    assert diff <= 1e-3, f"max abs logit diff {diff:.2e}"


@pytest.mark.slow
def test_smollm2_greedy_chat_matches_hf(smollm2: tuple) -> None:
    model, hf, tok, cfg = smollm2
    for question in CHATS:
        ids = _chat_ids(tok, question)
        ours = greedy_generate(model, ids, 24, FlatBackend(), cfg.eos_token_ids)
        t = torch.tensor([ids])
        with torch.no_grad():
            ref = hf.generate(
                t, attention_mask=torch.ones_like(t), max_new_tokens=24, do_sample=False
            )
        assert ours == ref[0, len(ids) :].tolist(), question
        if question == CHATS[0]:
            assert "Paris" in tok.decode(ours), tok.decode(ours)


# ------------------------------------------------------------------ native fused ops
def native_ops_or_skip():
    from radixserve.models import native

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the model uses the torch-op RMSNorm and RoPE here")
    module = native.ops()
    assert module is not None, "a C++ compiler is present but the fused ops did not build"
    return module


def torch_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def test_native_rms_norm_matches_torch_formula() -> None:
    """Bit for bit at decode and prefill-chunk sizes (incl. a strided view); on large inputs
    torch reorders its own float32 sum: a normalised value may round one bf16 ulp apart, two
    after the weight's rounding (measured: 14 of 1.2M elements at 2048 x 576)."""
    fused = native_ops_or_skip()
    gen = torch.Generator().manual_seed(0)
    for rows, h in [(1, 576), (16, 576), (300, 64), (7, 960)]:
        x = (torch.randn(rows, h, generator=gen) * 3).bfloat16()
        w = torch.rand(h, generator=gen).bfloat16()
        assert torch.equal(fused.rms_norm(x, w, 1e-5), torch_rms(x, w, 1e-5)), (rows, h)
    wide = (torch.randn(16, 1000, generator=gen) * 3).bfloat16()
    w = torch.rand(576, generator=gen).bfloat16()
    view = wide[:, :576]  # row stride 1000
    assert torch.equal(fused.rms_norm(view, w, 1e-6), torch_rms(view, w, 1e-6))
    big = (torch.randn(2048, 576, generator=gen) * 3).bfloat16()
    w = torch.rand(576, generator=gen).bfloat16()
    torch.testing.assert_close(
        fused.rms_norm(big, w, 1e-5).float(), torch_rms(big, w, 1e-5).float(), atol=1e-6, rtol=2**-6
    )


def test_native_float32_ops_match_torch() -> None:
    """float32 rows: RoPE bit for bit; RMSNorm within float32 rounding of the sum order."""
    from radixserve.models.rope import apply_rope

    fused = native_ops_or_skip()
    gen = torch.Generator().manual_seed(3)
    for rows, h in [(1, 576), (33, 960)]:
        x = torch.randn(rows, h + 3, generator=gen)[:, :h] * 3  # strided rows
        w = torch.rand(h, generator=gen)
        want = w * torch.nn.functional.rms_norm(x, (h,), None, 1e-5)
        torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), want, rtol=2e-6, atol=1e-6)
    t, hq, hkv, d = 5, 9, 3, 64
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen)
    ang = torch.rand(t, d // 2, generator=gen) * 500
    c, s_ = ang.cos(), ang.sin()
    table = torch.stack((torch.cat((c, c), -1), torch.cat((-s_, s_), -1)), 1)
    q, k = fused.rope_qk(qkv, table, hq, hkv)
    want = apply_rope(qkv[:, : (hq + hkv) * d].reshape(t, hq + hkv, d), table[:, None, 0],
                      table[:, None, 1])  # fmt: skip
    assert torch.equal(q, want[:, :hq]) and torch.equal(k, want[:, hq:])


def test_native_rope_matches_torch_ops() -> None:
    """Fused RoPE of the q and k heads == the torch-op path (apply_rope), bit for bit."""
    from radixserve.models.rope import apply_rope

    fused = native_ops_or_skip()
    gen = torch.Generator().manual_seed(1)
    for t, hq, hkv, d in [(1, 9, 3, 64), (16, 9, 3, 64), (300, 4, 2, 32), (7, 8, 8, 16)]:
        width = (hq + 2 * hkv) * d
        qkv = (torch.randn(t, width + 5, generator=gen) * 3).bfloat16()[:, :width]  # strided rows
        ang = torch.rand(t, d // 2, generator=gen) * 500
        c, s_ = ang.cos(), ang.sin()
        table = torch.stack((torch.cat((c, c), -1), torch.cat((-s_, s_), -1)), 1).bfloat16()
        q, k = fused.rope_qk(qkv, table, hq, hkv)
        qk = qkv[:, : (hq + hkv) * d].reshape(t, hq + hkv, d)
        want = apply_rope(qk, table[:, None, 0], table[:, None, 1])
        assert q.is_contiguous() and torch.equal(q, want[:, :hq]), (t, hq, hkv, d)
        assert torch.equal(k, want[:, hq:]), (t, hq, hkv, d)
    with pytest.raises(RuntimeError, match="too few columns"):
        fused.rope_qk(torch.ones(2, 64, dtype=torch.bfloat16), table[:2], 9, 3)


def test_native_rms_norm_rejects_bad_input_and_can_be_disabled() -> None:
    from radixserve.models import native
    from radixserve.native_build import use_native_ops

    fused = native_ops_or_skip()
    w = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16 or float32 expected"):
        fused.rms_norm(torch.ones(2, 8, dtype=torch.float16), w, 1e-5)
    with pytest.raises(RuntimeError, match=r"of x's dtype expected"):
        fused.rms_norm(torch.ones(2, 8), w, 1e-5)
    with pytest.raises(RuntimeError, match=r"contiguous \(8,\) of x's dtype expected"):
        fused.rms_norm(
            torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), 1e-5
        )
    use_native_ops(False)  # what a worker does for EngineConfig(native_ops=False)
    try:
        assert native.ops() is None
        x = torch.randn(4, 8).bfloat16()  # the model's rms_norm falls back to torch ops
        from radixserve.models.llama import rms_norm

        assert torch.equal(rms_norm(x, w, 1e-5), torch_rms(x, w, 1e-5))
    finally:
        use_native_ops(True)
    assert native.ops() is fused
