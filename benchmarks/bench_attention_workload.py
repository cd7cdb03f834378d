"""Decode attention on the contexts of nano-vllm's workload (GPU): where its KV reads lose bandwidth.

The uniform ``B x ctx`` table of ``bench_attention.py`` reads at 92% of the ceiling at ctx 1,024 but
63% at ctx 128, and inside the workload every batch is ragged (prompts of 100-1,024 tokens plus what
has been generated). This script rebuilds the decode batches the engine runs at steps ``t`` of the
workload (``jaxpaged.workloads.nano_vllm_workload``: request ``i`` decodes while ``t < max_tokens_i``,
with context ``prompt_i + t + 1``), in the scheduler's order (submission order), and times one layer of
attention for each launch variant, with the KV read in bytes per second and an estimate of the whole
workload's decode attention (28 layers, every step, interpolated between the sampled steps).

Variants: the engine's configuration; the same with the batch's rows sorted longest context first
(a longest-job-first launch order); the last tile's K/V loaded whole and zeroed after the load
(``load_all``: the kernel before session 13); and a few launch configurations (stages, warps, KV tile,
split-K). Block tables are padded with block 0 as the engine's are (``--pad-tables random``: random
blocks, as before session 13).

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \
        PYTHONUNBUFFERED=1 python3 benchmarks/bench_attention_workload.py --out $OUT
    python benchmarks/bench_attention_workload.py --smoke   # tiny, interpret mode, on CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench_attention import HKV, HQ, D, BS, chain_time, hbm_read_ceiling, rel_err
from jaxpaged.kernels.paged_attention import AttentionConfig, choose_config, paged_attention
from jaxpaged.kernels.reference import paged_attention_reference
from jaxpaged.workloads import nano_vllm_workload

LAYERS = 28  # Qwen3-0.6B


def workload_batch(t: int, num_seqs: int) -> np.ndarray:
    """Context lengths of the decode batch at decode step ``t`` (submission order)."""
    prompts, sps = nano_vllm_workload(num_seqs)
    return np.array([len(p) + t + 1 for p, sp in zip(prompts, sps) if t < sp.max_tokens], np.int32)


def variants(b: int, max_ctx: int, smoke: bool) -> dict[str, tuple[AttentionConfig, bool]]:
    """name -> (config, sort rows longest first)."""
    d = choose_config(b, b, HQ, HKV, BS, max_ctx, decode=True)
    rep = lambda **kw: dataclasses.replace(d, **kw)  # noqa: E731
    out = {"engine": (d, False), "sorted": (d, True), "load_all": (rep(mask_loads=False), False)}
    if smoke:
        return out
    out.update({
        "stages2": (rep(num_stages=2), False),
        "stages4": (rep(num_stages=4), False),
        "warps2": (rep(num_warps=2), False),
        "warps8": (rep(num_warps=8), False),
        "k32s4": (rep(block_k=32, num_stages=4), False),
        "k128s2": (rep(block_k=128, num_stages=2), False),
        "splits2": (rep(num_splits=max(2, d.num_splits * 2)), False),
        "splits4": (rep(num_splits=max(4, d.num_splits * 4)), False),
        "sorted_stages2": (rep(num_stages=2), True),
        "sorted_splits2": (rep(num_splits=max(2, d.num_splits * 2)), True),
        "sorted_splits4": (rep(num_splits=max(4, d.num_splits * 4)), True),
        "sorted_stages2_splits2": (rep(num_splits=max(2, d.num_splits * 2), num_stages=2), True),
        "sorted_load_all": (rep(mask_loads=False), True),
    })
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--steps", default="0,128,256,384,512,640,768,896", help="decode steps to rebuild")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--only", default="", help="comma list of variant names (default all)")
    ap.add_argument("--pad-tables", choices=("zero", "random"), default="zero",
                    help="block-table entries past a row's blocks: 0 as in the engine (default; a tail "
                    "tile's loads past the row then hit one shared block), or random pool blocks "
                    "(sessions 6-12)")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    smoke = args.smoke
    interpret = jax.default_backend() == "cpu"
    num_seqs = 8 if smoke else 256
    steps = [0, 64] if smoke else [int(s) for s in args.steps.split(",")]
    ceiling = hbm_read_ceiling(smoke)
    print(f"read ceiling {ceiling / 1e12:.2f} TB/s", flush=True)
    rng = np.random.default_rng(0)
    batches = {t: workload_batch(t, num_seqs) for t in steps}
    if smoke:
        batches = {t: np.minimum(v, 64 + t) for t, v in batches.items()}
    max_blocks = max(int(math.ceil(v.max() / BS)) for v in batches.values())
    num_blocks = num_seqs * max_blocks + 8
    pool = jax.random.normal(jax.random.key(0), (1, num_blocks, BS, 2, HKV, D), jnp.bfloat16)
    rows, totals = [], {}
    for t, lens in batches.items():
        b = len(lens)
        if b == 0:
            continue
        w = int(math.ceil(lens.max() / BS))
        tables = rng.permutation(num_blocks)[: b * w].reshape(b, w).astype(np.int32)
        if args.pad_tables == "zero":  # as the engine's tables: entries past a row's blocks are block 0
            tables[np.arange(w)[None, :] >= -(-lens[:, None] // BS)] = 0
        q = jax.random.normal(jax.random.key(t), (b, HQ, D), jnp.bfloat16)
        cu = jnp.arange(b + 1, dtype=jnp.int32)
        kv_bytes = int(lens.sum()) * 2 * HKV * D * 2
        order = np.argsort(-lens, kind="stable")
        refs: dict[bool, jax.Array] = {}
        names = variants(b, w * BS, smoke)
        if args.only:
            names = {k: v for k, v in names.items() if k in args.only.split(",")}
        for name, (cfg, sort) in names.items():
            ln, tb = (lens[order], tables[order]) if sort else (lens, tables)
            consts = (pool, cu, jnp.asarray(ln))
            try:
                out = paged_attention(q, pool, 0, cu, jnp.asarray(ln), jnp.asarray(tb), config=cfg,
                                      interpret=interpret)
                if sort not in refs:
                    with jax.default_matmul_precision("highest"):
                        refs[sort] = paged_attention_reference(q, pool, 0, cu, jnp.asarray(ln), jnp.asarray(tb))
                err = rel_err(out, refs[sort])
                _, sec = chain_time(lambda qq, cs, tab, cfg=cfg: paged_attention(
                    qq, cs[0], 0, cs[1], cs[2], tab, config=cfg, interpret=interpret),
                    q, consts, [jnp.asarray(tb)], 2 if smoke else args.reps, 2 if smoke else args.chain)
            except Exception as e:  # keep going: record the failure
                print(f"t={t} {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            rec = dict(step=t, batch=b, mean_ctx=float(lens.mean()), max_ctx=int(lens.max()), variant=name,
                       config=str(cfg), time_us=sec * 1e6, TBps=kv_bytes / sec / 1e12,
                       frac=kv_bytes / sec / ceiling, rel_err=err)
            rows.append(rec)
            print(f"t={t:4d} B={b:3d} ctx mean {lens.mean():6.0f} max {lens.max():5d} {name:16s} "
                  f"{sec * 1e6:8.1f} us {kv_bytes / sec / 1e12:5.2f} TB/s {kv_bytes / sec / ceiling:5.1%} "
                  f"err {err:.1e}", flush=True)
    # Whole-workload estimate: per variant, the sampled steps' times interpolated over every step.
    _, sps = nano_vllm_workload(num_seqs)
    all_steps = np.arange(max(sp.max_tokens for sp in sps))
    for name in dict.fromkeys(r["variant"] for r in rows):
        pts = sorted((r["step"], r["time_us"]) for r in rows if r["variant"] == name)
        if len(pts) != len([t for t in steps if len(batches[t])]):
            continue
        xs, ys = zip(*pts)
        est = np.interp(all_steps, xs + (all_steps[-1],), ys + (0.0,)).sum() * LAYERS / 1e6
        totals[name] = est
    if args.out:  # written before the summary, so a failure there loses nothing
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention_workload.json"), "w") as f:
            json.dump(dict(ceiling_TBps=ceiling / 1e12, rows=rows, totals_s=totals), f, indent=1)
    base = totals.get("engine")
    print("\nvariant            est. decode attention over the workload (s, 28 layers)  vs engine")
    for name, s in totals.items():
        ratio = f"{base / s:5.3f}x" if base else "  n/a"
        print(f"{name:18s} {s:8.3f}   {ratio}")
    return dict(rows=rows, totals_s=totals)


if __name__ == "__main__":
    main()
