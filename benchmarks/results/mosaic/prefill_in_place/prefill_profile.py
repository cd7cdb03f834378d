"""Where a prefill launch's GPU time goes: the Mosaic kernel against the XLA kernels around it, and
cuDNN's (one sequence, Hq 16 / Hkv 8 / D 128, pool blocks of 16 and 64). Run from the repository root:

    python3 benchmarks/results/mosaic/prefill_in_place/prefill_profile.py
"""
import sys, time, warnings
sys.path[:0] = ["benchmarks", "tools", "benchmarks/results/mosaic"]
warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from decode_profile import traced
from bench_attention import chain_time, timed, _chain_simple
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu

HQ, HKV, D = 16, 8, 128
rows = []
for bs in (16, 64):
    for T in (2048, 4096, 8192, 16384):
        if bs == 64 and T < 8192:
            continue
        nb = T // bs
        blocks = nb + 64
        kq, kp = jax.random.split(jax.random.key(T))
        pool = jax.random.normal(kp, (1, blocks, bs, 2, HKV, D), jnp.bfloat16)
        table = jnp.asarray(np.random.default_rng(T).permutation(blocks)[:nb].reshape(1, nb).astype(np.int32))
        q = jax.random.normal(kq, (T, HQ, D), jnp.bfloat16)
        cu = jnp.array([0, T], jnp.int32); kl = jnp.array([T], jnp.int32)
        f = jax.jit(lambda qq: paged_attention_mgpu(qq, pool, 0, cu, kl, table))
        out = jax.block_until_ready(f(q))
        _, t = chain_time(lambda qq, cs, tb: paged_attention_mgpu(qq, cs[0], 0, cs[1], cs[2], tb), q, (pool, cu, kl), [table], 10, 8)
        tot, cnt, _ = traced(f, q, 20)
        attn = max(tot.values()); busy = sum(tot.values())
        print(f"== T={T} bs={bs} mosaic chained {t*1e6:.1f} us; GPU busy {busy:.1f}, kernel {attn:.1f}", flush=True)
        for k, v in tot.most_common(8):
            print(f"   {v:8.2f} us x{cnt[k]:.1f} {k[:100]}", flush=True)
        pos = jnp.arange(T); blk = table[0, pos // bs]
        kc, vc = pool[0, blk, pos % bs, 0][None], pool[0, blk, pos % bs, 1][None]
        fc = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True, implementation="cudnn")
        _, tc = timed(lambda qq, kc, vc: _chain_simple(fc, qq, kc, vc, 8), (q[None], kc, vc), 10)
        tc /= 8
        g = jax.jit(lambda qq: fc(qq, kc, vc))
        ctot, ccnt, _ = traced(g, q[None], 20)
        cattn = max(ctot.values()); cbusy = sum(ctot.values())
        print(f"-- cudnn chained {tc*1e6:.1f} us; GPU busy {cbusy:.1f}, kernel {cattn:.1f}", flush=True)
        for k, v in ctot.most_common(4):
            print(f"   {v:8.2f} us x{ccnt[k]:.1f} {k[:100]}", flush=True)
        rows.append((T, bs, t * 1e6, busy, attn, tc * 1e6, cbusy, cattn))
        del pool
print("\n| T | bs | mosaic chained | mosaic busy | mosaic kernel | cudnn chained | cudnn busy | cudnn kernel | kernel/cudnn kernel | busy/cudnn busy |")
for T, bs, t, busy, attn, tc, cb, ca in rows:
    print(f"| {T} | {bs} | {t:.1f} | {busy:.1f} | {attn:.1f} | {tc:.1f} | {cb:.1f} | {ca:.1f} | {attn/ca:.3f} | {busy/cb:.3f} |")
