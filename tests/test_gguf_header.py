"""The GGUF header reader (radixserve/models/gguf_weights.py): the gguf package's reader's
tensors from a real file, and a clear ValueError for any malformed header."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from radixserve.models.gguf_weights import gguf_tensors
from radixserve.models.resolve import embedded_gguf


@pytest.mark.slow  # gguf's reader over the whole embedded file (~4 s)
def test_embedded_file_gives_the_gguf_readers_tensors() -> None:
    ours = gguf_tensors(embedded_gguf())
    theirs = gguf.GGUFReader(embedded_gguf())
    field = theirs.fields["general.architecture"]
    assert ours.architecture == bytes(field.parts[field.data[0]]).decode() == "llama"
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type and a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data.view(np.uint8), b.data.view(np.uint8)), a.name


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def small_gguf(path: Path) -> tuple[bytes, int]:
    """A valid file with a vocabulary-like string array, a nested array and a Q8_0 and an
    F32 tensor; its bytes and where the tensor data starts."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_token_list(["a", "bb", "ccc"])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_uint32("test.u32", 7)
    w.add_tensor("blk.0.attn_q.weight", np.ones((2, 32), dtype=np.float32))
    q8 = gguf.quants.quantize(np.ones((2, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_k.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    finish(w)
    return path.read_bytes(), int(gguf.GGUFReader(path).tensors[0].data_offset)


def test_small_file_reads(tmp_path: Path) -> None:
    small_gguf(tmp_path / "m.gguf")
    file = gguf_tensors(tmp_path / "m.gguf")
    q, k = file.tensors
    assert file.architecture == "llama"
    assert (q.tensor_type, q.shape) == (gguf.GGMLQuantizationType.F32, (32, 2))
    assert np.array_equal(q.data, np.ones((2, 32), dtype=np.float32))
    assert (k.tensor_type, k.shape) == (gguf.GGMLQuantizationType.Q8_0, (32, 2))
    assert k.data.dtype == np.uint8 and k.data.shape == (2, 34)  # 2 rows of one block


def test_every_truncation_of_the_header_is_a_value_error(tmp_path: Path) -> None:
    raw, data_start = small_gguf(tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    for end in range(data_start + 1):
        cut.write_bytes(raw[:end])
        with pytest.raises(ValueError, match="cut.gguf"):
            gguf_tensors(cut)


def malformed(raw: bytes) -> dict[str, bytes]:
    """Valid headers changed one field at a time (offsets from small_gguf's layout)."""
    first_key_len = struct.unpack_from("<Q", raw, 24)[0]
    value_type_at = 32 + first_key_len
    return {
        "not a GGUF file": b"GGML" + raw[4:],
        "version 1": raw[:4] + struct.pack("<I", 1) + raw[8:],
        "big-endian": raw[:4] + struct.pack(">I", 3) + raw[8:],
        "a billion tensors": raw[:8] + struct.pack("<Q", 10**9) + raw[16:],
        "a billion metadata": raw[:16] + struct.pack("<Q", 10**9) + raw[24:],
        "unknown value type": raw[:value_type_at]
        + struct.pack("<I", 99)
        + raw[value_type_at + 4 :],
    }


@pytest.mark.parametrize(
    "case",
    ["not a GGUF file", "version 1", "big-endian", "a billion tensors", "a billion metadata",
     "unknown value type"],
)  # fmt: skip
def test_malformed_headers_are_value_errors(tmp_path: Path, case: str) -> None:
    raw, _ = small_gguf(tmp_path / "m.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(malformed(raw)[case])
    with pytest.raises(ValueError, match="bad.gguf"):
        gguf_tensors(bad)


def test_tensor_fields_are_checked(tmp_path: Path) -> None:
    """Unknown type, a shape of partial blocks, data past the end, a duplicated name."""
    raw, _ = small_gguf(tmp_path / "m.gguf")
    name = b"blk.0.attn_k.weight"
    info = raw.rindex(name) + len(name)  # then n_dims u32, 2 dims u64, type u32, offset u64
    type_at, offset_at, dim_at = info + 4 + 16, info + 4 + 16 + 4, info + 4
    bad = tmp_path / "bad.gguf"
    cases = {
        "unknown GGML type": raw[:type_at] + struct.pack("<I", 1000) + raw[type_at + 4 :],
        "whole Q8_0 blocks": raw[:dim_at] + struct.pack("<Q", 33) + raw[dim_at + 8 :],
        "run past the file": raw[:offset_at] + struct.pack("<Q", 2**40) + raw[offset_at + 8 :],
        "appears twice": raw.replace(b"blk.0.attn_q.weight", name),
    }
    for message, content in cases.items():
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            gguf_tensors(bad)


def test_arrays_nested_past_the_bound_are_a_value_error(tmp_path: Path) -> None:
    """Metadata arrays of arrays nest 4 deep at most: a deeper one (or a crafted file
    nesting thousands deep) is refused, not recursed into."""
    for depth, ok in ((4, True), (5, False)):
        value: object = [1]
        for _ in range(depth - 1):
            value = [value]
        path = tmp_path / f"nested{depth}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_array("test.deep", value)
        w.add_tensor("blk.0.attn_q.weight", np.ones((2, 32), dtype=np.float32))
        finish(w)
        if ok:
            assert [t.name for t in gguf_tensors(path).tensors] == ["blk.0.attn_q.weight"]
        else:
            with pytest.raises(ValueError, match="nested too deep"):
                gguf_tensors(path)
