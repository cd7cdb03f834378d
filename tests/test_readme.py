"""The README's snippets marked ``<!-- tiny-checkpoint snippet -->`` run as written, and every repository path
README.md and docs/*.md name exists, so neither can rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MARK = "<!-- tiny-checkpoint snippet -->"


def tiny_snippets() -> list[str]:
    """The code of every fenced python block that follows the marker line."""
    text = README.read_text()
    return re.findall(re.escape(MARK) + r"\s*```python\n(.*?)```", text, flags=re.S)


def test_the_readme_marks_its_tiny_snippets():
    snippets = tiny_snippets()
    assert len(snippets) >= 3 and all("tiny_checkpoint_path" in s for s in snippets)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """The snippets run as a user's process would: with jaxpaged's caches on, so the later snippets load
    the steps the first one compiled (into the suite's JAX cache folder if it has one). Off afterwards."""
    import os

    os.environ["JAXPAGED_COMPILE_CACHE"] = str(tmp_path_factory.mktemp("readme") / "xla")
    yield
    os.environ["JAXPAGED_COMPILE_CACHE"] = ""


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(tiny_snippets())))
def test_readme_snippet_runs(index, capsys, compile_cache):
    code = tiny_snippets()[index]
    exec(compile(code, f"README.md snippet {index}", "exec"), {"__name__": f"readme_snippet_{index}"})
    assert capsys.readouterr().out.strip()  # every snippet prints what it shows



def named_paths(md: Path) -> list[tuple[str, Path]]:
    """The repository paths a Markdown file names: words (in code spans and code blocks) whose first part is a
    top-level entry of the repository and that have a folder or an extension (``benchmarks/serving.py``,
    ``dev.sh``) from the repository's root, or under ``jaxpaged/`` (``kv/pool_size.py``); relative link targets, taken from the file's folder.
    Placeholders (``<benchmark>``, ``$OUT``, ``{a,b}``) and other branches' paths (``lab:...``) are not paths."""
    top = {p.name for p in ROOT.iterdir() if not p.name.startswith(".") or p.name == ".ci"}
    package = {p.name for p in (ROOT / "jaxpaged").iterdir() if p.is_dir() and not p.name.startswith("_")}
    text = md.read_text()
    found = []
    for code in re.findall(r"```.*?```|`[^`\n]+`", text, flags=re.S):
        for word in code.strip("`").split():
            word = word.strip("'\"()[],;:").rstrip(".")
            if not re.fullmatch(r"[\w.\-/]+", word) or not ("/" in word or "." in word):
                continue
            first = word.split("/")[0]
            if first in top:
                found.append((word, ROOT / word))
            elif first in package and "/" in word:  # a module under jaxpaged/ (``kv/pool_size.py``)
                found.append((word, ROOT / "jaxpaged" / word))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        target = target.split("#")[0]
        if target and "://" not in target and not target.startswith("mailto:"):
            found.append((target, (md.parent / target).resolve()))
    return found


def exists(path: Path) -> bool:
    """The path, or for ``module.py.name`` / ``folder/module.name`` (a name in a module) that module."""
    if path.exists():
        return True
    stem, _, attr = path.name.rpartition(".")
    return attr.isidentifier() and path.with_name(stem.removesuffix(".py") + ".py").is_file()


@pytest.mark.parametrize("md", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_every_path_named_in_the_docs_exists(md):
    missing = sorted({word for word, path in named_paths(md) if not exists(path)})
    assert not missing, f"{md.relative_to(ROOT)} names paths that do not exist: {missing}"
