"""Read a GGUF file's weights under HF tensor names, keeping Q4_0 / Q4_1 / Q5_0 / Q5_1 /
Q8_0 / Q4_K / Q5_K / Q6_K tensors in their block layout (radixserve/models/quant.py) instead of
dequantizing them, used in place from the file's memory map (no copy: a model takes about
its file's size in memory, shared with the page cache).

Two things differ from an HF checkpoint, and are undone here:
- names: `blk.{i}.attn_q.weight` is `model.layers.{i}.self_attn.q_proj.weight`, and so on;
- llama.cpp's converter reorders the rows of q_proj / k_proj of "llama"-architecture files
  (HF's rotate-half RoPE layout -> GGML's interleaved one). Rows are independent in every
  block format, so the inverse row permutation applies to quantized bytes as well (those
  two tensors are the only copies).
Other GGUF tensor types (F16, BF16, Q2_K, Q3_K, IQ*, ...) are dequantized to `dtype` by the
`gguf` package, as transformers does; `dequantized` lists them (the loader warns).

Llama 3.1+ files carry `rope_freqs.weight`: not a weight but the per-frequency divisors of
Llama-3 RoPE scaling, which llama.cpp's converter writes instead of the scaling parameters.
`llama3_rope_parameters` recovers those parameters (the conversion puts them in config.json);
the weight reader skips the tensor.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import struct
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quant_shape_to_byte_shape

from radixserve.models.config import ModelConfig
from radixserve.models.quant import QuantWeight

NATIVE = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1",
          GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_K: "q4_k",
          GGMLQuantizationType.Q5_K: "q5_k", GGMLQuantizationType.Q6_K: "q6_k",
          GGMLQuantizationType.Q5_0: "q5_0", GGMLQuantizationType.Q5_1: "q5_1"}  # fmt: skip
PLAIN = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}"
       for g, h in [("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")]
       for kind in ("weight", "bias")},
    **{f"ffn_{g}.{kind}": f"mlp.{g}_proj.{kind}"
       for g in ("gate", "up", "down") for kind in ("weight", "bias")},
}  # fmt: skip
ROPE_FREQS = "rope_freqs.weight"
# Llama-3 scaling's parameters besides its factor: the same in every Llama 3.1 / 3.2 / 3.3.
LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# A fused projection of quantized parts (q/k/v, gate/up) stays a tuple of them (QuantLinear).
Weight = torch.Tensor | QuantWeight | tuple[QuantWeight, ...]


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> HF name; KeyError for a tensor our models do not use."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    blk, layer, rest = gguf_name.split(".", 2)
    if blk != "blk" or rest not in LAYER_NAMES:
        raise KeyError(gguf_name)
    return f"model.layers.{int(layer)}.{LAYER_NAMES[rest]}"


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: innermost dimension first
    data: np.ndarray  # a view of the file's memory map: typed for F16 / F32 / F64 and the
    # integer types, else bytes (rows, bytes per row), as the gguf package's reader gives it


class GGUFTensors(NamedTuple):
    architecture: str  # general.architecture
    tensors: list[GGUFTensor]
    data: np.memmap  # the whole file, mapped read-only (shared)


def gguf_tensors(path: Path) -> GGUFTensors:
    """The file's architecture and tensors, from its header; the last file's are kept (a
    load asks more than once). A rewritten file is read again. Raises ValueError naming what
    is wrong with a file that is not a well-formed little-endian GGUF v2 / v3."""
    stat = path.stat()
    return _tensors(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _tensors(path: Path, size: int, mtime_ns: int) -> GGUFTensors:
    try:
        return _read_header(np.memmap(path, mode="r"))
    except (struct.error, IndexError) as e:
        raise ValueError(f"{path}: GGUF header ends early or points past the file ({e})") from e
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


# GGUF metadata value types: sizes of the fixed-size ones; 8 is a string, 9 an array.
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_ARRAY_DEPTH = 4  # arrays of arrays nest this deep at most (files use 1)
_TYPED = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}  # fmt: skip


class _Cursor:
    """Reads little-endian fields from the header; struct.error past the end."""

    def __init__(self, data: np.ndarray) -> None:
        self.data, self.pos = data.data, 0  # the array's buffer

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return int(value)

    def string(self) -> str:
        n = self.take("<Q")
        self.skip(n)
        return bytes(self.data[self.pos - n : self.pos]).decode()

    def skip(self, n: int) -> None:
        if self.pos + n > len(self.data):
            raise IndexError(f"{n} bytes at offset {self.pos}")
        self.pos += n

    def skip_value(self, kind: int, depth: int = 0) -> None:
        if kind in _VALUE_SIZES:
            self.skip(_VALUE_SIZES[kind])
        elif kind == _STRING:
            self.skip(self.take("<Q"))
        elif kind == _ARRAY and depth < _MAX_ARRAY_DEPTH:
            item, count = self.take("<I"), self.take("<Q")
            if item in _VALUE_SIZES:
                self.skip(count * _VALUE_SIZES[item])
            else:  # strings and arrays: each is a length then its bytes (a vocabulary: ~50k)
                if count > len(self.data) - self.pos:  # each takes 8 bytes or more
                    raise IndexError(f"{count} items at offset {self.pos}")
                for _ in range(count):
                    self.skip_value(item, depth + 1)
        else:
            raise ValueError(f"metadata value of unknown type {kind} (or nested too deep)")


def _read_header(data: np.memmap) -> GGUFTensors:
    """Walk the header (magic, version, counts, metadata, tensor infos) without building the
    metadata's values (the vocabulary's strings would take seconds): only the architecture
    and the alignment are kept."""
    cur = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    cur.skip(4)
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (read little-endian): only 2 and 3 are read")
    n_tensors, n_metadata = cur.take("<Q"), cur.take("<Q")
    architecture, alignment = "", 32
    for _ in range(n_metadata):
        key, kind = cur.string(), cur.take("<I")
        if key == "general.architecture" and kind == _STRING:
            architecture = cur.string()
        elif key == "general.alignment" and kind == _UINT32:
            alignment = cur.take("<I")
        else:
            cur.skip_value(kind)
    if alignment == 0 or alignment % 8:
        raise ValueError(f"general.alignment {alignment} is not a positive multiple of 8")
    infos = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.take("<I")
        if not 1 <= n_dims <= 4:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(cur.take("<Q") for _ in range(n_dims))
        infos.append((name, dims, cur.take("<I"), cur.take("<Q")))
    start = -(-cur.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        tensors.append(_tensor(data, name, dims, kind, start + offset))
    return GGUFTensors(architecture, tensors, data)


def _tensor(data: np.memmap, name: str, dims: tuple[int, ...], kind: int, at: int) -> GGUFTensor:
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise ValueError(f"tensor {name!r} has unknown GGML type {kind}") from None
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    shape = tuple(reversed(dims))  # numpy's order: outermost first
    if 0 in dims or shape[-1] % block:
        raise ValueError(f"tensor {name!r}: shape {dims} does not hold whole {qtype.name} blocks")
    nbytes = math.prod(dims) // block * block_bytes
    if at + nbytes > len(data):
        raise ValueError(f"tensor {name!r}: its {nbytes} bytes at {at} run past the file")
    raw = data[at : at + nbytes]
    if qtype in _TYPED:
        view = raw.view(_TYPED[qtype]).reshape(shape)
    else:
        view = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
    return GGUFTensor(name, qtype, dims, view)


def release_pages(path: Path, tensor: torch.Tensor) -> bool:
    """Drop this process's resident pages of `tensor` if it is a view of the file's memory
    map (madvise DONTNEED on whole pages inside it: the mapping is shared and read-only, so
    a later read maps them back from the page cache, unchanged). For weights whose bytes the
    kernels now read from a copy: their file pages stop counting in the process's memory.
    Returns whether it was such a view."""
    data = gguf_tensors(path).data
    start, end = data.ctypes.data, data.ctypes.data + data.nbytes
    first = tensor.data_ptr()
    last = first + tensor.numel() * tensor.element_size()
    if not (start <= first and last <= end and tensor.is_contiguous()):
        return False
    page = mmap.PAGESIZE
    lo, hi = -(-first // page) * page, last // page * page
    size = ctypes.c_size_t(hi - lo)
    if hi > lo and _libc().madvise(ctypes.c_void_p(lo), size, mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on the model file's map")
    return True


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def matrix_formats(path: Path) -> set[str]:
    """The storage of the file's matrices: NATIVE names ("q4_k", ...) or GGML type names."""
    return {
        NATIVE.get(t.tensor_type, t.tensor_type.name)
        for t in gguf_tensors(path).tensors
        if len(t.shape) == 2
    }


