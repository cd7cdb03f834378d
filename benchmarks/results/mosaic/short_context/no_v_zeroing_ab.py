"""Decode at short contexts: what zeroing the stale values of the masked KV tile costs. The variant without it
(`.gpu/mgpu_nomask.py`: `cp kernels/paged_attention_mgpu.py .gpu/mgpu_nomask.py && patch -p0 .gpu/mgpu_nomask.py
benchmarks/results/mosaic/short_context/no_v_zeroing.patch`) is wrong on NaN-poisoned pools;
`random_paged_batch` has none, so its outputs must equal the default's. Chained wall time, each case twice
in alternating order. Run from the repository root: python3 benchmarks/results/mosaic/short_context/no_v_zeroing_ab.py"""
import sys, warnings, importlib.util
sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import numpy as np
from bench_attention import random_paged_batch, time_variants
from jaxpaged.kernels.paged_attention import paged_attention as triton
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu
spec = importlib.util.spec_from_file_location("mgpu_nomask", ".gpu/mgpu_nomask.py")
nm = importlib.util.module_from_spec(spec); spec.loader.exec_module(nm)
V = {"default": lambda *a: paged_attention_mgpu(*a), "no_v_zeroing": lambda *a: nm.paged_attention_mgpu(*a), "triton": lambda *a: triton(*a)}
for b, ctx in ((256, 64), (64, 64), (256, 128)):
    q, pool, cu, kl, table = random_paged_batch([1] * b, [ctx - 1] * b, 16, 8, 128, 16, b)
    f, o = time_variants(V, q, pool, cu, kl, table)
    s, _ = time_variants(dict(reversed(list(V.items()))), q, pool, cu, kl, table)
    print(f"| {b} x {ctx} | " + " | ".join(f"{k} {(f[k] + s[k]) / 2:.1f} ({f[k]:.1f}/{s[k]:.1f})" for k in V)
          + f" | equal {np.array_equal(o['default'], o['no_v_zeroing'])}", flush=True)
