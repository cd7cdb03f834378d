"""The README's snippets marked ``<!-- tiny-checkpoint snippet -->`` run as written, so they cannot rot."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
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

