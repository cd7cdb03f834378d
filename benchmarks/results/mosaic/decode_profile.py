"""Where a decode launch's time goes, Mosaic vs Triton: batch x context (block 16, Hq 16 / Hkv 8 / D 128).

Each configuration: jit one attention call, warm it, time 200 calls chained through their outputs
("wall", one launch a jit), the same with 8 launches a jit (``bench_attention.chain_time``, as the
decode sweep of ``check_attention_mgpu.py`` times it: "chain8"), then trace 50 calls and sum the GPU
kernels' time by name per launch ("busy": every kernel of the launch; "attn": the attention kernel
alone). The read ceiling is measured in the same process twice: XLA's sum over 4 GiB (the sweep's
ceiling), and XLA's sum over as many bytes as the launch reads (its GPU time from the trace, as the
kernel's): the time any single kernel reading those bytes takes. Run from the repository root:

    python3 benchmarks/results/mosaic/decode_profile.py [--batches 1,8,64] [--ctxs 256,1024]
"""
import argparse
import collections
import sys
import tempfile
import time
import warnings

sys.path[:0] = ["benchmarks", "tools"]
warnings.filterwarnings("ignore")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import chain_time, hbm_read_ceiling  # noqa: E402
from profile_step import find_trace_file, load_trace, normalise_kernel_name  # noqa: E402

from jaxpaged.kernels.kv_write import pool_from_caches  # noqa: E402
from jaxpaged.kernels.paged_attention import paged_attention  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

HQ, HKV, D, BS = 16, 8, 128, 16
N = 50


def traced(step, x, n: int):
    """Runs ``x = step(x)`` n times under the profiler; returns ({kernel: us per call}, {kernel: count per
    call}, the last x)."""
    d = tempfile.mkdtemp()
    jax.profiler.start_trace(d)
    for _ in range(n):
        x = step(x)
    jax.block_until_ready(x)
    jax.profiler.stop_trace()
    ev = load_trace(find_trace_file(d))
    pids = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = [e for e in ev if e.get("ph") == "X" and "/device:GPU:0" in pids.get(e.get("pid"), "")]
    tot, cnt = collections.Counter(), collections.Counter()
    for e in gpu:
        tot[normalise_kernel_name(e["name"])] += e["dur"] / n
        cnt[normalise_kernel_name(e["name"])] += 1 / n
    return tot, cnt, x


def decode_batch(b: int, ctx: int):
    """``b`` sequences of one new token at context ``ctx``: random bf16 K/V in a one-layer pool (16 spare
    blocks), the blocks in random order; seeded by ``b * ctx``. Returns ``(q, pool, cu_q_lens, kv_lens,
    block_tables)``."""
    nb = ctx // BS
    kk, kv_, kq = jax.random.split(jax.random.key(b * ctx), 3)
    blocks = b * nb + 16
    pool = pool_from_caches(jax.random.normal(kk, (blocks, BS, HKV, D), jnp.bfloat16),
                            jax.random.normal(kv_, (blocks, BS, HKV, D), jnp.bfloat16))
    table = jnp.asarray(np.random.default_rng(0).permutation(blocks)[:b * nb].reshape(b, nb).astype(np.int32))
    q = jax.random.normal(kq, (b, HQ, D), jnp.bfloat16)
    return q, pool, jnp.arange(b + 1, dtype=jnp.int32), jnp.full((b,), ctx, jnp.int32), table


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ctxs", default="256,1024")
    args = ap.parse_args(argv)
    ceiling = hbm_read_ceiling(False)
    print(f"read ceiling (XLA sum over 4 GiB) {ceiling / 1e12:.2f} TB/s", flush=True)
    summary = []
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.ctxs.split(",")):
            kv_bytes = b * ctx * HKV * D * 2 * 2
            kk = jax.random.split(jax.random.key(b * ctx), 3)[0]
            q, pool, cu, kl, table = decode_batch(b, ctx)
            flat = jax.random.normal(kk, (kv_bytes // 2,), jnp.bfloat16)  # XLA's read of the same bytes
            read = jax.jit(lambda acc, x: acc + jnp.sum(x, dtype=jnp.float32))
            tot, _, _ = traced(lambda acc: read(acc, flat), jnp.float32(0), N)
            xla_us = max(tot.values())
            del flat
            print(f"== B={b} ctx={ctx}: {kv_bytes / 1e6:.1f} MB; XLA sum over them {xla_us:.2f} us GPU time "
                  f"({kv_bytes / xla_us / 1e6:.2f} TB/s)", flush=True)
            for name, fn in (("mosaic", paged_attention_mgpu), ("triton", paged_attention)):
                f = jax.jit(lambda qq, pool, cu, kl, tb, fn=fn: fn(qq, pool, 0, cu, kl, tb))
                out = jax.block_until_ready(f(q, pool, cu, kl, table))
                for _ in range(20):
                    out = f(out, pool, cu, kl, table)
                jax.block_until_ready(out)
                t0 = time.perf_counter()
                for _ in range(200):
                    out = f(out, pool, cu, kl, table)
                jax.block_until_ready(out)
                wall = (time.perf_counter() - t0) / 200 * 1e6
                _, chain8 = chain_time(lambda qq, cs, tb, fn=fn: fn(qq, cs[0], 0, cs[1], cs[2], tb),
                                       q, (pool, cu, kl), [table], 5, 8)
                tot, cnt, out = traced(lambda x, f=f: f(x, pool, cu, kl, table), out, N)
                attn = max(tot.values())
                busy = sum(tot.values())
                print(f"-- {name}: wall {wall:.1f} us/launch, chain8 {chain8 * 1e6:.1f}, GPU busy {busy:.1f}, "
                      f"attention kernel {attn:.2f} us ({kv_bytes / attn / 1e6:.2f} TB/s, "
                      f"{100 * kv_bytes / attn * 1e6 / ceiling:.0f}% of the ceiling)", flush=True)
                for k, v in tot.most_common(6):
                    print(f"   {v:8.2f} us  x{cnt[k]:.1f}  {k[:110]}", flush=True)
                summary.append((b, ctx, name, wall, chain8 * 1e6, busy, attn, kv_bytes / attn * 1e6 / ceiling, xla_us))
            del pool
    print(f"\nread ceiling {ceiling / 1e12:.2f} TB/s; us per launch")
    print("| B | ctx | kernel | wall | chain8 | GPU busy | attention kernel | % ceiling | XLA sum, same bytes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for b, ctx, name, wall, c8, busy, attn, frac, xla_us in summary:
        print(f"| {b} | {ctx} | {name} | {wall:.1f} | {c8:.1f} | {busy:.1f} | {attn:.2f} | {100 * frac:.0f}% | {xla_us:.2f} |")


if __name__ == "__main__":
    main()
