"""GGUF files of the sizes users serve, for benchmarks, quantized by llama.cpp's own quantizer.

    python benchmarks/make_gguf.py --shape llama-3.2-1b --types Q4_K_M Q4_0 --out models/
    python benchmarks/make_gguf.py --shape smollm2-135m --types Q4_K_M Q6_K --out models/

Random-weight shapes (`SHAPES`: Llama-3.2-1B / 3B, Llama-3.1-8B, Qwen2.5-1.5B) are written
as F16 with the `gguf` package, weights N(0, 0.02) and unit norms, with the embedded
SmolLM2 tokenizer and chat template (its 49152-token vocabulary: the embedding and output
are smaller than the real models' 128k-token ones), then quantized with
`llama_cpp.llama_model_quantize` (the bench extra's llama-cpp-python): both systems read the
same file, and speed depends on shapes, not values. `smollm2-135m` is the embedded model's
real weights (its Q4_1/Q8_0 tensors dequantized to F16, in the file's own layout),
quantized the same way, for quality checks against llama.cpp. K-quants need rows of a
multiple of 256 weights: llama.cpp gives SmolLM2's 576-wide tensors another type.

Tensors are streamed to disk one at a time (an 8B F16 is 16 GB: it is never held in
memory); the F16 intermediate is deleted unless F16 is one of the --types.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, ReaderTensor
from gguf.quants import dequantize

from radixserve.models.resolve import embedded_gguf
from radixserve.models.synthetic import copy_tokenizer

# llama.cpp's llama_ftype values (include/llama.h)
FTYPES = {"F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


@dataclass(frozen=True)
class Shape:
    arch: str  # GGUF general.architecture: "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    tied: bool  # output projection tied to the token embedding (no output.weight)
    qkv_bias: bool = False


SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 500000.0, tied=True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 500000.0, tied=True),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 500000.0, tied=False),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 1000000.0, tied=True, qkv_bias=True),
}
CONTEXT = 8192


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]  # GGUF's row-major order: (rows, cols)
    dtype: type[np.generic]
    fill: Callable[[], np.ndarray]  # the array, made when it is written


def random_tensors(shape: Shape, vocab: int, seed: int) -> Iterator[Tensor]:
    """Every tensor of a random model of `shape`: matrices N(0, 0.02) F16, norms 1, biases 0."""
    rng = np.random.default_rng(seed)
    head_dim = shape.hidden // shape.heads

    def normal(name: str, *dims: int) -> Tensor:
        def fill() -> np.ndarray:
            return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

        return Tensor(name, dims, np.float16, fill)

    def const(name: str, rows: int, value: float) -> Tensor:
        return Tensor(name, (rows,), np.float32, lambda: np.full(rows, value, dtype=np.float32))

    yield normal("token_embd.weight", vocab, shape.hidden)
    yield const("output_norm.weight", shape.hidden, 1.0)
    if not shape.tied:
        yield normal("output.weight", vocab, shape.hidden)
    q, kv = shape.heads * head_dim, shape.kv_heads * head_dim
    for i in range(shape.layers):
        b = f"blk.{i}."
        yield const(b + "attn_norm.weight", shape.hidden, 1.0)
        yield const(b + "ffn_norm.weight", shape.hidden, 1.0)
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield normal(b + name + ".weight", rows, shape.hidden)
            if shape.qkv_bias:
                yield const(b + name + ".bias", rows, 0.0)
        yield normal(b + "attn_output.weight", shape.hidden, q)
        yield normal(b + "ffn_gate.weight", shape.ffn, shape.hidden)
        yield normal(b + "ffn_up.weight", shape.ffn, shape.hidden)
        yield normal(b + "ffn_down.weight", shape.hidden, shape.ffn)


def write_random_f16(shape: Shape, out: Path, seed: int) -> None:
    reader = GGUFReader(embedded_gguf())
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    w = GGUFWriter(str(out), shape.arch)
    w.add_name(out.stem)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.hidden // shape.heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(FTYPES["F16"])
    copy_tokenizer(reader, w)
    stream(w, list(random_tensors(shape, vocab, seed)))


def smollm2_tensors(reader: GGUFReader) -> Iterator[Tensor]:
    """The embedded model's tensors, quantized ones dequantized to F16 (1-D ones F32), in
    the file's order and layout (its q/k rows keep llama.cpp's order)."""
    for t in reader.tensors:
        dims = tuple(int(s) for s in reversed(t.shape))
        dtype = np.float32 if len(dims) == 1 else np.float16

        def fill(
            t: ReaderTensor = t, dims: tuple[int, ...] = dims, dtype: type = dtype
        ) -> np.ndarray:
            return dequantize(t.data, t.tensor_type).reshape(dims).astype(dtype)

        yield Tensor(t.name, dims, dtype, fill)


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


def stream(w: GGUFWriter, tensors: list[Tensor]) -> None:
    """Write the header (every tensor's name and shape), then each tensor as it is made."""
    for t in tensors:
        nbytes = int(np.prod(t.dims)) * np.dtype(t.dtype).itemsize
        w.add_tensor_info(t.name, t.dims, np.dtype(t.dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        w.write_tensor_data(t.fill())
    w.close()


def quantize(src: Path, dst: Path, ftype: str, threads: int) -> None:
    import llama_cpp  # the bench extra

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    assert rc == 0, f"llama_model_quantize({src.name} -> {ftype}) returned {rc}"


def make(shape_name: str, types: list[str], out_dir: Path, seed: int, threads: int) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    f16 = out_dir / f"{shape_name}-F16.gguf"
    start = time.perf_counter()
    if shape_name == "smollm2-135m":
        write_smollm2_f16(f16)
    else:
        write_random_f16(SHAPES[shape_name], f16, seed)
    print(f"{f16.name}: {f16.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s")
    made = []
    for t in types:
        if t == "F16":
            made.append(f16)
            continue
        dst = out_dir / f"{shape_name}-{t}.gguf"
        start = time.perf_counter()
        quantize(f16, dst, t, threads)
        print(
            f"{dst.name}: {dst.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s"
        )
        made.append(dst)
    if "F16" not in types:
        f16.unlink()
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", required=True, choices=[*SHAPES, "smollm2-135m"])
    ap.add_argument("--types", nargs="+", default=["Q4_K_M"], choices=list(FTYPES))
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    make(args.shape, args.types, args.out, args.seed, args.threads)


if __name__ == "__main__":
    main()
