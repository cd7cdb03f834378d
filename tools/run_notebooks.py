"""Executes notebooks without Jupyter and stores their outputs, in nbformat 4 shape.

For a machine that has the project's dependencies but no Jupyter kernel (no nbclient, no ipykernel).
Each notebook's code cells run in order in one namespace, with the notebook's folder as the working
directory (as Jupyter runs them); lines starting with ``%`` or ``!`` (IPython magics and shell) are
dropped. Each cell gets what Jupyter would store: its stdout and stderr as ``stream`` outputs
(carriage-return updates such as progress bars reduced to their last state), the value of a final
expression as ``execute_result``, every matplotlib figure it shows (or leaves open) as a
``display_data`` PNG, and an ``error`` output where it raises, which stops that notebook.

    python tools/run_notebooks.py notebooks/*.ipynb --out executed/

writes each executed notebook to ``--out`` (default: in place), the moment it finishes, and exits 1 if
any notebook raised.
"""

from __future__ import annotations

import argparse
import ast
import base64
import gc
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: figures render off-screen and are stored as PNG
import matplotlib.pyplot as plt  # noqa: E402

FIGURE_DPI = 100


class CellOutputs:
    """The outputs of one cell, in order; consecutive writes to one stream merge into one output."""

    def __init__(self, execution_count: int):
        self.execution_count = execution_count
        self.items: list[dict] = []

    def write(self, name: str, text: str) -> None:
        if not text:
            return
        last = self.items[-1] if self.items else None
        if last is not None and last["output_type"] == "stream" and last["name"] == name:
            last["text"] += text
        else:
            self.items.append({"output_type": "stream", "name": name, "text": text})

    def figures(self) -> None:
        """Stores every open figure as a PNG and closes it (what Jupyter's inline backend does)."""
        for num in plt.get_fignums():
            fig = plt.figure(num)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=FIGURE_DPI, bbox_inches="tight")
            w, h = fig.get_size_inches() * fig.dpi
            self.items.append({"output_type": "display_data", "metadata": {},
                               "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                                        "text/plain": [f"<Figure size {w:g}x{h:g} with {len(fig.axes)} Axes>"]}})
        plt.close("all")

    def result(self, value) -> None:
        self.items.append({"output_type": "execute_result", "execution_count": self.execution_count,
                           "metadata": {}, "data": {"text/plain": lines(repr(value))}})

    def error(self, err: BaseException) -> None:
        tb = traceback.format_exception(type(err), err, err.__traceback__)
        self.items.append({"output_type": "error", "ename": type(err).__name__, "evalue": str(err),
                           "traceback": [t.rstrip("\n") for t in tb]})

    def as_list(self) -> list[dict]:
        for item in self.items:
            if item["output_type"] == "stream":
                item["text"] = lines(last_state(item["text"]))
        return self.items


class Stream(io.TextIOBase):
    """A text stream that appends to the current cell's outputs under ``name`` (stdout / stderr)."""

    def __init__(self, name: str, sink: CellOutputs):
        self.name, self.sink = name, sink

    def write(self, text: str) -> int:
        self.sink.write(self.name, text)
        return len(text)

    def isatty(self) -> bool:
        return False


def lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def last_state(text: str) -> str:
    """Each line as a terminal leaves it: the part after its last carriage return."""
    return "".join(line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.splitlines(keepends=True))


def run_cell(source: str, namespace: dict, out: CellOutputs, filename: str) -> None:
    """Runs ``source`` in ``namespace``; a final expression's value (not None) becomes the result."""
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
        if value is not None:
            out.result(value)


def run_notebook(nb: dict, folder: Path, name: str = "notebook") -> tuple[bool, dict]:
    """Runs the code cells of ``nb`` (nbformat 4 JSON, updated in place with their outputs) with
    ``folder`` as the working directory. Returns whether no cell raised, and the namespace."""
    namespace: dict = {"__name__": "__main__"}
    cwd, count, ok = Path.cwd(), 0, True
    show, stdout, stderr = plt.show, sys.stdout, sys.stderr
    os.chdir(folder)
    try:
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            if not ok:  # a cell raised: the rest stay unexecuted
                cell["outputs"], cell["execution_count"] = [], None
                continue
            count += 1
            out = CellOutputs(count)
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            source = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
            plt.show = lambda *args, **kwargs: out.figures()
            sys.stdout, sys.stderr = Stream("stdout", out), Stream("stderr", out)
            t0 = time.perf_counter()
            try:
                run_cell(source, namespace, out, f"{name}[cell {i}]")
            except Exception as err:  # stored in the notebook, as Jupyter would; the notebook stops there
                out.error(err)
                ok = False
            finally:
                sys.stdout, sys.stderr, plt.show = stdout, stderr, show
            out.figures()
            cell["outputs"], cell["execution_count"] = out.as_list(), count
            print(f"  {name} cell {i}: {time.perf_counter() - t0:.1f} s{'' if ok else ' (raised)'}", flush=True)
    finally:
        os.chdir(cwd)
        plt.close("all")
    return ok, namespace


def execute(path: Path, out_path: Path) -> bool:
    """Executes the notebook at ``path`` in its folder and writes it with its outputs to ``out_path``."""
    t0 = time.perf_counter()
    nb = json.loads(path.read_text())
    ok, _ = run_notebook(nb, path.resolve().parent, path.name)
    out_path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    print(f"{path.name}: {'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s -> {out_path}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="folder for the executed notebooks (default: in place)")
    args = ap.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for path in args.notebooks:
        if not execute(path, path if args.out is None else args.out / path.name):
            failed.append(path.name)
        gc.collect()  # the previous notebook's namespace (params, KV pool) goes before the next one starts
    if failed:
        print("failed:", ", ".join(failed), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
