"""Writes the notebooks in this folder from the Python strings below.

Edit the cells here, then run ``python notebooks/make_notebooks.py``: the ``.ipynb`` files are
generated, so a review reads this file. A cell whose id and source are unchanged keeps the outputs
stored in the existing notebook; ``--clear-outputs`` drops them all.
``tests/benchmarks/test_notebooks_and_experiments.py`` checks the sources match this file and runs
every code cell of every notebook on a CPU, on a copy.

The model follows the device, inside the cells (so one source serves both): on a GPU, Qwen3-0.6B's
shapes with random bfloat16 weights; on a CPU, the packaged tiny random Qwen3 checkpoint, where every
notebook runs in seconds. The committed outputs come from ``python tools/run_notebooks.py
notebooks/*.ipynb`` (no Jupyter needed); each notebook's first output names the device. Install with
``pip install -e '.[notebooks]'``; the first cell of each notebook does that when jaxpaged is missing.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

HERE = Path(__file__).parent

INSTALL = """\
# Installs jaxpaged if this kernel cannot import it yet, from the checkout this notebook sits in: the first
# folder at or above the working directory (Jupyter starts in the notebook's folder) that holds jaxpaged's
# pyproject.toml, else $JAXPAGED_DIR, else /content/jaxpaged (a clone or upload in Colab). It runs
# `pip install -e '<checkout>[notebooks]'` (with the `cuda12` extra where nvidia-smi exists). Already
# installed: it does nothing.
import importlib
import os
import shutil
import site
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def find_checkout():
    env = [Path(os.environ["JAXPAGED_DIR"])] if os.environ.get("JAXPAGED_DIR") else []
    for folder in [*env, Path.cwd(), *Path.cwd().parents, Path("/content/jaxpaged")]:
        if (folder / "pyproject.toml").is_file() and (folder / "jaxpaged" / "__init__.py").is_file():
            return folder
    raise FileNotFoundError(f"jaxpaged is not installed and no checkout holds {Path.cwd()}: "
                            "clone the repository (or set JAXPAGED_DIR to a clone) first")


try:
    version("jaxpaged")
except PackageNotFoundError:
    checkout = find_checkout()
    extras = "notebooks,cuda12" if shutil.which("nvidia-smi") else "notebooks"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{checkout}[{extras}]"], check=True)
    for folder in [*site.getsitepackages(), site.getusersitepackages()]:
        site.addsitedir(folder)  # reads the editable install's .pth hook, so no kernel restart is needed
    importlib.invalidate_caches()
    print("installed jaxpaged from", checkout)
"""

MODEL_NOTE = """\
**Runs anywhere; the model follows the device.** On a GPU: Qwen3-0.6B's shapes (28 layers, 16 query and 8 KV
heads of 128) with random `bfloat16` weights (`load_format="dummy"`: nothing is downloaded) and the Pallas
attention kernels. On a CPU: the packaged tiny random Qwen3 checkpoint in `float32` with the `jnp` reference
attention. Random weights make gibberish, and every mechanism shown is real. Text goes through the tiny
checkpoint's tokenizer on both, which knows 512 tokens: on the GPU, generated ids past those decode to nothing, so
read the token ids. For a real model, end the next cell with e.g.
`MODEL, DTYPE, LOAD_FORMAT = "/models/Qwen3-0.6B", "bfloat16", "auto"` (any Hugging Face Qwen2 / Qwen2.5 / Qwen3
folder)."""


def md(*parts: str) -> dict:
    """A markdown cell; each part is dedented (a line indented like code would render as code)."""
    return {"cell_type": "markdown", "metadata": {}, "source": _lines(parts)}


def code(*parts: str) -> dict:
    """A code cell from one or more strings, each dedented on its own (so a shared block can lead)."""
    return {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": _lines(parts)}


def _lines(parts: tuple[str, ...]) -> list[str]:
    blocks = [textwrap.dedent(p).strip("\n") for p in parts]
    for block in blocks:
        if block[:1].isspace():  # a line indented less than the first one stops the dedent
            raise ValueError(f"cell text is not dedented (is a line indented less than the first?): {block[:80]!r}")
    return "\n\n".join(blocks).splitlines(keepends=True)


def notebook(cells: list[dict], name: str) -> dict:
    """nbformat 4.5 JSON; cell ids are stable (``<notebook>-<index>``) so regenerating changes nothing."""
    stem = Path(name).stem.replace("_", "-")
    return {
        "cells": [{"id": f"{stem}-{i}", **cell} for i, cell in enumerate([code(INSTALL), *cells])],
        "metadata": {
            "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
            "language_info": {"name": "python", "pygments_lexer": "ipython3"},
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def keep_outputs(nb: dict, old: dict) -> dict:
    """``nb`` with the stored outputs of ``old``'s code cells whose id and source are unchanged."""
    stored = {c.get("id"): c for c in old.get("cells", []) if c["cell_type"] == "code"}
    for cell in nb["cells"]:
        prev = stored.get(cell["id"])
        if cell["cell_type"] == "code" and prev is not None and source(prev) == source(cell):
            cell["outputs"], cell["execution_count"] = prev.get("outputs", []), prev.get("execution_count")
    return nb


