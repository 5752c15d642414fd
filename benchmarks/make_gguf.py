"""GGUF files of the sizes users serve, for benchmarks: random weights written straight in
llama.cpp's quantized layouts, or F16 quantized by llama.cpp's own quantizer.

    python benchmarks/make_gguf.py --shape gemma-3-12b --types Q4_K_M --out models/
    python benchmarks/make_gguf.py --shape llama-3.2-1b --types Q4_K_M --via-f16 --out models/
    python benchmarks/make_gguf.py --shape smollm2-135m --types Q4_K_M Q6_K --out models/
    python benchmarks/make_gguf.py --shape gpt-oss-20b --types MXFP4 --out models/

Random-weight shapes (`SHAPES`: Llama-3.2-1B / 3B, Llama-3.1-8B, Qwen2.5-1.5B, Qwen3-0.6B /
8B, Gemma-3-4B / 12B (text), Phi-4-mini, SmolLM3-3B, and the mixtures of experts
Qwen3-30B-A3B, OLMoE-1B-7B and gpt-oss-20b) are each model's published config.json
sizes, written with llama.cpp's converter's metadata keys and tensor names
(radixserve/models/gguf_layout.py) and the embedded SmolLM2 tokenizer and chat template: its
49152-token vocabulary, so the embedding and output are smaller than the real models' (128k
to 262k tokens), except for a shape that gives its `vocab_size` (gpt-oss-20b's 201088: its
embedding and output are a tenth of its bytes read a token), to which the vocabulary is
padded with unused tokens. Norms are 1 (Gemma's stored 1 + w with w = 0), biases 0 (gpt-oss's
sinks 1). Both systems read the same file, and their speed depends on shapes and types, not
values. Two ways to write one:

- direct (the default for Q4_0, Q8_0, Q4_K_M, Q5_K_M, Q6_K): every matrix is random blocks
  (`synthetic.random_blocks`: random quants, finite fp16 scales) in the type llama.cpp's
  quantizer would give it in that file (`tensor_type`: Q4_K_M's Q6_K tensors, the fallbacks
  for rows that are not whole 256-weight super-blocks), 1-D tensors F32. No F16
  intermediate: a 12B Q4_K_M takes under a minute and only its own 6.6 GB of disk. For
  speed runs. `MXFP4` is the type mix of the gpt-oss files OpenAI's checkpoints convert to
  (llama.cpp's MXFP4_MOE): experts MXFP4 (random codes, E8M0 exponents giving weights of
  about 0.02-0.1), the other matrices Q8_0, router, norms, biases and sinks F32.
- `--via-f16`: an F16 file of N(0, 0.02) weights, then `llama_cpp.llama_model_quantize` (the
  bench extra's llama-cpp-python): realistic value distributions (what quality or numerics
  checks want), at the cost of the F16 file (24 GB for a 12B) and minutes of quantizing.

`smollm2-135m` is the embedded model's real weights (its Q4_1/Q8_0 tensors dequantized to
F16, in the file's own layout), always quantized by llama.cpp, for quality checks against
it. Tensors are streamed to disk one at a time (never the whole model in memory); an F16
intermediate is deleted unless F16 is one of the --types.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, ReaderTensor
from gguf.quants import dequantize, quant_shape_to_byte_shape

from radixserve.models.gguf_layout import (
    gguf_architecture,
    rope_tensors,
    tensor_dims,
    write_metadata,
)
from radixserve.models.gguf_weights import NATIVE
from radixserve.models.resolve import embedded_gguf
from radixserve.models.synthetic import copy_tokenizer, random_blocks

T = GGMLQuantizationType
# llama.cpp's llama_ftype values (include/llama.h)
FTYPES = {"F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "MXFP4": 38}
# The direct writer's file types -> the type of most matrices (llama_ftype_get_default_type)
BASE_TYPES = {"Q4_0": T.Q4_0, "Q8_0": T.Q8_0, "Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K, "Q6_K": T.Q6_K,
              "MXFP4": T.Q8_0}  # fmt: skip
EXPERT_TYPES = {"MXFP4": T.MXFP4}  # the stacked experts' type where it is not the base one
MIXED = ("Q4_K_M", "Q5_K_M")  # their attn_v / attn_qkv / ffn_down: Q6_K in some layers
MORE_BITS = ("attn_v", "attn_qkv", "ffn_down")
# A K-quant whose rows are not whole super-blocks: llama.cpp's replacement (then F16 where
# even that does not divide the row)
FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}
VALUES = {T.F16: np.float16, T.F32: np.float32}  # the types stored as plain values
CONTEXT = 8192  # the Llama / Qwen2.5 shapes: positions without their RoPE scaling


def shape(
    model_type: str, sizes: tuple[int, int, int, int, int], context: int, theta: float,
    eps: float, tied: bool, **fields: Any,
) -> dict[str, Any]:  # fmt: skip
    """config.json fields: sizes = (hidden, layers, heads, KV heads, FFN), RoPE base `theta`
    unscaled unless `fields` has rope_parameters."""
    hidden, layers, heads, kv_heads, ffn = sizes
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": ffn, "max_position_embeddings": context, "rms_norm_eps": eps,
            "tie_word_embeddings": tied,
            "rope_parameters": {"rope_type": "default", "rope_theta": theta}, **fields}  # fmt: skip


def gemma3_rope(scale: float) -> dict[str, Any]:
    """Gemma 3: global layers RoPE base 1e6 linearly scaled, sliding layers base 10000."""
    return {"full_attention": {"rope_type": "linear", "factor": scale, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip


def longrope(rotary: int, head_dim: int, original: int) -> dict[str, Any]:
    """Phi-3 longrope, `rotary` of `head_dim` dims rotating, over `original` positions. The
    short factors are 1 (as Phi-4-mini's); the long ones a geometric ramp from 1 to 48, the
    range of Phi-4-mini's published ones but not their values (speed does not depend on
    them)."""
    n = rotary // 2
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "partial_rotary_factor": rotary / head_dim,
            "original_max_position_embeddings": original, "short_factor": [1.0] * n,
            "long_factor": np.geomspace(1.0, 48.0, n).round(4).tolist()}  # fmt: skip


# Each model's config.json on the Hugging Face Hub (Gemma 3: its text_config), the fields that
# llama.cpp's converter reads; the vocabulary is the embedded one (above). A file's
# general.name is its stem: no name may contain "phi3" or "phi-3", for which llama.cpp sets
# attributes of Phi-3's own tokens (</s>, <s>, <unk>; the embedded vocabulary lacks them, and
# loading fails with "error loading model vocabulary: unordered_map::at").
SHAPES: dict[str, dict[str, Any]] = {
    # meta-llama/Llama-3.2-1B, -3B, Llama-3.1-8B (Llama-3 RoPE scaling left out)
    "llama-3.2-1b": shape("llama", (2048, 16, 32, 8, 8192), CONTEXT, 5e5, 1e-5, tied=True),
    "llama-3.2-3b": shape("llama", (3072, 28, 24, 8, 8192), CONTEXT, 5e5, 1e-5, tied=True),
    "llama-3.1-8b": shape("llama", (4096, 32, 32, 8, 14336), CONTEXT, 5e5, 1e-5, tied=False),
    # Qwen/Qwen2.5-1.5B: q/k/v biases
    "qwen2.5-1.5b": shape("qwen2", (1536, 28, 12, 2, 8960), CONTEXT, 1e6, 1e-6, tied=True),
    # Qwen/Qwen3-0.6B, Qwen3-8B: head_dim 128 (0.6B: 16 heads x 128 > hidden 1024), q/k norms
    "qwen3-0.6b": shape("qwen3", (1024, 28, 16, 8, 3072), 40960, 1e6, 1e-6, tied=True,
                        head_dim=128),
    "qwen3-8b": shape("qwen3", (4096, 36, 32, 8, 12288), 40960, 1e6, 1e-6, tied=False,
                      head_dim=128),
    # google/gemma-3-4b-it, gemma-3-12b-it: head_dim 256 (queries scaled by it), window 1024 on
    # 5 of every 6 layers (llama.cpp's default pattern), global RoPE linearly scaled by 8
    "gemma-3-4b": shape("gemma3_text", (2560, 34, 8, 4, 10240), 131072, 1e6, 1e-6, tied=True,
                        head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                        rope_parameters=gemma3_rope(8.0)),
    "gemma-3-12b": shape("gemma3_text", (3840, 48, 16, 8, 15360), 131072, 1e6, 1e-6, tied=True,
                         head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                         rope_parameters=gemma3_rope(8.0)),
    # microsoft/Phi-4-mini-instruct: 96 of 128 head dims rotate, longrope over 4096 positions
    "phi-4-mini": shape("phi3", (3072, 32, 24, 8, 8192), 131072, 1e4, 1e-5, tied=True,
                        sliding_window=262144, original_max_position_embeddings=4096,
                        rope_parameters=longrope(96, 128, 4096)),
    # HuggingFaceTB/SmolLM3-3B: every 4th layer without RoPE
    "smollm3-3b": shape("smollm3", (2048, 36, 16, 4, 11008), 65536, 5e6, 1e-6, tied=True),
    # Qwen/Qwen3-30B-A3B: 128 experts of 768 rows, 8 per token, in every layer
    "qwen3-30b-a3b": shape("qwen3_moe", (2048, 48, 32, 4, 6144), 40960, 1e6, 1e-6, tied=False,
                           head_dim=128, num_experts=128, num_experts_per_tok=8,
                           moe_intermediate_size=768, norm_topk_prob=True),
    # allenai/OLMoE-1B-7B-0924: 64 experts of 1024 rows, 8 per token, not renormalised
    "olmoe-1b-7b": shape("olmoe", (2048, 16, 16, 16, 1024), 4096, 1e4, 1e-5, tied=False,
                         num_experts=64, num_experts_per_tok=8, norm_topk_prob=False),
    # openai/gpt-oss-20b: 32 experts of 2880 rows with biases, 4 per token, clamped SwiGLU;
    # window 128 on every other layer, attention sinks, q/k/v/o biases, head_dim 64, YaRN
    "gpt-oss-20b": shape("gpt_oss", (2880, 24, 64, 8, 2880), 131072, 150000.0, 1e-5,
                         tied=False, head_dim=64, num_local_experts=32, num_experts_per_tok=4,
                         sliding_window=128, swiglu_limit=7.0, attention_bias=True,
                         vocab_size=201088,
                         layer_types=["sliding_attention", "full_attention"] * 12,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                          "factor": 32.0, "original_max_position_embeddings":
                                          4096, "beta_fast": 32.0, "beta_slow": 1.0,
                                          "truncate": False}),
}  # fmt: skip


def hf_config(fields: dict[str, Any], vocab: int) -> Any:
    """The transformers config of `fields` (config.json's) with the embedded vocabulary's
    size `vocab`, or the shape's own `vocab_size`."""
    from transformers import AutoConfig

    rest = {k: v for k, v in fields.items() if k not in ("model_type", "vocab_size")}
    no_ids = dict.fromkeys(["bos_token_id", "eos_token_id", "pad_token_id"])  # the tokenizer's
    size = fields.get("vocab_size", vocab)
    return AutoConfig.for_model(fields["model_type"], vocab_size=size, **no_ids, **rest)


# ---------------------------------------------------------------- llama.cpp's type mix


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third
    between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, dims: tuple[int, ...], ftype: str, layers: int, tied: bool) -> T:
    """The type llama.cpp's quantizer (llama_tensor_get_type, no importance matrix) gives
    tensor `name` of `dims` (numpy order) in an `ftype` file of `layers` layers. 1-D tensors
    and biases (stacked experts': 2-D) stay F32, and so does a MoE router (`ffn_gate_inp`,
    never quantized). The output matrix (the embedding when tied) is Q6_K, Q8_0 in a Q8_0
    file or where the base type does not divide its rows. Q4_K_M / Q5_K_M make attn_v /
    attn_qkv and ffn_down (stacked experts' ffn_down_exps too) Q6_K in the `more_bits`
    layers (llama.cpp counts them in layer order). An MXFP4 file's stacked experts are
    MXFP4, its other matrices Q8_0. Not modelled: the types llama.cpp gives a model of
    exactly 8 experts (Mixtral's attn_k / attn_v / attn_output), a shape not written here."""
    if len(dims) == 1 or name.endswith((".bias", "ffn_gate_inp.weight")):  # (E, rows) biases
        return T.F32
    if ftype == "F16":
        return T.F16
    if ftype in EXPERT_TYPES and name.endswith("_exps.weight"):
        return fallback(EXPERT_TYPES[ftype], dims[-1])
    base, cols = BASE_TYPES[ftype], dims[-1]
    parts = name.split(".")  # blk.{i}.{kind}.weight, or {kind}.weight
    kind = parts[-2].removesuffix("_exps")
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = T.Q8_0 if cols % GGML_QUANT_SIZES[base][0] or base == T.Q8_0 else T.Q6_K
    elif ftype in MIXED and kind in MORE_BITS and more_bits(int(parts[1]), layers):
        qtype = T.Q6_K
    else:
        qtype = base
    return fallback(qtype, cols)


