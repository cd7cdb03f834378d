"""The sampler alone on the GPU: a batch of ``[B, 151,936]`` float32 logits to one token per row.

Compares the engine's sampler (``sampling.sample``, random mode, Gumbel noise from the counter-based
hash), as the GPU's Pallas pass (``kernels/gumbel_argmax.py``, the default on a GPU) and as XLA's
reductions (``argmax_kernel=False``; the rows where both pick the same token are counted), with the
same sampler drawing its noise from ``jax.random`` (threefry,
``fold_in(key(seed), counter)`` per row: the sampler before session 6) and with a bare argmax (the
floor: one read of the logits). Rows sample at temperature 0.6 or are greedy (temperature 0).

``--frequency-rows N`` (default 32768) also samples one row of logits N times (seeds 0..N-1) with the
kernel and with XLA's path and compares each one's token frequencies with ``softmax(logits / T)``:
the total variation distance over the 50 likeliest tokens plus the rest, against the ~sqrt(K / N) that
sampling alone gives.

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \
        PYTHONUNBUFFERED=1 python3 benchmarks/bench_sampler.py --out $OUT
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.kernels.gumbel_argmax import SamplerConfig, gumbel_argmax
from jaxpaged.sampling.sampler import sample

VOCAB = 151936


def sample_threefry(logits, temperature, seeds, counters):
    """The random-mode sampler with ``jax.random`` noise (the comparison point)."""
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counters)
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (logits.shape[-1],), jnp.float32))(keys)
    noisy = jnp.where((temperature > 0)[:, None], scaled + gumbel, logits)
    return jnp.argmax(noisy, axis=-1).astype(jnp.int32)


def timed(fn, args, reps: int, inner: int = 10) -> float:
    """Median seconds per call over ``reps`` groups of ``inner`` back-to-back calls."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready([fn(*args) for _ in range(inner)])
        times.append((time.perf_counter() - t) / inner)
    return float(np.median(times))


def frequencies(n: int, vocab: int, variants: dict, temperature: float = 0.6, top: int = 50) -> dict:
    """One row of logits sampled ``n`` times (seeds ``0..n-1``): total variation distance between each
    sampler's token frequencies and ``softmax(logits / T)``, over the ``top`` likeliest tokens plus
    one bucket for the rest."""
    row = jax.random.normal(jax.random.key(7), (vocab,), jnp.float32) * 3
    p = np.asarray(jax.nn.softmax(row / temperature), np.float64)
    order = np.argsort(-p)[:top]
    want = np.append(p[order], 1.0 - p[order].sum())
    out = dict(frequency_rows=n, temperature=temperature, top=top, top_mass=float(want[:-1].sum()),
               tv_noise_level=float(np.sqrt(top / n) / 2))
    args = (jnp.tile(row[None], (n, 1)), jnp.full((n,), temperature, jnp.float32),
            jnp.arange(n, dtype=jnp.uint32), jnp.zeros((n,), jnp.int32))
    picked = {}
    for name in ("sample (kernel)", "sample (XLA)", "sample (threefry)"):
        toks = picked[name] = np.asarray(variants[name](*args))
        counts = np.bincount(toks, minlength=vocab).astype(np.float64)
        got = np.append(counts[order], n - counts[order].sum()) / n
        out[f"tv {name}"] = float(np.abs(got - want).sum() / 2)
    out["kernel_equals_xla_rows"] = int((picked["sample (kernel)"] == picked["sample (XLA)"]).sum())
    print(f"frequencies, one row x {n}, T={temperature}, top {top} tokens ({out['top_mass']:.3f} of the mass) + rest: "
          + ", ".join(f"{k} {v:.4f}" for k, v in out.items() if k.startswith("tv "))
          + f"; rows where kernel = XLA: {out['kernel_equals_xla_rows']}/{n}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--frequency-rows", type=int, default=32768, help="0: skip the frequency check")
    ap.add_argument("--configs", default="", help="also time the kernel alone at these launch configurations, "
                    "comma list of block:steps:warps:stages (e.g. 4096:4:4:2); their tokens must equal the "
                    "default configuration's")
    args = ap.parse_args(argv)
    rows = []
    configs = {c: SamplerConfig(*(int(v) for v in c.split(":"))) for c in args.configs.split(",") if c}
    variants = {
        "argmax only": jax.jit(lambda l, t, s, c: jnp.argmax(l, axis=-1).astype(jnp.int32)),
        "sample (kernel)": jax.jit(lambda l, t, s, c: sample(l, t, jnp.full_like(s, -1, jnp.int32),
                                                             jnp.ones_like(t), s, c, mode="random",
                                                             argmax_kernel=True)),
        "sample (XLA)": jax.jit(lambda l, t, s, c: sample(l, t, jnp.full_like(s, -1, jnp.int32),
                                                          jnp.ones_like(t), s, c, mode="random",
                                                          argmax_kernel=False)),
        "sample (threefry)": jax.jit(sample_threefry),
    }
    print(f"{'batch':>5} {'temperature':>11} {'variant':18} {'us':>8} {'GB/s of logits':>15}", flush=True)
    for b in [int(x) for x in args.batches.split(",")]:
        logits = jax.random.normal(jax.random.key(b), (b, args.vocab), jnp.float32) * 3
        seeds = jnp.arange(b, dtype=jnp.uint32) * 7919
        counters = jnp.arange(b, dtype=jnp.int32)
        for temp in (0.6, 0.0):
            t = jnp.full((b,), temp, jnp.float32)
            best = np.asarray(jnp.argmax(logits, axis=-1))
            picked = {}
            for name, fn in variants.items():
                toks = picked[name] = np.asarray(fn(logits, t, seeds, counters))
                sec = timed(fn, (logits, t, seeds, counters), args.reps)
                # At temperature 0 every variant must pick the argmax; at 0.6 the samplers must not.
                rows.append(dict(batch=b, temperature=temp, variant=name, us=sec * 1e6,
                                 GBps=logits.nbytes / sec / 1e9,
                                 argmax_rows=int((toks == best).sum())))
                print(f"{b:5d} {temp:11.1f} {name:18} {sec * 1e6:8.1f} {logits.nbytes / sec / 1e9:15.0f}",
                      flush=True)
            inv = jnp.where(t > 0, 1.0 / jnp.where(t > 0, t, 1.0), 0.0)
            for name, cfg in configs.items():
                fn = jax.jit(functools.partial(gumbel_argmax, config=cfg, interpret=jax.default_backend() == "cpu"))
                toks = np.asarray(fn(logits, inv, seeds, counters))
                sec = timed(fn, (logits, inv, seeds, counters), args.reps)
                same = int((toks == picked["sample (kernel)"]).sum())
                rows.append(dict(batch=b, temperature=temp, variant=f"kernel {name}", us=sec * 1e6,
                                 GBps=logits.nbytes / sec / 1e9, equal_to_default_rows=same))
                print(f"{b:5d} {temp:11.1f} {'kernel ' + name:18} {sec * 1e6:8.1f} "
                      f"{logits.nbytes / sec / 1e9:15.0f}  same tokens {same}/{b}", flush=True)
            same = int((picked["sample (kernel)"] == picked["sample (XLA)"]).sum())
            rows.append(dict(batch=b, temperature=temp, kernel_equals_xla_rows=same))
            print(f"      rows where the kernel and XLA's path pick the same token: {same}/{b}", flush=True)
    if args.frequency_rows:
        rows.append(frequencies(args.frequency_rows, args.vocab, variants))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sampler.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return dict(rows=rows)


if __name__ == "__main__":
    main()