SETUP = """\
import json
import shutil
import tempfile
from pathlib import Path

import jax

from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.workloads import QWEN3_0_6B

if jax.default_backend() == "gpu":
    # A folder with Qwen3-0.6B's config.json (the weights are made from it) and the tiny checkpoint's tokenizer.
    MODEL = Path(tempfile.gettempdir()) / "jaxpaged-qwen3-0.6b-random"
    MODEL.mkdir(exist_ok=True)
    (MODEL / "config.json").write_text(json.dumps(QWEN3_0_6B))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_checkpoint_path("qwen3") / name, MODEL / name)
    DTYPE, LOAD_FORMAT, ABOUT = "bfloat16", "dummy", "Qwen3-0.6B shapes, random bfloat16 weights"
else:
    MODEL, DTYPE, LOAD_FORMAT = tiny_checkpoint_path("qwen3"), "float32", "auto"
    ABOUT = "the packaged tiny random Qwen3 checkpoint, float32"
print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}); model: {ABOUT}")
"""

QUICKSTART = [
    md("""
        # jaxpaged quickstart

        Generate with the vLLM-style `LLM` class, then look at where the KV-cache memory went: pool statistics,
        prefix-cache hits, `explain_prefix` (why two prompts did not share more cached blocks), the block event
        log and the per-step metrics.
        """),
    md(MODEL_NOTE),
    code(SETUP, """
        from collections import Counter

        import jaxpaged
        from jaxpaged import LLM, EngineConfig, SamplingParams
        """),
    md("""
        ## An engine

        The KV cache is one pool of `num_blocks` blocks of `block_size` tokens each. `event_log=True` records every
        block allocation, prefix hit, cache insertion, free and eviction (leave it off in production).
        """),
    code("""
        llm = LLM(MODEL, dtype=DTYPE, load_format=LOAD_FORMAT, block_size=16, num_blocks=128, max_model_len=512,
                  max_num_batched_tokens=64, event_log=True)
        s = llm.stats()
        compiled = (f"{s['compiled_shapes']} step shapes compiled at start-up ({s['compile_seconds']:.1f} s)"
                    if s["compiled_shapes"] else "step shapes compiled on first use")
        print(f"pool: {s['num_blocks']} blocks x {s['block_size']} tokens = {s['kv_pool_bytes'] / 2**20:.2f} MiB "
              f"of {s['kv_dtype']} ({s['kv_bytes_per_token']:,} bytes of K+V per token), "
              f"attention: {s['attention_backend']}, {compiled}")
        """),
    md("""
        ## Generate

        Prompts are text (tokenized with the checkpoint's `tokenizer.json`) or lists of token ids. Outputs come back in
        input order, vLLM-shaped. `temperature=0` is greedy. On a GPU (the Pallas attention kernels) `LLM(...)`
        compiles every step shape when it is made (the progress bar above; `LLM(..., warmup=False)` skips that), so
        no request waits for a compilation. On a CPU (the `jnp` reference attention, whose block tables are padded per
        step) it does not: each step shape compiles on first use, and the first requests' TTFT includes that. The line
        above says which happened here.
        """),
    code("""
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = llm.generate(["Hello, my name is", "The capital of France is", [1, 2, 3, 4, 5]], greedy, use_tqdm=False)
        for o in outs:
            c = o.outputs[0]
            print(f"[{o.request_id}] {o.prompt!r} ({len(o.prompt_token_ids)} prompt tokens) -> {c.text!r}")
            print(f"    token ids {c.token_ids}, finish={c.finish_reason}, "
                  f"TTFT {o.metrics.time_to_first_token * 1e3:.0f} ms")
        """),
    md("""
        ## Statistics

        `llm.stats()` is a flat dict: pool geometry, blocks used / free / cached now and at peak, KV bytes, prefix-cache
        counters, scheduler counters and compile time. Finished requests hold no block any more, but their *full* blocks
        stay in the prefix cache (`blocks_cached`, evictable when the pool needs room).
        """),
    code("""
        s = llm.stats()
        for key in ("blocks_used", "blocks_free", "blocks_cached", "peak_blocks_used", "peak_kv_bytes_in_use",
                    "prefix_hit_rate", "prefill_tokens", "decode_tokens", "steps", "preemptions", "evictions",
                    "compile_seconds", "compiled_shapes"):
            print(f"{key:22s} {s[key]}")
        print()
        print(llm.engine.kv.stats())   # the same, as one line
        """),
    md("""
        ## Prefix caching and `explain_prefix`

        Requests that share a system prompt reuse its full blocks. The second request below computes only the blocks after
        the shared part (`num_cached_tokens`). `explain_prefix(a, b)` says where two prompts diverge, in tokens and blocks.
        """),
    code("""
        SYSTEM = "You are a helpful assistant. Answer in one short sentence, please. " * 3
        q1 = SYSTEM + "Question: what is PagedAttention?"
        q2 = SYSTEM + "Question: what is a block table?"
        a = llm.generate([q1], greedy, use_tqdm=False)[0]
        b = llm.generate([q2], greedy, use_tqdm=False)[0]
        print(f"first: {a.num_cached_tokens}/{len(a.prompt_token_ids)} prompt tokens from the cache")
        print(f"second: {b.num_cached_tokens}/{len(b.prompt_token_ids)} prompt tokens from the cache")
        print(llm.explain_prefix(q1, q2))
        """),
    md("""
        The classic miss: a timestamp at the top of the system prompt. Everything after the first differing token is a
        different prefix, so almost nothing is shared. The functional `jaxpaged.explain_prefix` works on token ids.
        """),
    code("""
        t1 = "Current time: 2026-01-05 10:32:07. " + q1
        t2 = "Current time: 2026-01-05 10:32:09. " + q1
        why = llm.explain_prefix(t1, t2)
        print(why)
        tok = llm.engine.tokenizer
        assert why == jaxpaged.explain_prefix(tok.encode(t1), tok.encode(t2), block_size=16)
        c, d = llm.generate([t1], greedy, use_tqdm=False)[0], llm.generate([t2], greedy, use_tqdm=False)[0]
        print(f"second timestamped request: {d.num_cached_tokens}/{len(d.prompt_token_ids)} prompt tokens from the cache")
        """),
    md("""
        ## The block event log

        Every block event, with the request that caused it: `allocate` (fresh blocks), `hit` (cached blocks reused),
        `insert` (a full block entered the prefix cache), `free` (a request released its blocks), `evict` (a cached
        block was reclaimed for someone else).
        """),
    code("""
        events = llm.engine.kv.events
        print(len(events), "events:", dict(Counter(e.kind for e in events)))
        for e in events.for_request(b.request_id):
            print(f"  request {e.request_id}: {e.kind:8s} blocks {list(e.block_ids)}")
        """),
    md("""
        ## Per-step metrics

        `engine.metrics.as_columns()` gives one list per field of the step records (ready for `pandas.DataFrame` or a
        plot): sequences and prefill / decode tokens in the step, padded tokens the device computed, blocks used and
        cached after it, KV bytes in use, block utilisation (filled / allocated slots) and wall time. Below, over every
        step this engine ran: the tokens each step computed (prefills of up to `max_num_batched_tokens=64`, then decode
        steps of one token per sequence) and where the pool's blocks are: held by running requests, or unreferenced but
        still holding a cached prefix (those grow with each finished request and are evicted only when the pool needs
        room); the rest are free.
        """),
    code("""
        import matplotlib.pyplot as plt

        cols = llm.engine.metrics.as_columns()
        fig, axes = plt.subplots(1, 2, figsize=(13, 3.6))
        axes[0].bar(cols["step"], cols["num_prefill_tokens"], label="prefill tokens")
        axes[0].bar(cols["step"], cols["num_decode_tokens"], bottom=cols["num_prefill_tokens"], label="decode tokens")
        axes[0].plot(cols["step"], cols["num_padded_tokens"], "k.", ms=3, label="computed (with padding)")
        axes[0].set(xlabel="engine step", ylabel="tokens", title="tokens per step",
                    ylim=(0, 1.3 * max(cols["num_padded_tokens"])))
        axes[0].legend(loc="upper center", ncols=3, fontsize="small")
        axes[1].stackplot(cols["step"], cols["blocks_used"], cols["blocks_cached"],
                          labels=["used by running requests", "cached, unreferenced (evictable)"])
        axes[1].axhline(llm.stats()["num_blocks"], color="gray", ls="--", label="pool size")
        axes[1].set(xlabel="engine step", ylabel="KV blocks", title="KV pool after each step")
        axes[1].legend()
        fig.tight_layout()
        plt.show()
        """),
    md("""
        The first steps as a table:
        """),
    code("""
        show = {"step": "step", "num_seqs": "seqs", "num_prefill_tokens": "prefill", "num_decode_tokens": "decode",
                "num_padded_tokens": "padded", "blocks_used": "used", "blocks_cached": "cached",
                "block_utilisation": "utilisation"}
        print(" ".join(f"{h:>11s}" for h in show.values()))
        for i in range(min(10, len(cols["step"]))):
            print(" ".join(f"{cols[n][i]:11.2f}" if isinstance(cols[n][i], float) else f"{cols[n][i]:11d}" for n in show))
        """),
    md("""
        ## The functional form

        `jaxpaged.generate(params, prompts, config=EngineConfig(...))` builds a fresh engine (pool) over loaded params;
        compiled steps are reused across engines of the same model.
        """),
    code("""
        config = EngineConfig(block_size=16, num_blocks=128, max_model_len=512, max_num_batched_tokens=64)
        outs = jaxpaged.generate(llm.params, [[7, 8, 9, 10, 11, 12]], config=config, sampling_params=greedy)
        print(outs[0].outputs[0].token_ids)
        """),
]

