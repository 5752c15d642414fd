"""Packaging: the lazy top-level exports, and no clash with names transformers probes."""

from __future__ import annotations

import ast
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


# ---------------------------------------------------------------- layering

REPO = Path(__file__).resolve().parents[1]
SOURCES = {
    "radixserve": REPO / "radixserve",
    "radixserve.kernels": REPO / "kernels",  # radixserve/kernels etc. link to these folders
    "radixserve.frontend": REPO / "frontend",
    "radixserve.router": REPO / "router",
}


def _modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name (rglob does not follow the
    links under radixserve/, so each linked folder is walked from its own root)."""
    mods = {}
    for root, base in SOURCES.items():
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([root, *parts])] = path
    return mods


def _imported(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of radixserve that `name` imports anywhere in its text (top level, inside
    functions and under TYPE_CHECKING alike: a layer is a dependency, used or typed)."""
    package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            src = ".".join([*base, node.module] if node.module else base)
            for a in node.names:  # `from pkg import module` depends on the module only
                sub = f"{src}.{a.name}"
                out.add(sub if sub in mods else src)
    return {m for m in out if m in mods and m != name}


def _layer(module: str) -> str:
    """Packages are the layers; a top-level module (config, isa, ...) is a layer of its own."""
    return ".".join(module.split(".")[:2])


def package_imports() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        for target in _imported(name, path, mods):
            if _layer(target) != _layer(name):
                edges.setdefault(_layer(name), set()).add(_layer(target))
    return edges


def test_core_imports_nothing_of_the_runtime() -> None:
    assert "radixserve.core" in {_layer(m) for m in _modules()}
    assert package_imports().get("radixserve.core", set()) == set()


def test_no_two_packages_import_each_other() -> None:
    """No cycle of any length between packages: a topological order of the layers exists."""
    edges = package_imports()
    layers = set(edges) | {t for ts in edges.values() for t in ts}
    remaining = {layer: set(edges.get(layer, ())) for layer in layers}
    while remaining:
        leaves = {layer for layer, deps in remaining.items() if not deps & remaining.keys()}
        assert leaves, f"import cycle among {sorted(remaining)}: " + "; ".join(
            f"{a} -> {sorted(d & remaining.keys())}" for a, d in sorted(remaining.items())
        )
        for layer in leaves:
            del remaining[layer]


def test_no_merge_conflict_markers() -> None:
    """A conflict left in a docstring or a doc still imports and builds: look for it."""
    repo = Path(__file__).resolve().parents[1]
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.cpp", "*.toml", "*.html", "*.sh", ".ci/run"],
        cwd=repo, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert len(files) > 50, files
    marked = [
        f"{name}:{i}"
        for name in files
        for i, line in enumerate((repo / name).read_text(encoding="utf-8").splitlines(), 1)
        if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "======="
    ]
    assert not marked, marked
