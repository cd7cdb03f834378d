"""The sampler alone on the GPU: a batch of ``[B, 151,936]`` float32 logits to one token per row.

Compares the engine's sampler (``sampling.sample``, random mode, Gumbel noise from the counter-based
hash ``sampling.gumbel_noise``) with the same sampler drawing its noise from ``jax.random`` (threefry,
``fold_in(key(seed), counter)`` per row: the sampler before session 6) and with a bare argmax (the
floor: one read of the logits). Rows sample at temperature 0.6 or are greedy (temperature 0).

    python3 -m pip install -q --no-deps --no-build-isolation -e . && \
        PYTHONUNBUFFERED=1 python3 benchmarks/bench_sampler.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling import sample

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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=VOCAB)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    rows = []
    variants = {
        "argmax only": jax.jit(lambda l, t, s, c: jnp.argmax(l, axis=-1).astype(jnp.int32)),
        "sample (hash)": jax.jit(lambda l, t, s, c: sample(l, t, jnp.full_like(s, -1, jnp.int32),
                                                           jnp.ones_like(t), s, c, mode="random")),
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
            for name, fn in variants.items():
                toks = np.asarray(fn(logits, t, seeds, counters))
                sec = timed(fn, (logits, t, seeds, counters), args.reps)
                # At temperature 0 every variant must pick the argmax; at 0.6 the samplers must not.
                rows.append(dict(batch=b, temperature=temp, variant=name, us=sec * 1e6,
                                 GBps=logits.nbytes / sec / 1e9,
                                 argmax_rows=int((toks == best).sum())))
                print(f"{b:5d} {temp:11.1f} {name:18} {sec * 1e6:8.1f} {logits.nbytes / sec / 1e9:15.0f}",
                      flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sampler.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return dict(rows=rows)


if __name__ == "__main__":
    main()
