"""What the attention launch configuration costs when it is guessed from padded shapes (GPU).

A 256-slot engine pads every step's sequence dimension to 256, so with ``T <= 2 S`` as the test every
step of <= 512 tokens used to get the decode configuration (16-row query tiles), prefill chunks
included. The engine now tells the kernel what the step holds (``AttentionMetadata.decode``). This
times the attention of such steps (Qwen3-0.6B heads, bf16, block size 16) both ways, in one process:

* prefill chunks: 1, 2 or 4 sequences of 512 / 256 / 128 new tokens after 0-1,024 cached tokens,
  padded to 256 sequence slots and 512 tokens;
* a decode step of 256 sequences (must not change: the hint says decode there too);
* a lone prompt of 16, 32 or 64 tokens in a one-slot engine (the latency engine's TTFT step, where
  the guess picks the prefill tiles): the prefill tiles against the decode tiles, forced.

    python benchmarks/bench_launch_config.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import timed  # noqa: E402

from jaxpaged.kernels.paged_attention import paged_attention  # noqa: E402

HQ, HKV, D, BS = 16, 8, 128, 16


def case(rng, q_lens, ctx, slots, tokens, num_blocks):
    s = len(q_lens)
    kv_lens = [c + q for c, q in zip(ctx, q_lens)]
    width = min(2048 // BS, num_blocks // s)
    tables = np.zeros((slots, width), np.int32)
    tables[:s] = rng.permutation(num_blocks)[: s * width].reshape(s, width)
    cu = np.full(slots + 1, sum(q_lens), np.int32)
    cu[: s + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kl = np.zeros(slots, np.int32)
    kl[:s] = kv_lens
    q = jnp.asarray(rng.standard_normal((tokens, HQ, D)), jnp.bfloat16)
    return q, jnp.asarray(cu), jnp.asarray(kl), jnp.asarray(tables)


def both_ways(inputs, pool, hints, num_tokens: int, reps: int, interpret: bool) -> tuple[list[float], float]:
    """The attention of one case with ``paged_attention(decode=hint)`` for each of two hints: microseconds
    per call of each, and the largest difference between their outputs over the real tokens."""
    q, cu, kl, tables = inputs
    us, outs = [], []
    for hint in hints:
        fn = lambda q, pool, cu, kl, t, hint=hint: paged_attention(q, pool, 0, cu, kl, t, decode=hint,  # noqa: E731
                                                                 interpret=interpret)
        outs.append(np.asarray(jax.jit(fn)(q, pool, cu, kl, tables), np.float32)[:num_tokens])
        us.append(timed(fn, (q, pool, cu, kl, tables), reps)[1] * 1e6)
    return us, float(np.max(np.abs(outs[0] - outs[1])))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    rng = np.random.default_rng(0)
    num_blocks = 256 * 2048 // BS if not interpret else 64
    pool = jnp.asarray(rng.standard_normal((1, num_blocks, BS, 2, HKV, D)), jnp.bfloat16)  # one layer
    cases = {  # name: (q_lens, cached context per sequence, slots, padded tokens)
        "1 x 512 new, ctx 0": ([512], [0], 256, 512),
        "1 x 512 new, ctx 1024": ([512], [1024], 256, 512),
        "2 x 256 new, ctx 512": ([256, 256], [512, 512], 256, 512),
        "4 x 128 new, ctx 0": ([128] * 4, [0] * 4, 256, 512),
        "decode 256 x ctx 350": ([1] * 256, [349] * 256, 256, 256),
    }
    if interpret:  # CPU smoke: tiny versions, no timing claims
        cases = {"1 x 32 new, ctx 16": ([32], [16], 16, 32), "decode 8": ([1] * 8, [20] * 8, 16, 16)}
    rows = []
    for name, (q_lens, ctx, slots, tokens) in cases.items():
        real_decode = sum(q_lens) <= 2 * len(q_lens)
        (guess, hint), err = both_ways(case(rng, q_lens, ctx, slots, tokens, num_blocks), pool, (None, real_decode),
                                       sum(q_lens), 3 if interpret else args.reps, interpret)
        rows.append(dict(case=name, guess_us=guess, hint_us=hint, speedup=guess / hint, max_abs_diff=err))
    # A lone short prompt (TTFT): one slot, so the padded guess always picks the prefill tiles
    # (T > 2 S); would the decode tiles (more, smaller programs) be faster for it?
    small = {f"lone {n}-token prompt": ([n], [0], 1, n) for n in (16, 32, 64)}
    if interpret:
        small = {"lone 16-token prompt": ([16], [0], 1, 16)}
    tiles = []
    for name, (q_lens, ctx, slots, tokens) in small.items():
        (prefill, decode), err = both_ways(case(rng, q_lens, ctx, slots, tokens, num_blocks), pool, (False, True),
                                           sum(q_lens), 3 if interpret else args.reps, interpret)
        tiles.append(dict(case=name, prefill_tiles_us=prefill, decode_tiles_us=decode, speedup=prefill / decode,
                          max_abs_diff=err))
    report = dict(device=str(jax.devices()[0]), rows=rows, small_prefill=tiles)
    with open(os.path.join(args.out, "launch_config.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"{'case':26s} {'padded guess us':>16s} {'step holds us':>14s} {'speed-up':>9s} {'max |diff|':>10s}")
    for r in rows:
        print(f"{r['case']:26s} {r['guess_us']:16.1f} {r['hint_us']:14.1f} {r['speedup']:9.2f} {r['max_abs_diff']:10.2e}")
    print(f"{'case':26s} {'prefill tiles us':>16s} {'decode tiles us':>15s} {'speed-up':>9s} {'max |diff|':>10s}")
    for r in tiles:
        print(f"{r['case']:26s} {r['prefill_tiles_us']:16.1f} {r['decode_tiles_us']:15.1f} {r['speedup']:9.2f} "
              f"{r['max_abs_diff']:10.2e}")
    return report


if __name__ == "__main__":
    main()
