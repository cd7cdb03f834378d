"""Where a small decode launch's time goes, Mosaic vs Triton: batch 1 / 8 / 64 x context 256 / 1,024 (block 16,
Hq 16 / Hkv 8 / D 128). Each configuration: jit one attention call, warm it, trace 50 calls and sum the GPU
kernels' time by name per launch. ("wall" is one un-chained call's dispatch-bound time.) Run from the repo root:
python3 benchmarks/results/mosaic/decode_profile.py"""
import sys, os, gzip, json, glob, re, time, tempfile, collections
sys.path.insert(0, "benchmarks")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from jaxpaged.kernels.kv_write import pool_from_caches
from jaxpaged.kernels.paged_attention import paged_attention
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu
HQ, HKV, D, BS = 16, 8, 128, 16
N = 50
def norm(n):
    p = None
    while p != n:
        p = n; n = re.sub(r"[._]\d+$", "", n)
    return n
summary = []
for B in (1, 8, 64):
    for ctx in (256, 1024):
        nb = ctx // BS
        kk, kv_, kq = jax.random.split(jax.random.key(B * ctx), 3)
        blocks = B * nb + 16
        pool = pool_from_caches(jax.random.normal(kk, (blocks, BS, HKV, D), jnp.bfloat16), jax.random.normal(kv_, (blocks, BS, HKV, D), jnp.bfloat16))
        table = jnp.asarray(np.random.default_rng(0).permutation(blocks)[:B * nb].reshape(B, nb).astype(np.int32))
        q = jax.random.normal(kq, (B, HQ, D), jnp.bfloat16)
        cu = jnp.arange(B + 1, dtype=jnp.int32); kl = jnp.full((B,), ctx, jnp.int32)
        for name, fn in (("mosaic", lambda *a: paged_attention_mgpu(*a)), ("triton", lambda *a: paged_attention(*a))):
            f = jax.jit(lambda qq, pool, cu, kl, tb, fn=fn: fn(qq, pool, 0, cu, kl, tb))
            out = f(q, pool, cu, kl, table); jax.block_until_ready(out)
            for _ in range(20): out = f(out, pool, cu, kl, table)
            jax.block_until_ready(out)
            t0 = time.perf_counter()
            for _ in range(200): out = f(out, pool, cu, kl, table)
            jax.block_until_ready(out); wall = (time.perf_counter() - t0) / 200 * 1e6
            d = tempfile.mkdtemp()
            jax.profiler.start_trace(d)
            for _ in range(N): out = f(out, pool, cu, kl, table)
            jax.block_until_ready(out)
            jax.profiler.stop_trace()
            fs = glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)
            ev = json.load(gzip.open(fs[0], "rt"))["traceEvents"]
            pids = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
            gpu = [e for e in ev if e.get("ph") == "X" and "/device:GPU:0" in pids.get(e.get("pid"), "")]
            tot = collections.Counter(); cnt = collections.Counter()
            for e in gpu:
                tot[norm(e["name"])] += e["dur"]; cnt[norm(e["name"])] += 1
            busy = sum(tot.values()) / N
            span = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) / N if gpu else float("nan")
            print(f"== B={B} ctx={ctx} {name}: wall {wall:.1f} us/launch, GPU busy {busy:.1f} us/launch, span {span:.1f} us/launch, kernels/launch {len(gpu)/N:.1f}", flush=True)
            for k, v in tot.most_common(12):
                print(f"   {v / N:8.2f} us  x{cnt[k] / N:.1f}  {k[:110]}", flush=True)
            summary.append((B, ctx, name, wall, busy, len(gpu) / N))
print("\nB ctx backend | wall us/launch | GPU busy us/launch | kernels/launch")
for s in summary:
    print(*s[:3], f"{s[3]:.1f} {s[4]:.1f} {s[5]:.1f}")
