"""Read a GGUF file's weights under HF tensor names, keeping Q4_0 / Q4_1 / Q5_0 / Q5_1 /
Q8_0 / MXFP4 / Q4_K / Q5_K / Q6_K tensors in their block layout (radixserve/models/quant.py)
instead of dequantizing them, used in place from the file's memory map (no copy: a model
takes about its file's size in memory, shared with the page cache).

Three things differ from an HF checkpoint, and are undone here:
- names: `blk.{i}.attn_q.weight` is `model.layers.{i}.self_attn.q_proj.weight`, and so on
  (`hf_name`; a few differ by architecture: Gemma 3's `ffn_norm` is the norm before its MLP,
  Phi-3's `attn_qkv` / `ffn_up` are its fused qkv_proj / gate_up_proj, stored as HF has them);
- llama.cpp's converter reorders the rows of q_proj / k_proj (weights and biases) of
  "llama" and "smollm3" files, whose RoPE it runs interleaved (HF's rotate-half RoPE layout
  -> GGML's interleaved one). Rows are independent in every block format, so the inverse row
  permutation applies to quantized bytes as well (those two tensors are the only copies);
- it stores Gemma 3's RMSNorm weights as 1 + w (HF computes x * (1 + w) from w): 1 is
  subtracted again (norms are 1-D F32 tensors, never kept in blocks).
Other GGUF tensor types (F16, BF16, Q2_K, Q3_K, IQ*, ...) are dequantized to `dtype` by the
`gguf` package, as transformers does; `dequantized` lists them (the loader warns). A
mixture of experts' 3-D expert tensors (`ffn_{gate,up,down}_exps`, (E, rows, cols)) follow
the same rule: in a NATIVE format a stack stays in its blocks (`QuantStack`, each expert a
view of the file's map), in another it is dequantized.

Some tensors are RoPE parameters, not weights, and are skipped (`NOT_WEIGHTS`); they belong
in config.json. Llama 3.1+ files carry `rope_freqs.weight`: the per-frequency divisors of
Llama-3 RoPE scaling, which llama.cpp's converter writes instead of the scaling parameters
(`gguf_config.llama3_rope_parameters` recovers those). Phi-3 files carry longrope's
per-frequency factors as `rope_factors_long.weight` / `rope_factors_short.weight`.

`gguf_metadata` reads the header's key-value metadata (gguf_config.py turns it into HF's
config.json for the architectures it knows).
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import struct
import warnings
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quant_shape_to_byte_shape

from radixserve.models.quant import QuantStack, QuantWeight

NATIVE = {GGMLQuantizationType.Q4_0: "q4_0", GGMLQuantizationType.Q4_1: "q4_1",
          GGMLQuantizationType.Q8_0: "q8_0", GGMLQuantizationType.Q4_K: "q4_k",
          GGMLQuantizationType.Q5_K: "q5_k", GGMLQuantizationType.Q6_K: "q6_k",
          GGMLQuantizationType.Q5_0: "q5_0", GGMLQuantizationType.Q5_1: "q5_1",
          GGMLQuantizationType.MXFP4: "mxfp4"}  # fmt: skip
PLAIN = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{g}.{kind}": f"self_attn.{h}_proj.{kind}"
       for g, h in [("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")]
       for kind in ("weight", "bias")},
    **{f"ffn_{g}.{kind}": f"mlp.{g}_proj.{kind}"
       for g in ("gate", "up", "down") for kind in ("weight", "bias")},
    # a mixture of experts' router and stacked experts (radixserve/models/moe_weights.py)
    "ffn_gate_inp.weight": "mlp.gate.weight",
    **{f"ffn_{g}_exps.weight": f"mlp.experts.{g}_proj" for g in ("gate", "up", "down")},
}  # fmt: skip
QK_NORMS: dict[str, str | None] = {"attn_q_norm.weight": "self_attn.q_norm.weight",
                                   "attn_k_norm.weight": "self_attn.k_norm.weight"}  # fmt: skip
GEMMA_NORMS: dict[str, str | None] = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Per architecture, the layer tensors whose HF name is not LAYER_NAMES' (None: a tensor the
# architecture does not have). Gemma 3's four norms: llama.cpp's `ffn_norm` is HF's
# pre_feedforward_layernorm there, its `post_attention_norm` HF's post_attention_layernorm.
ARCH_LAYER_NAMES: dict[str, dict[str, str | None]] = {
    "qwen3": QK_NORMS,
    "qwen3moe": QK_NORMS,
    "olmoe": QK_NORMS,
    "gemma2": GEMMA_NORMS,
    "gemma3": {**QK_NORMS, **GEMMA_NORMS},
    # gpt-oss: the norm before its experts, sinks, the router's and the experts' biases
    "gpt-oss": {"post_attention_norm.weight": "post_attention_layernorm.weight",
                "ffn_norm.weight": None, "attn_sinks.weight": "self_attn.sinks",
                "ffn_gate_inp.bias": "mlp.gate.bias",
                **{f"ffn_{g}_exps.bias": f"mlp.experts.{g}_proj_bias"
                   for g in ("gate", "up", "down")}},
    "phi3": {"attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight",  # rows: gate, then up (as HF's)
             **dict.fromkeys(["attn_q.weight", "attn_k.weight", "attn_v.weight",
                              "ffn_gate.weight"])},
}  # fmt: skip
PERMUTED = ("llama", "smollm3")  # llama.cpp runs their RoPE interleaved: q/k rows reordered
# llama.cpp's converter stores these architectures' norms as offset + w
NORM_OFFSET = {"gemma2": 1.0, "gemma3": 1.0}
ROPE_FREQS = "rope_freqs.weight"
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3 longrope
NOT_WEIGHTS = (ROPE_FREQS, *ROPE_FACTORS)
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# A fused projection of quantized parts (q/k/v, gate/up) stays a tuple of them (QuantLinear).
Weight = torch.Tensor | QuantWeight | tuple[QuantWeight, ...] | QuantStack


class HeadCounts(Protocol):
    """What the weight reader needs of a model config (ModelConfig has them)."""

    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...


def hf_name(gguf_name: str, architecture: str = "llama") -> str:
    """GGUF tensor name -> HF name in `architecture`'s files; KeyError naming a tensor our
    models do not use."""
    if gguf_name in TOP_NAMES:
        return TOP_NAMES[gguf_name]
    blk, layer, rest = (gguf_name.split(".", 2) + ["", ""])[:3]  # blk.{i}.{rest}
    names = {**LAYER_NAMES, **ARCH_LAYER_NAMES.get(architecture, {})}
    name = names.get(rest) if blk == "blk" and layer.isdigit() else None
    if name is None:
        raise KeyError(f"{gguf_name} (a tensor radixserve does not read in {architecture} files)")
    return f"model.layers.{int(layer)}.{name}"


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


# GGUF metadata value types: struct formats of the fixed-size ones (u8, i8, u16, i16, u32,
# i32, f32, bool, u64, i64, f64); 8 is a string, 9 an array.
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_VALUE_SIZES = {kind: struct.calcsize(fmt) for kind, fmt in _FORMATS.items()}
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

    def value(self, kind: int, depth: int = 0) -> Any:
        """One metadata value: a number, bool or str, or a list of them (nested lists for
        arrays of arrays)."""
        if kind in _FORMATS:
            (value,) = struct.unpack_from(_FORMATS[kind], self.data, self.pos)
            self.pos += _VALUE_SIZES[kind]
            return value
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY and depth < _MAX_ARRAY_DEPTH:
            item, count = self.take("<I"), self.take("<Q")
            if count > len(self.data) - self.pos:  # each item takes a byte or more
                raise IndexError(f"{count} items at offset {self.pos}")
            return [self.value(item, depth + 1) for _ in range(count)]
        raise ValueError(f"metadata value of unknown type {kind} (or nested too deep)")

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


def _open_header(data: np.ndarray) -> tuple[_Cursor, int, int]:
    """A cursor after the magic, version and counts; (cursor, tensors, metadata entries)."""
    cur = _Cursor(data)
    if bytes(data[:4]) != b"GGUF":
        raise ValueError("not a GGUF file (no GGUF magic)")
    cur.skip(4)
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (read little-endian): only 2 and 3 are read")
    return cur, cur.take("<Q"), cur.take("<Q")


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The file's metadata, key -> value (numbers, bools, strings and lists of them; F32
    values as the Python float they are exactly), except the `tokenizer.*` arrays (the
    vocabulary: tens of thousands of strings). Raises ValueError naming what is wrong with a
    file that is not a well-formed GGUF."""
    try:
        cur, _, n_metadata = _open_header(np.memmap(path, mode="r"))
        out = {}
        for _ in range(n_metadata):
            key, kind = cur.string(), cur.take("<I")
            if kind == _ARRAY and key.startswith("tokenizer."):
                cur.skip_value(kind)
            else:
                out[key] = cur.value(kind)
        return out
    except (struct.error, IndexError) as e:
        raise ValueError(f"{path}: GGUF header ends early or points past the file ({e})") from e
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _read_header(data: np.memmap) -> GGUFTensors:
    """Walk the header (magic, version, counts, metadata, tensor infos) without building the
    metadata's values (the vocabulary's strings would take seconds): only the architecture
    and the alignment are kept."""
    cur, n_tensors, n_metadata = _open_header(data)
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
    """The storage of the file's matrices (stacked experts' too; not a mixture of experts'
    router, `ffn_gate_inp`, F32 in llama.cpp's files and run in float32 by the native
    layers): NATIVE names ("q4_k", ...) or GGML type names."""
    return {
        NATIVE.get(t.tensor_type, t.tensor_type.name)
        for t in gguf_tensors(path).tensors
        if len(t.shape) >= 2 and not t.name.endswith("ffn_gate_inp.weight")
    }


