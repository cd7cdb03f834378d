"""The package's layering: pyproject's ``[tool.importlinter]`` contracts hold, and no module imports
itself back through others (no cycle, not even through a package's ``__init__`` or an import inside a
function).

import-linter reads a package from its folder, and ``kernels/`` and ``models/`` install as
``jaxpaged.kernels`` and ``jaxpaged.models`` (setuptools' package-dir mapping), so the checks run over a
copy of the Python sources in the installed layout. ``./dev.sh python tests/test_import_layers.py``
prints the contracts' report and the graph's size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def installed_layout(dest: Path) -> Path:
    """Copies the package's ``.py`` files into ``dest`` as pip installs them; returns ``dest``."""
    package_dir = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in package_dir.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            target = dest.joinpath(*package.split("."), path.relative_to(ROOT / folder))
            if not target.exists():  # (a subpackage mapped on its own has its own entry)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
    return dest


def _run(code: str, layout: Path, *args: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter that finds ``jaxpaged`` in ``layout`` (not the editable install)."""
    env = dict(os.environ, PYTHONPATH=str(layout))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=layout, env=env, capture_output=True, text=True,
                          timeout=300)


LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"

GRAPH = """
import json, sys
import grimp

graph = grimp.build_graph("jaxpaged", cache_dir=None)
assert graph.find_children("jaxpaged") >= {"jaxpaged.kernels", "jaxpaged.models"}, "not the installed layout"
modules = sorted(graph.modules)
edges = sorted((a, b) for a in modules for b in graph.find_modules_directly_imported_by(a))
index, low, stack, on, cycles, n = {}, {}, [], set(), [], [0]
sys.setrecursionlimit(10000)

def visit(v):  # Tarjan's strongly connected components
    index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
    for w in graph.find_modules_directly_imported_by(v):
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop(); on.discard(w); comp.append(w)
            if w == v:
                break
        if len(comp) > 1:
            cycles.append(sorted(comp))

for m in modules:
    if m not in index:
        visit(m)
print(json.dumps(dict(modules=len(modules), edges=len(edges), cycles=cycles)))
"""


@pytest.fixture(scope="module")
def layout():
    with tempfile.TemporaryDirectory(prefix="jaxpaged-layout-") as tmp:
        yield installed_layout(Path(tmp))


def test_import_contracts_hold(layout):
    """import-linter's contracts (pyproject.toml): the layers, kernels importing nothing of the package,
    KV memory importing neither the engine nor the models, no cycle among a package's modules."""
    result = _run(LINT, layout, "--config", str(PYPROJECT), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_import_cycles(layout):
    """No strongly connected component of more than one module in the whole graph (a module importing a
    package whose ``__init__`` imports it back counts too)."""
    result = _run(GRAPH, layout)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["cycles"] == []


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="jaxpaged-layout-") as tmp:
        tree = installed_layout(Path(tmp))
        print(_run(LINT, tree, "--config", str(PYPROJECT), "--no-cache").stdout)
        print(_run(GRAPH, tree).stdout)
