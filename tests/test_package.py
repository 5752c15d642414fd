"""Packaging: the lazy top-level exports, and no clash with names transformers probes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import radixserve


def test_frontend_names_reexported() -> None:
    from radixserve import frontend

    for name in frontend.__all__:
        assert getattr(radixserve, name) is getattr(frontend, name)


def test_import_is_light() -> None:
    code = "import sys, radixserve; radixserve.function; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_top_level_kernels_package(tmp_path: Path) -> None:
    # transformers probes an optional PyPI package called `kernels`: installed, ours lives
    # only under radixserve.kernels (checked from a neutral cwd, as a user runs it).
    code = "import importlib.util as u; print(u.find_spec('kernels'), u.find_spec('router'))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.strip() == "None None"


def test_transformers_ignores_repo_folders() -> None:
    # Even with the repo root on sys.path (a developer's cwd), transformers keys on package
    # metadata and does not mistake our kernels/ folder for the `kernels` distribution.
    repo = Path(__file__).resolve().parents[1]
    code = "from transformers.utils import import_utils as iu; print(iu.is_kernels_available())"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo
    )
    assert out.stdout.strip() == "False"
