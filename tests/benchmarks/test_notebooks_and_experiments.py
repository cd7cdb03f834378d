"""The notebooks and the experiment scripts run, on CPU, on the tiny checkpoint.

The notebooks' cell sources must be what ``notebooks/make_notebooks.py`` generates (outputs aside:
the committed notebooks hold the outputs of a run on a GPU). Each notebook runs from a copy in a
temporary folder, which is also the working directory, so nothing is written back into notebooks/,
through ``tools/run_notebooks.py`` (the executor that produced the committed outputs): every code
cell runs in order in one namespace (lines starting with ``%`` or ``!`` are IPython magics/shell and
are dropped; nothing else is skipped), with matplotlib on the Agg backend, and no cell may raise.
Each experiment script's ``main()`` runs on small settings; its JSON report is checked. Settings are
chosen so the notebooks and scripts share pool shapes, hence compiled steps.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
NOTEBOOK_NAMES = ["quickstart.ipynb", "memory.ipynb", "prefix_cache.ipynb", "block_size.ipynb"]


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cell_source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_notebooks_are_generated_from_make_notebooks():
    make = load_module(NOTEBOOKS / "make_notebooks.py")
    assert sorted(make.NOTEBOOKS) == sorted(NOTEBOOK_NAMES)
    for name, cells in make.NOTEBOOKS.items():
        expected, stored = make.notebook(cells, name), json.loads((NOTEBOOKS / name).read_text())
        sources = lambda nb: [(c["id"], c["cell_type"], cell_source(c)) for c in nb["cells"]]  # noqa: E731
        assert sources(stored) == sources(expected), f"{name} is stale: run python notebooks/make_notebooks.py"
        assert stored["nbformat"] == 4 and stored["metadata"]["kernelspec"]["language"] == "python"
        for cell in stored["cells"]:
            if cell["cell_type"] == "markdown":  # a line indented 4+ spaces would render as a code block
                first = cell_source(cell).splitlines()[0]
                assert not first.startswith(" "), f"{name} {cell['id']}: markdown not dedented: {first!r}"
        install = cell_source(stored["cells"][0])  # installs from the checkout the notebook sits in
        assert stored["cells"][0]["cell_type"] == "code" and "Path.cwd().parents" in install
        assert '"pip", "install", "-q", "-e"' in install


def test_notebooks_hold_outputs_and_plots():
    for name in NOTEBOOK_NAMES:
        cells = [c for c in json.loads((NOTEBOOKS / name).read_text())["cells"] if c["cell_type"] == "code"]
        outputs = [o for c in cells[1:] for o in c["outputs"]]  # the install cell prints nothing when installed
        assert all(c["outputs"] for c in cells[1:]), f"{name}: a code cell without outputs (run tools/run_notebooks.py)"
        assert not [o for o in outputs if o["output_type"] == "error"], f"{name} holds an error"
        assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} holds no plot"
        assert "device: " in "".join("".join(o.get("text", "")) for o in outputs), f"{name} does not name its device"


def test_make_notebooks_keeps_outputs_of_unchanged_cells():
    make = load_module(NOTEBOOKS / "make_notebooks.py")
    old = make.notebook(make.NOTEBOOKS["quickstart.ipynb"], "quickstart.ipynb")
    output = {"output_type": "stream", "name": "stdout", "text": ["on a GPU\n"]}
    code = [c for c in old["cells"] if c["cell_type"] == "code"]
    for c in code:
        c["outputs"], c["execution_count"] = [output], 1
    code[1]["source"] = ["an edited cell\n"]
    new = make.keep_outputs(make.notebook(make.NOTEBOOKS["quickstart.ipynb"], "quickstart.ipynb"), old)
    new_code = [c for c in new["cells"] if c["cell_type"] == "code"]
    assert new_code[0]["outputs"] == [output] and new_code[0]["execution_count"] == 1
    assert new_code[1]["outputs"] == [] and new_code[1]["execution_count"] is None
    assert all(c["outputs"] == [output] for c in new_code[2:])


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_notebook_runs(name, tmp_path):
    original = (NOTEBOOKS / name).read_bytes()
    path = tmp_path / name
    shutil.copyfile(NOTEBOOKS / name, path)
    nb = json.loads(path.read_text())
    ok, namespace = load_module(ROOT / "tools" / "run_notebooks.py").run_notebook(nb, tmp_path, name)
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    errors = [o for o in outputs if o["output_type"] == "error"]
    assert ok, "\n".join(errors[0]["traceback"] if errors else ["no error output"])
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{name} draws no plot"
    assert (NOTEBOOKS / name).read_bytes() == original  # the committed notebook is left as it was
    if name == "quickstart.ipynb":
        assert namespace["b"].num_cached_tokens > 0  # the shared system prompt hit
        assert namespace["d"].num_cached_tokens < namespace["b"].num_cached_tokens  # the timestamp miss
        assert len(namespace["events"].of_kind("hit")) > 0
        cols = namespace["cols"]
        assert max(cols["blocks_cached"]) > 0 and max(cols["num_decode_tokens"]) > 0
    if name == "prefix_cache.ipynb":
        on, off = namespace["results"][True][0].stats(), namespace["results"][False][0].stats()
        assert on["prefill_tokens"] < off["prefill_tokens"] and namespace["same"]


def test_exp_prefix_cache(tmp_path):
    exp = load_module(ROOT / "benchmarks" / "experiments" / "exp_prefix_cache.py")
    report = exp.main(["--out", str(tmp_path), "--prefix-lens", "0", "64", "--requests", "4",
                       "--num-blocks", "128", "--max-num-batched-tokens", "64", "--timestamp-at", "20"])
    assert json.loads((tmp_path / "prefix_cache.json").read_text()).keys() == report.keys()
    assert report.keys() >= {"device", "args", "results", "timestamp"}
    assert (tmp_path / "prefix_cache.png").is_file()
    rows = {(r["prefix_len"], r["mode"], r["caching"]): r for r in report["results"]}
    assert len(rows) == 2 * 2 * 2
    for r in rows.values():
        assert r.keys() >= {"prefill_tokens", "prefix_hit_rate", "ttft", "seconds", "num_cached_tokens"}
        assert len(r["ttft"]) == 4 and all(t > 0 for t in r["ttft"])
    seq_on, seq_off = rows[(64, "sequential", True)], rows[(64, "sequential", False)]
    assert seq_on["prefill_tokens"] < seq_off["prefill_tokens"] == seq_off["prompt_tokens"]
    assert seq_on["num_cached_tokens"] == [0, 64, 64, 64] and seq_on["prefix_hit_rate"] > 0.5
    assert rows[(0, "sequential", True)]["prefix_hit_tokens"] == 0
    ts = report["timestamp"]
    assert ts["first_diff_token"] == 20 and ts["shared_full_blocks"] == 1
    assert ts["hit_rate_inside"] < ts["hit_rate_moved"]


@pytest.mark.slow  # ~15 s on a CPU
def test_exp_block_size(tmp_path):
    exp = load_module(ROOT / "benchmarks" / "experiments" / "exp_block_size.py")
    report = exp.main(["--out", str(tmp_path), "--block-sizes", "8", "32", "--kv-tokens", "2048",
                       "--requests", "12", "--max-model-len", "128", "--max-num-batched-tokens", "64",
                       "--shared-requests", "4", "--shared-prefix-len", "40"])
    assert json.loads((tmp_path / "block_size.json").read_text()).keys() == report.keys()
    assert report.keys() >= {"device", "args", "mixed", "shared", "outputs_identical", "throughput_meaningful"}
    assert report["outputs_identical"] and (tmp_path / "block_size.png").is_file()
    mixed, shared = report["mixed"], report["shared"]
    assert [m["num_blocks"] * m["block_size"] for m in mixed] == [2048] * 2  # same KV budget
    assert len({m["kv_pool_bytes"] for m in mixed}) == 1
    for m in mixed:
        assert m.keys() >= {"mean_block_utilisation", "peak_running", "tokens_per_second", "preemptions"}
        assert 0 < m["mean_block_utilisation"] <= 1
    # Bigger blocks waste more slots per sequence and share a prefix more coarsely.
    assert mixed[0]["mean_wasted_slots_per_seq"] < mixed[-1]["mean_wasted_slots_per_seq"]
    assert [s["prefix_hit_tokens"] for s in shared] == [3 * 40, 3 * 32]  # whole blocks of the 40 shared tokens
    assert [s["prefix_hit_tokens"] for s in shared] == [s["expected_hit_tokens"] for s in shared]


def test_exp_memory(tmp_path):
    exp = load_module(ROOT / "benchmarks" / "experiments" / "exp_memory.py")
    report = exp.main(["--out", str(tmp_path), "--requests", "10", "--num-blocks", "32", "--block-size", "8",
                       "--max-model-len", "64", "--max-num-batched-tokens", "128"])
    assert json.loads((tmp_path / "memory.json").read_text()).keys() == report.keys()
    assert (tmp_path / "memory.png").is_file()
    paged, max_len, fp8 = report["results"]
    assert (paged["policy"], max_len["policy"], fp8["policy"]) == ("paged", "max_len", "paged fp8")
    assert paged["output_tokens"] == max_len["output_tokens"] == fp8["output_tokens"]  # same requests, same work
    # An fp8 pool of the same bytes: more blocks (1 byte an element and a scale row per block of 8,
    # against the tiny model's float32), so at least as many requests at once and fewer preemptions.
    assert fp8["kv_cache_dtype"] == "float8_e4m3fn" and fp8["kv_pool_bytes"] <= paged["kv_pool_bytes"]
    assert paged["kv_pool_bytes"] - fp8["kv_pool_bytes"] < fp8["kv_pool_bytes"] / fp8["num_blocks"]  # one block
    assert fp8["num_blocks"] > 3 * paged["num_blocks"]
    assert fp8["peak_running"] >= paged["peak_running"] and fp8["preemptions"] <= paged["preemptions"]
    # A contiguous reservation holds 64/8 = 8 blocks per request: at most 4 fit in 32 blocks, and
    # most of each reservation is empty; paged blocks run more requests at once, fuller.
    assert max_len["peak_running"] <= 4 < paged["peak_running"]
    assert paged["mean_block_utilisation"] > max_len["mean_block_utilisation"]
    assert max_len["admission_refusals"] > 0 and paged["admission_refusals"] == 0
    assert paged["steps"] < max_len["steps"]
