"""Every script under benchmarks/ imports: a module moved inside the package (as
models/resolve.py once did) must not leave a benchmark that fails on its first line.
Importing runs no benchmark: each script's work sits behind `if __name__ == "__main__"`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))


def test_there_are_benchmarks() -> None:
    assert len(BENCHMARKS) >= 15, [p.name for p in BENCHMARKS]


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_benchmark_script_imports(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(path.parent))  # as when run as a script
    name = f"bench_import_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    if path.stem not in ("eval_data", "runtime_args", "sandbox", "roofline"):
        assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
