"""Packaging: the lazy top-level exports, import names that clash with no dependency's, and
the package's layering."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import radixserve


def test_frontend_names_reexported() -> None:
    from radixserve import frontend

    for name in frontend.__all__:
        assert getattr(radixserve, name) is getattr(frontend, name)


def test_import_is_light() -> None:
    code = "import sys, radixserve; radixserve.function; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


REPO = Path(__file__).resolve().parents[1]
# Folders on sys.path while the project runs: the clone's root (`python` and `python -c` started
# there put the working directory first), tests/ (pytest's rootdir-relative import mode) and
# benchmarks/ (a script's own folder; `pythonpath` for the tests of benchmark code).
ON_SYS_PATH = (REPO, REPO / "tests", REPO / "benchmarks")

# transformers 5 imports the PyPI `kernels` (transformers.activations -> integrations.hub_kernels);
# the tour prints where `kernels` comes from and what the engine wrote.
TOUR = """
import importlib.util
import transformers.activations
from radixserve import Engine
spec = importlib.util.find_spec("kernels")
print(spec.origin if spec else None)
print(repr(Engine().generate("Hi", {"max_new_tokens": 4})["text"]))
"""


def _import_names(folder: Path) -> set[str]:
    """The top-level names a folder on sys.path provides: its modules and regular packages
    (a folder without __init__.py never hides a regular package later on sys.path)."""
    modules = {p.stem for p in folder.glob("*.py")}
    return modules | {p.parent.name for p in folder.glob("*/__init__.py")}


def test_repository_folders_shadow_no_installed_import_name() -> None:
    installed = importlib.metadata.packages_distributions()
    assert "torch" in installed and "transformers" in installed, sorted(installed)[:20]
    for folder in ON_SYS_PATH:
        clashes = {
            name: installed[name]
            for name in _import_names(folder)
            if installed.get(name, ["radixserve"]) != ["radixserve"]
        }
        assert not clashes, f"{folder} shadows installed packages: {clashes}"


def test_the_root_holds_no_python() -> None:
    """Every module is under radixserve/: from the root nothing else imports, whatever
    PyPI adds."""
    assert _import_names(REPO) == {"radixserve"}
    staged = subprocess.run(
        ["git", "ls-files", "--stage"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert len(staged) > 50, staged
    assert [line for line in staged if line.startswith("120000")] == []  # no symbolic links


@pytest.mark.parametrize("where", ["root", pytest.param("elsewhere", marks=pytest.mark.slow)])
def test_tour_runs_from_the_clone_and_elsewhere(where: str, tmp_path: Path) -> None:
    """`python -c` puts the working directory first on sys.path: from the clone's root the
    engine starts, transformers imports, and `kernels` is the installed distribution."""
    cwd = REPO if where == "root" else tmp_path
    out = subprocess.run(
        [sys.executable, "-c", TOUR], capture_output=True, text=True, cwd=cwd, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    origin, text = out.stdout.splitlines()[-2:]
    kernels = importlib.util.find_spec("kernels")  # the installed distribution, or none
    assert origin == str(kernels.origin if kernels else None)
    assert kernels is None or "site-packages" in origin, origin
    assert len(text) > 2, text


# ---------------------------------------------------------------- layering


def _modules() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    mods = {}
    for path in (REPO / "radixserve").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
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
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.md", "*.cpp", "*.h", "*.toml", "*.html", "*.sh", ".ci/run"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert len(files) > 50, files
    marked = [
        f"{name}:{i}"
        for name in files
        for i, line in enumerate((REPO / name).read_text(encoding="utf-8").splitlines(), 1)
        if line.startswith(("<<<<<<< ", ">>>>>>> ")) or line == "======="
    ]
    assert not marked, marked