MEMORY = [
    md("""
        # Where does KV memory go? Paged blocks vs. max-length reservation

        Same model, same kernel, same requests, same KV pool: only the reservation policy differs.
        - `paged`: a request gets a block when its last one fills (vLLM's PagedAttention).
        - `max_len`: a request reserves `max_model_len` tokens of contiguous blocks at admission, as a contiguous
          KV cache (`[batch, max_len, ...]`) does.

        The question: how many requests run at once, and how much of the reserved KV memory ever holds a token.
        The full experiment is `benchmarks/experiments/exp_memory.py` (`--full` for Qwen3-0.6B shapes on a GPU).
        """),
    md(MODEL_NOTE),
    code(SETUP, """
        import random

        import matplotlib.pyplot as plt
        import numpy as np

        from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
        from jaxpaged.llm import run_to_completion

        params = load_params(MODEL, DTYPE, load_format=LOAD_FORMAT)

        def utilisation(cols):
            # filled / allocated KV slots per step; NaN on steps that end holding no block (reported as 1.0)
            return np.where(np.array(cols["blocks_used"]) > 0, cols["block_utilisation"], np.nan)
        """),
    md("""
        A workload of requests with random prompt and output lengths, greedy, EOS ignored (so every run does the same
        work), and a pool of 128 blocks x 16 tokens = 2048 token slots, with `max_model_len=512`.
        """),
    code("""
        rng = random.Random(0)
        vocab = params.config.vocab_size
        prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(16, 160))] for _ in range(24)]
        sps = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(16, 64)) for _ in prompts]

        runs = {}
        for policy in ("paged", "max_len"):
            config = EngineConfig(block_size=16, num_blocks=128, max_model_len=512,
                                  max_num_batched_tokens=64, reservation=policy, enable_prefix_caching=False)
            engine = LLMEngine(params, config)
            outs = run_to_completion(engine, prompts, sps)
            runs[policy] = (engine, outs)
            s = engine.stats()
            cols = engine.metrics.as_columns()
            print(f"{policy:8s} {s['steps']:4d} steps, peak batch {max(cols['num_seqs']):3d}, "
                  f"peak {s['peak_blocks_used']}/{s['num_blocks']} blocks, "
                  f"mean utilisation {np.nanmean(utilisation(cols)):.1%}, "
                  f"preemptions {s['preemptions']}, admission refusals {s['max_len_admission_failures']}")
        paged, max_len = ([o.outputs[0].token_ids for o in outs] for _, outs in runs.values())
        differ = sum(a != b for a, b in zip(paged, max_len))
        print(f"greedy outputs that differ between the policies: {differ} of {len(prompts)} requests")
        assert differ == 0 or DTYPE != "float32"   # float32: identical; bfloat16: not promised (see below)
        """),
    md("""
        Per step: requests in the batch, KV bytes reserved, and the fraction of reserved slots that hold a token.
        Under `max_len` the pool is full after four admissions (4 x 32 blocks), while most of each reservation stays
        empty; paged blocks are nearly all full, so many more requests fit and the workload takes far fewer steps.
        """),
    code("""
        fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
        for policy, (engine, _) in runs.items():
            cols = engine.metrics.as_columns()
            axes[0].plot(cols["num_seqs"], label=policy)
            axes[1].plot([b / 2**20 for b in cols["kv_bytes_in_use"]], label=policy)
            axes[2].plot(utilisation(cols), label=policy)
        axes[0].set(xlabel="step", ylabel="requests in the batch")
        axes[1].set(xlabel="step", ylabel="KV reserved (MiB)")
        axes[2].set(xlabel="step", ylabel="filled / reserved KV slots", ylim=(0, 1.05))
        axes[0].legend()
        fig.tight_layout()
        plt.show()
        """),
    md("""
        The reservation changes where K/V live and when a request may start, never what the model computes: in `float32`
        the greedy outputs are identical under both policies (asserted above). In `bfloat16` a request batched with
        other neighbours goes through matmuls of other shapes, whose rounding differs, so a near-tie between two tokens
        can flip; `EngineConfig(batch_invariant=True)` makes outputs independent of the batch (docs/NUMERICS.md).
        """),
]

