"""A model's identity: one digest that changes whenever the K/V a server computes could.

Shared K/V tiers (disk, Redis) key every chunk by this digest (kvcache/tier_store.py), so two
servers share K/V only when they run the same model the same way. It covers:

- the files that define the model: config.json, the tokenizer files and the weights, each by
  name, size and content. A file up to `WHOLE_BYTES` is hashed whole; a larger one (weights)
  by its first `WHOLE_BYTES` (a GGUF's metadata and tokenizer, a safetensors index) and
  `SAMPLES` blocks spread evenly over the rest, so a 5 GB file costs ~30 MB of reads while
  a different checkpoint of the same shapes (other values everywhere) differs in every block;
- for a folder converted from a GGUF (resolve.py), the GGUF file itself instead of the
  converted weights (which are derived from it);
- how it runs: the requested and resolved quantization, the compute dtype, the KV pool's
  layout (dtype, heads, head size, layers) and the tensor-parallel rank and size.

The folder's path is not part of it: the same files at two paths are the same model, and
two checkpoints in folders of the same name are not.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from radixserve.models.resolve import SOURCE_FILE, gguf_source

WHOLE_BYTES = 16 << 20
SAMPLES = 256
SAMPLE_BYTES = 64 << 10
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


def model_files(folder: Path) -> list[Path]:
    """The files whose bytes define the model loaded from `folder`, in a fixed order: not
    hidden ones (a download tool's metadata, with its timestamps) nor the marker naming a
    converted folder's GGUF by its path."""
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.name != SOURCE_FILE
        and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    source = gguf_source(folder)
    if source is None:
        return files
    return [p for p in files if p.suffix not in WEIGHT_SUFFIXES] + [source]


def file_digest(path: Path) -> str:
    """sha256 over the file's size and content (sampled past WHOLE_BYTES: module docstring)."""
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        h.update(f.read(WHOLE_BYTES))
        rest = size - WHOLE_BYTES
        if rest > 0:
            step = max(rest // SAMPLES, SAMPLE_BYTES)
            for at in range(WHOLE_BYTES, size, step):
                f.seek(at)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def model_identity(folder: str | Path, runtime: dict[str, object]) -> str:
    """Hex digest of the model in `folder` and of how it runs (`runtime`: JSON-able values,
    e.g. dtype, quantization, KV layout, TP rank and size)."""
    folder = Path(folder)
    files = {
        (str(p.relative_to(folder)) if p.is_relative_to(folder) else p.name): file_digest(p)
        for p in model_files(folder)
    }
    blob = json.dumps({"files": files, "runtime": runtime}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()
