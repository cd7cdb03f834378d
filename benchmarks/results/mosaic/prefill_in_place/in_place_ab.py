"""The prefill launch reading and writing in place (the checkout's kernel) against the kernel before
it, which laid the queries out in tiles and gathered the outputs back with XLA, and cuDNN; one process.
Chained wall time, GPU busy time (the profiler's sum over the launch's kernels; it also counts a
memcpy of the trace at times) and the attention kernel's own time. Make the earlier kernel first:

    git show a1feab8:kernels/paged_attention_mgpu_prefill.py > benchmarks/results/mosaic/prefill_in_place/prefill_before.py
    python3 benchmarks/results/mosaic/prefill_in_place/in_place_ab.py [case,...]   # of CASES; default 2k-16k, ragged
"""
import sys, warnings
sys.path[:0] = ["benchmarks", "tools", "benchmarks/results/mosaic", "benchmarks/results/mosaic/prefill_in_place"]
warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from decode_profile import traced
from bench_attention import chain_time, timed, _chain_simple, random_paged_batch
import prefill_before
from jaxpaged.kernels import paged_attention_mgpu_prefill as after
from jaxpaged.kernels.paged_attention_mgpu import prefill_kv_tile

HQ, HKV, D, BS = 16, 8, 128, 16
rows = []
CASES = {"1k": ([1024], [0]), "2k": ([2048], [0]), "4k": ([4096], [0]), "8k": ([8192], [0]), "16k": ([16384], [0]),
         "ragged": ([1000, 37, 3000, 513, 1], [0, 500, 1024, 0, 77]),
         "64x100": ([100] * 64, [100] * 64), "64x100+300": ([100] * 64, [400] * 64),
         # a mixed step: 64 decode rows of 1,024 tokens of context and a 2,048-token chunk
         "mixed": ([1] * 64 + [2048], [1024] * 64 + [2048])}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["2k", "4k", "8k", "16k", "ragged"]
cases = [(n, *CASES[n]) for n in names]
for name, qls, pres in cases:
    T = sum(qls)  # padding tokens after them, a multiple of 8 in all
    q, pool, cu, kl, table = random_paged_batch(qls, pres, HQ, HKV, D, BS, -(-T // 8) * 8 + 8)
    kw = dict(scale=D ** -0.5, interpret=None, block_kv=prefill_kv_tile(BS), num_slots=2)
    res = {}
    for vname, mod in (("before", prefill_before), ("after", after)):
        fn = lambda qq, cs, tb, mod=mod: mod.paged_prefill_mgpu(qq, cs[0], jnp.int32(0), cs[1], cs[2], tb, **kw)
        out = jax.block_until_ready(fn(q, (pool, cu, kl), table))
        _, t = chain_time(fn, q, (pool, cu, kl), [table], 10, 8)
        jf = jax.jit(fn)  # the pool an argument: closed over, it would be a constant of the program (2 GB and more)
        f = lambda qq, jf=jf: jf(qq, (pool, cu, kl), table)
        tot, cnt, _ = traced(f, q, 20)
        res[vname] = (out, t * 1e6, sum(tot.values()), max(tot.values()))
        print(f"== {name} {vname}: chained {t*1e6:.1f} us, busy {sum(tot.values()):.1f}, kernel {max(tot.values()):.1f}", flush=True)
        for k, v in tot.most_common(6):
            print(f"   {v:8.2f} us x{cnt[k]:.1f} {k[:90]}", flush=True)
    diff = float(jnp.max(jnp.abs(res["before"][0].astype(jnp.float32) - res["after"][0].astype(jnp.float32))))
    tc = float("nan")
    if len(qls) == 1:
        pos = jnp.arange(T); blk = table[0, pos // BS]
        kc, vc = pool[0, blk, pos % BS, 0][None], pool[0, blk, pos % BS, 1][None]
        fc = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True, implementation="cudnn")
        _, tc = timed(lambda qq, kc, vc: _chain_simple(fc, qq, kc, vc, 8), (q[None, :T], kc, vc), 10)
        tc = tc / 8 * 1e6
    print(f"-- {name}: max |after - before| {diff}; cudnn chained {tc:.1f}", flush=True)
    rows.append((name, res["before"][1:], res["after"][1:], tc, diff))
    del pool
print("\n| case | before chained / busy / kernel | after chained / busy / kernel | after/before chained | cudnn chained | before/cudnn | after/cudnn | max diff |")
for name, b, a, tc, diff in rows:
    print(f"| {name} | {b[0]:.1f} / {b[1]:.1f} / {b[2]:.1f} | {a[0]:.1f} / {a[1]:.1f} / {a[2]:.1f} | {a[0]/b[0]:.3f} | {tc:.1f} | {b[0]/tc:.3f} | {a[0]/tc:.3f} | {diff} |")
