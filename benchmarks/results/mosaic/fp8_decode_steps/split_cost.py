"""Where split-K's cost goes on a launch with little context: the query tiles (``block_q`` 32) at 1-32
splits on one 32-token chunk padded to 32 sequences (an engine's step for a lone short prompt), with
no cached prefix and after 4,096 cached tokens, and at 1 and 4 splits on a mixed step (200 decode rows
at 1,024 tokens and a 56-token chunk after 4,096: many items of unequal length, which a persistent
launch hands out in a fixed order), over fp8 (block 64) and bf16 (block 16) pools, the
block tables as wide as a 4,096-token engine's. Each variant: chained wall time (``time_variants``),
then a trace of 50 launches with the GPU time summed by kernel (the attention kernel, split-K's merge
and whatever else the launch runs). Empty splits exit before their first copy; if the kernel's time
still grows with the splits where the context is short, their cost is the programs' launch (a grid
of tiles x heads x splits, two programs an SM), not the merge.

Run from the repository root: python3 benchmarks/results/mosaic/fp8_decode_steps/split_cost.py [SPLITS
[POOLS]] (e.g. ``8,16,32 fp8,bf16``: those split counts of the lone chunk, no mixed launch)
"""
import sys
import warnings

sys.path[:0] = ["benchmarks", "benchmarks/results/mosaic", "tools"]
warnings.filterwarnings("ignore")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from bench_attention import random_paged_batch, time_variants  # noqa: E402
from decode_profile import traced  # noqa: E402

from jaxpaged.kernels.fp8 import quantize_pool  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

CONTEXT = 4096  # the engine's max_model_len: the block tables' width in tokens
SPLITS = tuple(int(n) for n in sys.argv[1].split(",")) if len(sys.argv) > 1 else (1, 4, 16, 32)
POOLS = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp8", "bf16"]
quantize = jax.jit(quantize_pool, static_argnums=1)
print(jax.devices()[0].device_kind, flush=True)
rows = []
MIXED = ([56] + [1] * 200 + [0] * 55, [4096] + [1023] * 200 + [0] * 55)  # decode rows and a chunk, 256 sequences
CASES = [(f"chunk 32+{p}", [32] + [0] * 31, [p] + [0] * 31, SPLITS) for p in (0, 4096)] + (
    [("mixed 200x1024 + 56+4096", *MIXED, (1, 4))] if len(sys.argv) == 1 else [])
for dt, bs in (("fp8", 64), ("bf16", 16)):
    if dt not in POOLS:
        continue
    for label, q_lens, prefixes, splits in CASES:
        t = max(32, sum(q_lens))
        q, pool, cu, kl, tb = random_paged_batch(q_lens, prefixes, 16, 8, 128, bs, t)
        width = -(-(CONTEXT + t) // bs)
        tb = jnp.pad(tb, ((0, 0), (0, width - tb.shape[1])))
        if dt == "fp8":
            pool = quantize(pool, jnp.float8_e4m3fn)
        fns = {f"s{n}": (lambda *a, n=n: paged_attention_mgpu(*a, decode=True, block_q=32, num_splits=n))
               for n in splits}
        times, _ = time_variants(fns, q, pool, cu, kl, tb, reps=5, chain=8, where=f"{dt} {label}", rounds=2)
        for name, fn in fns.items():
            f = jax.jit(lambda qq, fn=fn: fn(qq, pool, 0, cu, kl, tb))
            out = jax.block_until_ready(f(q))
            tot, cnt, _ = traced(f, out, 50)
            top = tot.most_common(4)
            print(f"{dt} {label} {name}: chained {times[name]:.1f} us; GPU busy {sum(tot.values()):.1f} us:",
                  "; ".join(f"{v:.1f} x{cnt[k]:.0f} {k[:60]}" for k, v in top), flush=True)
            rows.append((dt, label, name, times[name], sum(tot.values()), top[0][1]))
print("\n| pool | launch | splits | chained us | GPU busy us | longest kernel us |")
print("| --- | --- | --- | --- | --- | --- |")
for dt, label, name, t, busy, k in rows:
    print(f"| {dt} | {label} | {name} | {t:.1f} | {busy:.1f} | {k:.1f} |")