def fallback(qtype: T, cols: int) -> T:
    """`qtype`, or llama.cpp's replacement where it does not divide a row of `cols`."""
    if cols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    qtype = FALLBACK.get(qtype, T.F16)
    return qtype if cols % GGML_QUANT_SIZES[qtype][0] == 0 else T.F16


# ---------------------------------------------------------------- tensors, streamed


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]  # numpy order: (rows, cols) for a matrix
    qtype: T
    fill: Callable[[], np.ndarray]  # made when written: values, or (rows, row bytes) blocks


def random_tensors(cfg: Any, ftype: str, seed: int) -> Iterator[Tensor]:
    """Every tensor of a random model of `cfg` in `ftype`'s types: RoPE tensors as the
    converter writes them, norms (and sinks) 1, biases 0, matrices N(0, 0.02) in F16 or
    random blocks."""
    layers, tied = cfg.num_hidden_layers, cfg.tie_word_embeddings
    for name, x in rope_tensors(cfg).items():
        yield Tensor(name, x.shape, T.F32, x.copy)
    for i, (name, dims) in enumerate(tensor_dims(cfg).items()):
        qtype = tensor_type(name, dims, ftype, layers, tied)
        yield Tensor(name, dims, qtype, filler(name, dims, qtype, seed * 100_003 + i))


