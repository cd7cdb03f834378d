"""The fixed cost of one Pallas kernel launch on each GPU backend: a jit chains ``N`` launches of a
kernel that adds one to a small ``f32[64, 128]`` array (each launch reads the last one's output), so
the step's time over ``N`` is one launch's latency as a step of many kernels pays it (launch, the
kernel's prologue and epilogue, the tail before the next). Mosaic GPU vs Pallas-Triton in one process.

    python benchmarks/results/mosaic/launch_floor/launch_floor.py [N]
"""
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

warnings.filterwarnings("ignore", category=DeprecationWarning)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 100
INTERPRET = jax.default_backend() != "gpu"


def add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0


def call(backend: str):
    params = plgpu.CompilerParams() if backend == "mosaic_gpu" else pltriton.CompilerParams(num_warps=4)
    return pl.pallas_call(add_one, out_shape=jax.ShapeDtypeStruct((64, 128), jnp.float32), compiler_params=params,
                          interpret=INTERPRET, name=f"add_one_{backend}")


def chained(backend: str):
    kernel = call(backend)

    @jax.jit
    def run(x):
        for _ in range(N):
            x = kernel(x)
        return x

    return run


rows = []
for backend in ("mosaic_gpu", "triton"):
    run = chained(backend)
    x = jnp.zeros((64, 128), jnp.float32)
    out = jax.block_until_ready(run(x))
    assert float(out[0, 0]) == N, out[0, 0]
    times = []
    for _ in range(30):
        t = time.perf_counter()
        jax.block_until_ready(run(x))
        times.append(time.perf_counter() - t)
    rows.append((backend, statistics.median(times) * 1e6 / N, min(times) * 1e6 / N))
print(f"{N} chained launches of a kernel adding one to f32[64, 128], {jax.devices()[0].device_kind}")
print("backend      us/launch (median)  us/launch (min)")
for backend, med, lo in rows:
    print(f"{backend:12} {med:18.2f} {lo:16.2f}")
