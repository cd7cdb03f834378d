"""The fixed cost of one Pallas kernel launch on each GPU backend, and of a launch's idle programs.

A jit chains ``N`` launches of a kernel that adds one to ``f32[64, 128]`` (each launch reads the last
one's output), so the chain's time over ``N`` is one launch as a step of many kernels pays it (launch,
prologue, epilogue, the tail before the next). Variants:

* ``grid 1x1``: the whole array through one program (Mosaic GPU: TMA copies in and out of shared
  memory; Triton: loads and stores).
* ``grid HxP, smem S``: a grid like the attention kernels' short launches (``kv_head x tile``), where
  one program does the work and the others exit at once, each program holding ``S`` KiB of shared
  memory (the tile kernel holds about 80-120 KiB: one or two programs an SM).

Mosaic GPU vs Pallas-Triton in one process; the GPU time of each chain comes from the wall time of
many repetitions (median, and the minimum).

    python benchmarks/results/mosaic/launch_floor/launch_floor.py [N]
"""
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

warnings.filterwarnings("ignore", category=DeprecationWarning)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 50
GPU = jax.default_backend() == "gpu"
SHAPE = (64, 128)


def mosaic_grid(heads: int, programs: int, smem_kib: int):
    """One program (0, 0) copies x in by TMA, adds one, copies it out; the rest exit. Each holds
    ``smem_kib`` KiB of shared memory (x's tile and padding)."""
    pad = max(0, smem_kib * 1024 - SHAPE[0] * SHAPE[1] * 4) // 4

    def body(x_ref, o_ref, x_smem, pad_smem, bar):
        first = jnp.logical_and(lax.axis_index("h") == 0, lax.axis_index("p") == 0)

        @pl.when(first)
        def _():
            plgpu.copy_gmem_to_smem(x_ref, x_smem, bar.at[0])
            plgpu.barrier_wait(bar.at[0])
            x_smem[...] = x_smem[...] + 1.0
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_smem, o_ref)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = [plgpu.SMEM(SHAPE, jnp.float32), plgpu.SMEM((max(pad, 32),), jnp.float32),
               plgpu.Barrier(num_arrivals=1, num_barriers=1)]
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(SHAPE, jnp.float32), scratch_types=scratch,
                        grid=(heads, programs), grid_names=("h", "p"),
                        interpret=None if GPU else plgpu.InterpretGPUParams(),
                        kernel_name=f"add_one_mosaic_{heads}x{programs}_{smem_kib}k")


def triton_grid(heads: int, programs: int, smem_kib: int):
    """Program 0 of ``heads * programs`` adds one; the rest exit (Triton sizes shared memory itself:
    ``smem_kib`` is ignored)."""
    def body(x_ref, o_ref):
        @pl.when(pl.program_id(0) == 0)
        def _():
            o_ref[...] = x_ref[...] + 1.0

    spec = pl.BlockSpec(SHAPE, lambda i: (0, 0))
    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(SHAPE, jnp.float32), grid=(heads * programs,),
                          in_specs=[spec], out_specs=spec, compiler_params=pltriton.CompilerParams(num_warps=4),
                          interpret=None if GPU else True, name=f"add_one_triton_{heads}x{programs}")


def time_chain(kernel, reps: int = 30):
    @jax.jit
    def run(x):
        for _ in range(N):
            x = kernel(x)
        return x

    x = jnp.zeros(SHAPE, jnp.float32)
    out = jax.block_until_ready(run(x))
    assert float(out[0, 0]) == N and float(out[-1, -1]) == N, (out[0, 0], out[-1, -1])
    times = []
    for _ in range(reps if GPU else 1):
        t = time.perf_counter()
        jax.block_until_ready(run(x))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6 / N, min(times) * 1e6 / N


CASES = []
for heads, programs, kib in ((1, 1, 16), (8, 2, 100), (8, 33, 16), (8, 33, 100), (8, 33, 200), (8, 264, 100)):
    name = f"grid {heads}x{programs}, smem {kib} KiB"
    CASES.append((name, "mosaic", lambda h=heads, p=programs, k=kib: mosaic_grid(h, p, k)))
    if kib == 100 or programs == 1:
        CASES.append((name, "triton", lambda h=heads, p=programs, k=kib: triton_grid(h, p, k)))

rows = []
for rounds in range(2 if GPU else 1):
    for name, backend, make in CASES:
        med, lo = time_chain(make())
        rows.append((rounds, name, backend, med, lo))
        print(f"round {rounds} {name:28} {backend:7} {med:8.2f} {lo:8.2f}", flush=True)
print(f"\n{N} chained launches of a kernel adding one to f32[64, 128], {jax.devices()[0].device_kind}, "
      f"jax {jax.__version__}")
print("| launch | backend | us/launch (median), rounds | us/launch (min) |")
print("| --- | --- | --- | --- |")
for name, backend, _ in CASES:
    mine = [r for r in rows if r[1] == name and r[2] == backend]
    print(f"| {name} | {backend} | {' / '.join(f'{r[3]:.2f}' for r in mine)} | {min(r[4] for r in mine):.2f} |")