PREFIX_CACHE = [
    md("""
        # Prefix caching: what a shared system prompt saves

        Requests that begin with the same system prompt reuse the KV blocks that hold it, so their prefill computes only
        the question. Here: the same requests with prefix caching on and off, one request at a time, so each request's
        time to first token (TTFT) is its own prefill latency. Then the classic miss (a timestamp inside the system
        prompt), diagnosed with `explain_prefix`. The full experiment is `benchmarks/experiments/exp_prefix_cache.py`.
        """),
    md(MODEL_NOTE),
    code(SETUP, """
        import random

        import matplotlib.pyplot as plt

        import jaxpaged
        from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
        from jaxpaged.llm import run_to_completion
        from jaxpaged.io.tokenizer import load_tokenizer

        params = load_params(MODEL, DTYPE, load_format=LOAD_FORMAT)
        vocab = params.config.vocab_size
        greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
        """),
    md("""
        Six requests: a 256-token system prompt (token ids) plus a distinct 16-32 token question each. `run` makes a
        fresh engine (empty cache) and sends the requests one after the other. The first pass of each setting compiles
        the step shapes; the second is the one we time.
        """),
    code("""
        rng = random.Random(0)
        system = [rng.randrange(1, vocab) for _ in range(256)]
        prompts = [system + [rng.randrange(1, vocab) for _ in range(rng.randint(16, 32))] for _ in range(6)]

        def run(caching, prompts=prompts):
            config = EngineConfig(block_size=16, num_blocks=128, max_model_len=512,
                                  max_num_batched_tokens=64, enable_prefix_caching=caching)
            engine = LLMEngine(params, config)
            outs = [run_to_completion(engine, [p], greedy)[0] for p in prompts]
            return engine, outs

        for caching in (False, True):
            run(caching)   # compile
        results = {caching: run(caching) for caching in (False, True)}
        for caching, (engine, outs) in results.items():
            s = engine.stats()
            ttft = [o.metrics.time_to_first_token * 1e3 for o in outs]
            print(f"caching {'on ' if caching else 'off'}: prefilled {s['prefill_tokens']:5d} of "
                  f"{sum(map(len, prompts))} prompt tokens, hit rate {s['prefix_hit_rate']:.1%}, "
                  f"cached per request {[o.num_cached_tokens for o in outs]}, "
                  f"TTFT ms {[round(t, 1) for t in ttft]}")
        same = [o.outputs[0].token_ids for o in results[True][1]] == [o.outputs[0].token_ids for o in results[False][1]]
        print("greedy outputs identical with and without caching:", same,
              "" if DTYPE == "float32" else "(bfloat16: not promised, a cached prefix changes the shapes computed)")
        assert same or DTYPE != "float32"
        """),
    md("""
        Left: TTFT per request (request 0 fills the cache, the others hit). Right: prefill tokens computed in each
        engine step: with caching, after the first request only the questions are computed (one step of at most
        `max_num_batched_tokens=64` tokens instead of five).
        """),
    code("""
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
        for caching, (engine, outs) in results.items():
            label = f"prefix caching {'on' if caching else 'off'}"
            axes[0].plot([o.metrics.time_to_first_token * 1e3 for o in outs], "o-", label=label)
            axes[1].plot(engine.metrics.as_columns()["num_prefill_tokens"], label=label)
        axes[0].set(xlabel="request", ylabel="TTFT (ms)")
        axes[1].set(xlabel="engine step", ylabel="prefill tokens computed")
        axes[0].legend()
        fig.tight_layout()
        plt.show()
        """),
    md("""
        ## The timestamp miss

        A system prompt that starts with the current time differs between any two requests from the timestamp on: only
        the full blocks before it can be shared. `explain_prefix` finds the first differing token and block. Moving
        the timestamp after the system prompt (into the user turn) restores the hits.
        """),
    code("""
        tok = load_tokenizer(MODEL)
        SYSTEM = "You are a helpful assistant. Answer in one short sentence, please. " * 4

        def request(i, inside):
            stamp = f"Current time: 2026-01-05 10:32:{i:02d}. "
            question = f"Question {i}: what is a block table?"
            return tok.encode(stamp + SYSTEM + question if inside else SYSTEM + stamp + question)

        print("timestamp first:", jaxpaged.explain_prefix(request(1, True), request(2, True), block_size=16))
        print("timestamp moved:", jaxpaged.explain_prefix(request(1, False), request(2, False), block_size=16))
        for inside in (True, False):
            engine, _ = run(True, [request(i, inside) for i in range(6)])
            s = engine.stats()
            print(f"timestamp {'first' if inside else 'moved'}: hit rate {s['prefix_hit_rate']:.1%}, "
                  f"prefilled {s['prefill_tokens']} tokens")
        """),
]

