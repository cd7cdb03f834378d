"""Decode tuning sweep of the Mosaic kernel at the shapes short of the targets: split-K factor x K/V
slots x KV tile against the Triton kernel; chained wall time (``bench_attention.chain_time``), each
variant's max abs error against the Triton kernel's output, the read ceiling measured first.

    python benchmarks/results/mosaic/decode_token_order/tuning_sweep.py          # the grid
    python benchmarks/results/mosaic/decode_token_order/tuning_sweep.py slots    # one slot vs two
"""
import itertools
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_attention import chain_time, hbm_read_ceiling  # noqa: E402
from jaxpaged.kernels.paged_attention import paged_attention  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import choose_splits, kv_tile, paged_attention_mgpu  # noqa: E402

HQ, HKV, D, BS = 16, 8, 128, 16
if sys.argv[1:] == ["slots"]:
    SHAPES = [(64, 1024), (64, 256), (256, 256), (256, 1024), (64, 4096), (8, 4096), (1, 1024)]
    VARIANTS = [(1, 1, 64), (1, 2, 64), (2, 1, 64), (4, 1, 64), (1, 1, 128), (4, 2, 64), (16, 1, 64), (16, 2, 64)]
else:
    SHAPES = [(64, 1024), (64, 256), (256, 256), (8, 4096)]
    VARIANTS = list(itertools.product((1, 2, 4), (2, 3, 4), (64, 128)))

ceil = hbm_read_ceiling(False)
print(f"ceiling {ceil / 1e12:.2f} TB/s", flush=True)
pool_blocks = max(b * c for b, c in SHAPES) // BS + 1024
pool = jax.random.normal(jax.random.key(7), (1, pool_blocks, BS, 2, HKV, D), jnp.bfloat16)
rows = []
for b, ctx in SHAPES:
    nb = ctx // BS
    kv_bytes = b * ctx * HKV * D * 4
    rot = max(1, min(8, pool_blocks // (b * nb), math.ceil(256e6 / kv_bytes)))
    perm = np.random.default_rng(b + ctx).permutation(pool_blocks)
    tables = [jnp.asarray(perm[r * b * nb:(r + 1) * b * nb].reshape(b, nb).astype(np.int32)) for r in range(rot)]
    q = jax.random.normal(jax.random.key(b + ctx), (b, HQ, D), jnp.bfloat16)
    cu = jnp.arange(b + 1, dtype=jnp.int32)
    kl = jnp.full((b,), ctx, jnp.int32)
    default = choose_splits(b, b, HKV, kv_tile(BS), nb * BS, decode=True)
    variants = {"triton": paged_attention}
    for sp, sl, bk in VARIANTS:
        variants[f"s{sp}_slots{sl}_kv{bk}"] = (lambda *a, sp=sp, sl=sl, bk=bk:
                                               paged_attention_mgpu(*a, num_splits=sp, num_slots=sl, block_kv=bk))
    ref = None
    for name, fn in variants.items():
        try:
            out = np.asarray(fn(q, pool, 0, cu, kl, tables[0]), np.float32)
            ref = out if ref is None else ref
            err = float(np.abs(out - ref).max())
            _, t = chain_time(lambda qq, cs, tb, fn=fn: fn(qq, cs[0], 0, cs[1], cs[2], tb), q, (pool, cu, kl),
                              tables, 5, 8)
            rows.append((b, ctx, name, t * 1e6, kv_bytes / t / ceil, err))
            print(f"B={b} ctx={ctx} default_splits={default} {name:22s} {t * 1e6:8.1f} us "
                  f"{100 * kv_bytes / t / ceil:5.1f}% err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"B={b} ctx={ctx} {name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
print("\n=== best per shape ===")
for b, ctx in SHAPES:
    rr = sorted([r for r in rows if r[:2] == (b, ctx)], key=lambda r: r[3])
    tri = [r for r in rr if r[2] == "triton"]
    print(b, ctx, "triton", tri and round(tri[0][3], 1), "best:",
          [(r[2], round(r[3], 1), f"{100 * r[4]:.0f}%") for r in rr[:4]])