def read_gguf_weights(
    path: Path, config: HeadCounts, dtype: torch.dtype, quantized: bool = True
) -> tuple[dict[str, Weight], dict[str, int]]:
    """HF name -> weight, and the quantized types dequantized here -> their count. With
    `quantized`, matrices in a NATIVE format stay quantized (QuantWeight, a view of the
    file's memory map; stacked experts a QuantStack); everything else is a tensor in
    `dtype`. Raises KeyError naming a tensor we do not know."""
    file = gguf_tensors(path)
    permuted = file.architecture in PERMUTED
    offset = NORM_OFFSET.get(file.architecture, 0.0)
    out: dict[str, Weight] = {}
    dequantized: dict[str, int] = {}
    for t in file.tensors:
        if t.name in NOT_WEIGHTS:  # RoPE parameters, in the config
            continue
        name = hf_name(t.name, file.architecture)
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(
            name.split(".")[-2] if permuted else "", 0
        )
        if quantized and t.tensor_type in NATIVE and len(t.shape) == 3:  # experts
            out[name] = QuantStack(mapped(t.data), NATIVE[t.tensor_type], int(t.shape[0]))
            continue
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
        if offset and name.endswith("norm.weight"):
            w -= offset  # in float32, before any rounding to `dtype`
        out[name] = (unpermute_rows(w, heads) if heads else w).to(dtype)
    return out, dequantized


def mapped(data: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only view of the file's memory map, without copying (torch warns
    that it cannot protect a read-only array: the weights are never written)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data.view(np.uint8))


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, GGUF row 2i + j (j in {0, 1}) is HF
    row j * D/2 + i (D = rows per head). Works on any (rows, ...) tensor, bytes included."""
    rows = w.shape[0]
    per_head = rows // heads
    # GGUF rows of one head: (D/2, 2) = (i, j); HF rows: (2, D/2) = (j, i).
    return w.reshape(heads, per_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
