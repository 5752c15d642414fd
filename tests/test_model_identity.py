"""A model's identity (the shared K/V tiers' namespace): the same files give the same
digest wherever they are; another checkpoint, a file changed in place or another way of
running it gives another; a converted GGUF folder is named by its GGUF file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from radixserve.config import HICACHE_SECRET_ENV, EngineConfig
from radixserve.models.identity import (
    SAMPLES,
    WHOLE_BYTES,
    file_digest,
    model_files,
    model_identity,
)
from radixserve.models.resolve import SOURCE_FILE
from radixserve.models.synthetic import build_tiny_model

RUNTIME = {"dtype": "torch.float32", "tp_size": 1}


@pytest.mark.slow  # four model folders hashed and loaded: ~10 s
def test_same_files_anywhere_are_the_same_model_and_same_folder_names_are_not(
    tmp_path: Path,
) -> None:
    a = build_tiny_model(tmp_path / "a" / "model", seed=0)
    b = build_tiny_model(tmp_path / "b" / "model", seed=1)
    copy = shutil.copytree(a, tmp_path / "elsewhere" / "model-copy")
    (copy / ".cache").mkdir()  # a download tool's metadata is not the model
    (copy / ".cache" / "download.metadata").write_text("fetched at 12:00")
    ident = model_identity(a, RUNTIME)
    assert model_identity(copy, RUNTIME) == ident
    assert model_identity(b, RUNTIME) != ident
    assert model_identity(a, {**RUNTIME, "dtype": "torch.bfloat16"}) != ident
    build_tiny_model(a, seed=2)  # replaced in place
    assert model_identity(a, RUNTIME) != ident


def test_large_files_are_read_at_their_head_and_in_spread_samples(tmp_path: Path) -> None:
    path = tmp_path / "weights.safetensors"
    data = bytearray(range(256)) * ((WHOLE_BYTES + (40 << 20)) // 256)
    path.write_bytes(data)
    before = file_digest(path)
    step = (len(data) - WHOLE_BYTES) // SAMPLES
    for at in (123, WHOLE_BYTES + 5, WHOLE_BYTES + 200 * step + 7):  # the head, 2 samples
        changed = bytearray(data)
        changed[at] ^= 1
        path.write_bytes(changed)
        assert file_digest(path) != before, at
    path.write_bytes(data + b"x")
    assert file_digest(path) != before  # the size


def test_a_converted_gguf_folder_is_named_by_its_gguf(tmp_path: Path) -> None:
    gguf = tmp_path / "models" / "m.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + bytes(100))
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(bytes(10))
    (folder / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf)}))
    assert model_files(folder) == [folder / "config.json", gguf]
    ident = model_identity(folder, RUNTIME)
    moved = shutil.move(gguf, tmp_path / "m.gguf")  # same bytes at another path
    (folder / SOURCE_FILE).write_text(json.dumps({"gguf": str(moved)}))
    assert model_identity(folder, RUNTIME) == ident
    Path(moved).write_bytes(b"GGUF" + bytes(99) + b"\1")
    assert model_identity(folder, RUNTIME) != ident


def test_tensor_parallel_with_tiers_is_refused_at_start() -> None:
    for tiers in ({"hicache_size": 1.0}, {"hicache_remote": "redis://127.0.0.1:1"}):
        with pytest.raises(ValueError, match="tp-size 1 only"):
            EngineConfig(tp_size=2, **tiers)  # type: ignore[arg-type]
    EngineConfig(tp_size=2)
    with pytest.raises(ValueError, match="hicache_secret .*must be at least 16"):
        EngineConfig(hicache_secret="short")


def test_the_secret_from_the_environment_is_held_to_the_same_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(HICACHE_SECRET_ENV, "short")
    with pytest.raises(ValueError, match=r"\$RADIXSERVE_HICACHE_SECRET\) must be at least 16"):
        EngineConfig()
    monkeypatch.setenv(HICACHE_SECRET_ENV, "sixteen characters")
    assert EngineConfig().hicache_key() == b"sixteen characters"