BLOCK_SIZE = [
    md("""
        # Block size at a fixed KV budget

        The pool always holds 2048 token slots (the same bytes), so `num_blocks = 2048 // block_size`. Bigger blocks
        mean fewer, larger gathers for the kernel, but:
        - more internal fragmentation: the last block of each sequence is on average half empty;
        - coarser prefix hits: only full blocks are shared, so a 120-token shared prefix gives 120 cached tokens per
          request at block size 8, 112 at 16 and 96 at 32.

        Greedy outputs do not depend on the block size in `float32` (asserted below); in `bfloat16` they are not
        promised to (the attention kernel's tiles follow the block size, and rounding with them) unless
        `batch_invariant=True`. The full sweep (with throughput, which is only meaningful on a GPU) is
        `benchmarks/experiments/exp_block_size.py`.
        """),
    md(MODEL_NOTE),
    code(SETUP, """
        import random

        import matplotlib.pyplot as plt
        import numpy as np

        from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
        from jaxpaged.llm import run_to_completion

        params = load_params(MODEL, DTYPE, load_format=LOAD_FORMAT)
        vocab = params.config.vocab_size
        BLOCK_SIZES, KV_TOKENS = (8, 16, 32), 2048

        def engine_for(block_size):
            return LLMEngine(params, EngineConfig(block_size=block_size, num_blocks=KV_TOKENS // block_size,
                                                   max_model_len=256, max_num_batched_tokens=64))

        def utilisation(cols):
            # filled / allocated KV slots per step; NaN on steps that end holding no block (reported as 1.0)
            return np.where(np.array(cols["blocks_used"]) > 0, cols["block_utilisation"], np.nan)
        """),
    md("""
        ## Fragmentation: a mixed workload

        Random prompt and output lengths, no sharing. Utilisation = filled / allocated slots of the running requests.
        """),
    code("""
        rng = random.Random(0)
        prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(8, 128))] for _ in range(16)]
        sps = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=rng.randint(8, 48)) for _ in prompts]

        mixed = {}
        for bs in BLOCK_SIZES:
            engine = engine_for(bs)
            outs = run_to_completion(engine, prompts, sps)
            mixed[bs] = (engine.metrics.as_columns(), [o.outputs[0].token_ids for o in outs], engine.stats())
            cols, _, s = mixed[bs]
            util = np.nanmean(utilisation(cols))
            print(f"block size {bs:2d}: {s['num_blocks']:3d} blocks, mean utilisation {util:.1%} "
                  f"(fragmentation {1 - util:.1%}), peak batch {max(cols['num_seqs'])}, "
                  f"preemptions {s['preemptions']}, {s['steps']} steps")
        for bs in BLOCK_SIZES[1:]:
            differ = sum(a != b for a, b in zip(mixed[bs][1], mixed[BLOCK_SIZES[0]][1]))
            print(f"greedy outputs differing between block sizes {BLOCK_SIZES[0]} and {bs}: {differ} of {len(prompts)}")
            assert differ == 0 or DTYPE != "float32", "outputs depend on the block size"
        """),
    md("""
        ## Coarser hits: a shared prefix

        Eight requests share a 120-token prefix; the first runs alone, the rest after it, with prefix caching on.
        """),
    code("""
        system = [rng.randrange(1, vocab) for _ in range(120)]
        shared_prompts = [system + [rng.randrange(1, vocab) for _ in range(rng.randint(8, 24))] for _ in range(8)]
        greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)

        hits = {}
        for bs in BLOCK_SIZES:
            engine = engine_for(bs)
            first = run_to_completion(engine, shared_prompts[:1], greedy)    # fills the cache
            outs = first + run_to_completion(engine, shared_prompts[1:], greedy)
            hits[bs] = [o.num_cached_tokens for o in outs]
            s = engine.stats()
            print(f"block size {bs:2d}: cached tokens per request {hits[bs]}, hit rate {s['prefix_hit_rate']:.1%}")
            assert hits[bs][1:] == [120 // bs * bs] * 7
        """),
    code("""
        fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
        for bs, (cols, _, _) in mixed.items():
            axes[0].plot(utilisation(cols), label=f"block size {bs}")
        axes[0].set(xlabel="step", ylabel="filled / allocated KV slots", ylim=(0, 1.05),
                    title=f"mixed workload, {KV_TOKENS} KV slots")
        axes[0].legend()
        axes[1].bar([str(bs) for bs in hits], [sum(h) for h in hits.values()])
        axes[1].set(xlabel="block size", ylabel="prefix-cache hit tokens", title="8 requests, 120-token shared prefix")
        fig.tight_layout()
        plt.show()
        """),
]

NOTEBOOKS = {
    "quickstart.ipynb": QUICKSTART,
    "memory.ipynb": MEMORY,
    "prefix_cache.ipynb": PREFIX_CACHE,
    "block_size.ipynb": BLOCK_SIZE,
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clear-outputs", action="store_true", help="drop the outputs stored in the notebooks")
    args = ap.parse_args(argv)
    for name, cells in NOTEBOOKS.items():
        path = HERE / name
        nb = notebook(cells, name)
        if path.is_file() and not args.clear_outputs:
            nb = keep_outputs(nb, json.loads(path.read_text()))
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        print("wrote", path)


if __name__ == "__main__":
    main()