def read_gguf_weights(
    path: Path, config: ModelConfig, dtype: torch.dtype, quantized: bool = True
) -> tuple[dict[str, Weight], dict[str, int]]:
    """HF name -> weight, and the quantized types dequantized here -> their count. With
    `quantized`, matrices in a NATIVE format stay quantized (QuantWeight, a view of the
    file's memory map); everything else is a tensor in `dtype`. Raises KeyError naming a
    tensor we do not know."""
    file = gguf_tensors(path)
    permuted = file.architecture == "llama"  # only llama.cpp's "llama" files reorder q/k
    out: dict[str, Weight] = {}
    dequantized: dict[str, int] = {}
    for t in file.tensors:
        if t.name == ROPE_FREQS:  # RoPE scaling, in the config (llama3_rope_parameters)
            continue
        name = hf_name(t.name)
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(
            name.split(".")[-2] if permuted else "", 0
        )
        if quantized and t.tensor_type in NATIVE and len(t.shape) == 2:
            blocks = mapped(t.data)  # (N, bytes)
            if heads:
                blocks = unpermute_rows(blocks, heads)  # a copy, in the kernels' row order
            out[name] = QuantWeight(blocks, NATIVE[t.tensor_type], int(t.shape[0]))
            continue
        if t.tensor_type not in PLAIN:
            kind = t.tensor_type.name
            dequantized[kind] = dequantized.get(kind, 0) + 1
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims innermost first
        values = gguf_dequantize(t.data, t.tensor_type).reshape(shape)
        w = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
        out[name] = (unpermute_rows(w, heads) if heads else w).to(dtype)
    return out, dequantized