def filler(name: str, dims: tuple[int, ...], qtype: T, seed: int) -> Callable[[], np.ndarray]:
    """What makes tensor `name`'s values (or blocks) when it is written."""
    if len(dims) == 1 or name.endswith(".bias"):
        value = 0.0 if name.endswith(".bias") else 1.0
        return lambda: np.full(dims, value, dtype=np.float32)
    if qtype in VALUES:
        g = np.random.default_rng(seed)
        return lambda: (g.standard_normal(dims, dtype=np.float32) * 0.02).astype(VALUES[qtype])
    *stack, rows, cols = dims  # stacked experts: (E, rows, cols)
    n = int(np.prod(stack, dtype=np.int64))
    return lambda: random_blocks(n * rows, cols, NATIVE[qtype], seed).reshape(*stack, rows, -1)


def stream(w: GGUFWriter, tensors: list[Tensor]) -> None:
    """Write the header (every tensor's name, shape and type), then each tensor as it is
    made."""
    for t in tensors:
        block, block_bytes = GGML_QUANT_SIZES[t.qtype]
        nbytes = int(np.prod(t.dims)) // block * block_bytes
        if t.qtype in VALUES:
            w.add_tensor_info(t.name, t.dims, np.dtype(VALUES[t.qtype]), nbytes)
        else:  # blocks: the writer takes their (rows, row bytes) shape
            rows = quant_shape_to_byte_shape(t.dims, t.qtype)
            w.add_tensor_info(t.name, rows, np.dtype(np.uint8), nbytes, raw_dtype=t.qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        w.write_tensor_data(t.fill())
    w.close()


def write_random(fields: dict[str, Any], ftype: str, out: Path, seed: int) -> None:
    """A random model of config.json `fields` as an `ftype` file (F16 or a direct type)."""
    reader = GGUFReader(embedded_gguf())
    cfg = hf_config(fields, len(reader.fields["tokenizer.ggml.tokens"].contents()))
    w = GGUFWriter(str(out), gguf_architecture(cfg))
    w.add_name(out.stem)
    write_metadata(w, cfg)
    w.add_file_type(FTYPES[ftype])
    if ftype != "F16":
        w.add_quantization_version(2)  # GGML_QNT_VERSION, as llama.cpp's quantizer writes
    copy_tokenizer(reader, w, cfg.vocab_size)
    stream(w, list(random_tensors(cfg, ftype, seed)))


# ---------------------------------------------------------------- the embedded model


def smollm2_tensors(reader: GGUFReader) -> Iterator[Tensor]:
    """The embedded model's tensors, quantized ones dequantized to F16 (1-D ones F32), in
    the file's order and layout (its q/k rows keep llama.cpp's order)."""
    for t in reader.tensors:
        dims = tuple(int(s) for s in reversed(t.shape))
        qtype, dtype = (T.F32, np.float32) if len(dims) == 1 else (T.F16, np.float16)

        def fill(
            t: ReaderTensor = t, dims: tuple[int, ...] = dims, dtype: type = dtype
        ) -> np.ndarray:
            return dequantize(t.data, t.tensor_type).reshape(dims).astype(dtype)

        yield Tensor(t.name, dims, qtype, fill)


def write_smollm2_f16(out: Path) -> None:
    reader = GGUFReader(embedded_gguf())
    w = GGUFWriter(str(out), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue  # written by GGUFWriter itself, or changed below
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    w.add_file_type(FTYPES["F16"])
    stream(w, list(smollm2_tensors(reader)))


# ---------------------------------------------------------------- main


def quantize(src: Path, dst: Path, ftype: str, threads: int) -> None:
    import llama_cpp  # the bench extra

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    assert rc == 0, f"llama_model_quantize({src.name} -> {ftype}) returned {rc}"


def timed(path: Path, start: float) -> Path:
    print(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
    return path


def make(
    shape_name: str, types: list[str], out_dir: Path, seed: int, threads: int,
    via_f16: bool = False,
) -> list[Path]:  # fmt: skip
    """The files of `shape_name` in `types` under `out_dir` ({shape}-{type}.gguf): random
    shapes written directly where they can be (unless `via_f16`), the rest quantized by
    llama.cpp from one F16 file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    random = shape_name in SHAPES
    direct = [t for t in types if random and not via_f16 and t in BASE_TYPES]
    made = {}
    for t in direct:
        made[t], start = out_dir / f"{shape_name}-{t}.gguf", time.perf_counter()
        write_random(SHAPES[shape_name], t, made[t], seed)
        timed(made[t], start)
    rest = [t for t in types if t not in direct]
    if rest:
        made |= from_f16(shape_name, rest, out_dir, seed, threads)
    return [made[t] for t in types]


def from_f16(
    shape_name: str, types: list[str], out_dir: Path, seed: int, threads: int
) -> dict[str, Path]:
    """One F16 file (kept only if F16 is in `types`), quantized by llama.cpp to the rest."""
    f16 = out_dir / f"{shape_name}-F16.gguf"
    start = time.perf_counter()
    if shape_name in SHAPES:
        write_random(SHAPES[shape_name], "F16", f16, seed)
    else:
        write_smollm2_f16(f16)
    made = {"F16": timed(f16, start)}
    for t in types:
        if t != "F16":
            made[t] = out_dir / f"{shape_name}-{t}.gguf"
            start = time.perf_counter()
            quantize(f16, made[t], t, threads)
            timed(made[t], start)
    if "F16" not in types:
        f16.unlink()
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=[*SHAPES, "smollm2-135m"])
    ap.add_argument("--types", nargs="+", default=["Q4_K_M"], choices=list(FTYPES))
    ap.add_argument(
        "--via-f16",
        action="store_true",
        help="quantize an F16 file with llama.cpp (realistic values; slow, big)",
    )
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's quantizer's")
    args = ap.parse_args()
    make(args.shape, args.types, args.out, args.seed, args.threads, args.via_f16)


if __name__ == "__main__":
    main()
