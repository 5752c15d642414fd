"""benchmarks/make_gguf.py at a tiny shape: the F16 file it streams loads in radixserve (and
generates), with the shape's config and the embedded tokenizer; where llama-cpp-python is
installed (the bench extra), its quantizer turns that file into a Q4_K_M that loads with
every projection native."""

from __future__ import annotations

from pathlib import Path

import make_gguf
import pytest

from radixserve import Engine
from radixserve.models.quant import QuantLinear

TINY = make_gguf.Shape("llama", 256, 2, 4, 2, 512, 10000.0, tied=True)


@pytest.fixture
def tiny_f16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "tiny-F16.gguf"
    make_gguf.write_random_f16(TINY, out, seed=0)
    return out


@pytest.mark.slow  # converts the 49k-token vocabulary and loads the file (~12 s)
def test_random_f16_file_loads_and_generates(tiny_f16: Path) -> None:
    engine = Engine(str(tiny_f16), dtype="float32", max_total_tokens=256)
    mc = engine.worker.model_config
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == (256, 2, 4, 2)
    assert mc.intermediate_size == 512 and mc.vocab_size == len(engine.tokenizer)
    chat = engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.endswith("<|im_start|>assistant\n")  # the embedded tokenizer's template
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    assert len(engine.generate(chat, params)["output_ids"]) == 8


@pytest.mark.slow  # a second tokenizer conversion and llama.cpp's quantizer: ~25 s
def test_llama_cpp_quantizes_it_to_q4_k_m_and_every_projection_loads_native(
    tiny_f16: Path, tmp_path: Path
) -> None:
    pytest.importorskip("llama_cpp")  # the bench extra
    q4km = tmp_path / "tiny-Q4_K_M.gguf"
    make_gguf.quantize(tiny_f16, q4km, "Q4_K_M", threads=2)
    engine = Engine(str(q4km), dtype="float32", max_total_tokens=256)
    model = engine.worker.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 4 + 1  # 4 projections a layer, the tied embedding
    formats = {f.name for m in linears for f in m.formats}
    assert {"q4_k", "q6_k"} <= formats, formats
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    assert len(engine.generate("Hello", params)["output_ids"]) == 4