def mapped(data: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only view of the file's memory map, without copying (torch warns
    that it cannot protect a read-only array: the weights are never written)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data.view(np.uint8))


def llama3_rope_parameters(path: Path, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The Llama-3 `rope_parameters` a GGUF's `rope_freqs.weight` was made from, or None when
    the file has no such tensor. Raises ValueError when the divisors are not Llama-3 scaling
    with the standard parameters (LLAMA3_ROPE; the factor is the largest divisor)."""
    tensor = next((t for t in gguf_tensors(path).tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    got = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    params = {"rope_type": "llama3", "rope_theta": theta, "factor": float(got.max()), **LLAMA3_ROPE}
    want = llama3_divisors(params, head_dim)
    if want.shape != got.shape or not np.allclose(want, got, rtol=1e-5):
        raise ValueError(
            f"{path}: rope_freqs.weight is not Llama-3 RoPE scaling with {LLAMA3_ROPE}: unsupported"
        )
    return params


def llama3_divisors(params: dict[str, Any], head_dim: int) -> np.ndarray:
    """Per rotary frequency (head_dim / 2), what Llama-3 scaling divides it by (1 for short
    wavelengths, `factor` for long ones, a smooth blend between): llama.cpp's rope_freqs."""
    freqs = params["rope_theta"] ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    wavelen = 2 * math.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    blend = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, blend))


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, GGUF row 2i + j (j in {0, 1}) is HF
    row j * D/2 + i (D = rows per head). Works on any (rows, ...) tensor, bytes included."""
    rows = w.shape[0]
    per_head = rows // heads
    # GGUF rows of one head: (D/2, 2) = (i, j); HF rows: (2, D/2) = (j, i).
    return w.reshape(heads, per_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
