"""Prefill A/B (one process, cuDNN's causal attention timed beside it): the warp-specialised kernel
before its compute warpgroups took turns on the tensor cores ("base", the kernel at 54b2272) against
the kernel with the turns ("sched"; "sched_approx" is the engine's kernel as it is, with its persistent
launch; "turns_approx" the same kernel with a program an item, as at 62bfb36), with and without
the approximate exp2 (``approx_math``), and with 240/24 registers for the compute/memory warpgroups
instead of 232/40; also FA3's intra-warpgroup overlap ("ov", see intra_wg_overlap.py), and "ahead": a turn
issues ``P V`` of tile t and ``Q K^T`` of tile t+1 back to back (``pv_qk_back_to_back.patch``). Each variant is timed twice,
interleaved; the table gives the better of the two, and the max abs error against cuDNN. Causal, one
sequence, Hq 16 / Hkv 8 / D 128, bf16, pool blocks of 16 tokens in random order, NaN in unused blocks.

The logged runs (H100, 2026-12-05) also tried jax's own ``attention_mgpu`` as a peer: it takes float16
inputs only and failed on these bf16 ones ("FAIL jax_fa3"); this script leaves it out.

From the repository root, on a Hopper GPU:
  git show 54b2272:kernels/paged_attention_mgpu_prefill.py > benchmarks/results/mosaic/prefill_schedule/base_kernel.py
  git show 62bfb36:kernels/paged_attention_mgpu_prefill.py > benchmarks/results/mosaic/prefill_schedule/turns_kernel.py
  (for the overlap variants, intra_wg_overlap_kernel.py as intra_wg_overlap.py says; for "ahead":
  git show cccdf05:kernels/paged_attention_mgpu_prefill.py > benchmarks/results/mosaic/prefill_schedule/pv_qk_back_to_back_kernel.py
  and patch that file with pv_qk_back_to_back.patch)
  python3 benchmarks/results/mosaic/prefill_schedule/turns_ab.py [TOKENS,...] [VARIANT,...]
"""
import importlib
import sys
import warnings

sys.path.insert(0, "benchmarks")
sys.path.insert(0, "benchmarks/results/mosaic/prefill_schedule")
warnings.filterwarnings("ignore")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

from bench_attention import _chain_simple, chain_time, timed  # noqa: E402
import jaxpaged.kernels.paged_attention_mgpu_prefill as turns_mod  # noqa: E402

HQ, HKV, D, BS = 16, 8, 128, 16
SIZES = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "2048,4096,8192,16384").split(",")]
VARIANTS = {  # name (as in the logs): (module, compute registers, memory registers, approx_math)
    "base": ("base_kernel", 232, 40, False),
    "base_240": ("base_kernel", 240, 24, False),
    "base_approx": ("base_kernel", 232, 40, True),
    "ov": ("intra_wg_overlap_kernel", 232, 40, False),
    "ov_240": ("intra_wg_overlap_kernel", 240, 24, False),
    "ov_240_approx": ("intra_wg_overlap_kernel", 240, 24, True),
    "sched": (turns_mod, 232, 40, False),
    "sched_approx": (turns_mod, 232, 40, True),  # the engine's kernel as it is
    "sched_240": (turns_mod, 240, 24, False),
    "turns_approx": ("turns_kernel", 232, 40, True),  # the kernel at 62bfb36 (one program a work item)
    "ahead": ("pv_qk_back_to_back_kernel", 232, 40, True),
    "ahead_240": ("pv_qk_back_to_back_kernel", 240, 24, True),
}
if len(sys.argv) > 2:
    VARIANTS = {k: VARIANTS[k] for k in sys.argv[2].split(",")}
KERNEL = plgpu.kernel


def variant(mod, compute_regs, memory_regs, approx):
    """The variant's prefill call; the jit caches are cleared, since the choices are read at trace time."""
    mod = importlib.import_module(mod) if isinstance(mod, str) else mod
    jax.clear_caches()
    mod.COMPUTE_REGISTERS, mod.MEMORY_REGISTERS = compute_regs, memory_regs
    params = plgpu.CompilerParams(approx_math=approx)
    plgpu.kernel = lambda *a, compiler_params=None, **k: KERNEL(*a, compiler_params=params, **k)
    return lambda q, pool, cu, kl, bt: mod.paged_prefill_mgpu(q, pool, jnp.int32(0), cu, kl, bt, scale=D ** -0.5,
                                                             interpret=None, block_kv=128, num_slots=2)


def main():
    rows = []
    for T in SIZES:
        kq, kk, kv = jax.random.split(jax.random.key(T), 3)
        q = jax.random.normal(kq, (1, T, HQ, D), jnp.bfloat16)
        k = jax.random.normal(kk, (1, T, HKV, D), jnp.bfloat16)
        v = jax.random.normal(kv, (1, T, HKV, D), jnp.bfloat16)
        cudnn = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True, implementation="cudnn")
        ref = cudnn(q, k, v)
        _, t = timed(lambda qq, kc, vc: _chain_simple(cudnn, qq, kc, vc, 8), (q, k, v), 5)
        r = {"T": T, "cudnn": t / 8 * 1e6}
        nb = T // BS
        pool = jnp.full((1, nb + 8, BS, 2, HKV, D), jnp.nan, jnp.bfloat16)
        perm = np.random.default_rng(T).permutation(nb + 8)[:nb].astype(np.int32)
        pool = pool.at[0, perm].set(jnp.stack([k[0].reshape(nb, BS, HKV, D), v[0].reshape(nb, BS, HKV, D)], axis=2))
        table = jnp.asarray(perm.reshape(1, nb))
        cu, kl = jnp.array([0, T], jnp.int32), jnp.array([T], jnp.int32)
        for _ in range(2):
            for name, spec in VARIANTS.items():
                f = variant(*spec)
                out = f(q[0], pool, cu, kl, table)
                r[name + "_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[0].astype(jnp.float32))))
                _, t = chain_time(lambda qq, cs, tb, f=f: f(qq, cs[0], cs[1], cs[2], tb), q[0], (pool, cu, kl),
                                  [table], 5, 8)
                r.setdefault(name, []).append(round(t * 1e6, 1))
        plgpu.kernel = KERNEL
        print("ROW", r, flush=True)
        rows.append(r)
    print("\n| tokens | cuDNN us | " + " | ".join(f"{n} us (x cuDNN)" for n in VARIANTS) + " |")
    print("| --- | --- |" + " --- |" * len(VARIANTS))
    for r in rows:
        cells = [f"{min(r[n]):.1f} ({min(r[n]) / r['cudnn']:.3f}) err {r[n + '_err']:.4f}" for n in VARIANTS]
        print(f"| {r['T']} | {r['cudnn']:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
