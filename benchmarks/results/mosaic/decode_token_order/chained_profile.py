"""Chained decode launches (8 per jit, each output the next call's queries) under the profiler: GPU kernel
time per call, for the decode kernel's variants: "tiles" (02b4a47: queries and outputs relaid into tiles
by XLA), "v1" (57ee1cd: queries read in place, outputs gathered in the merge), "v2" (646d778: outputs
written in place, the split's output in the K/V slots' shared memory), "v2nounion" (v2 with separate
shared memory for the split's output), and the Triton kernel. Block 16, Hq 16 / Hkv 8 / D 128. The
variants are files in .gpu/: `git show <commit>:kernels/paged_attention_mgpu.py > .gpu/mgpu_<name>.py`
(v2nounion: 646d778's with the `RefUnion` replaced by four scratch buffers)."""
import sys, os, gzip, json, glob, re, time, tempfile, collections
sys.path.insert(0, ".gpu"); sys.path.insert(0, "benchmarks")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from jaxpaged.kernels.kv_write import pool_from_caches
from jaxpaged.kernels.paged_attention import paged_attention
import mgpu_tiles, mgpu_v1, mgpu_v2nounion
from jaxpaged.kernels import paged_attention_mgpu as v2
HQ, HKV, D, BS, CH, N = 16, 8, 128, 16, 8, 20
VARS = {"tiles": mgpu_tiles.paged_attention_mgpu, "v1": mgpu_v1.paged_attention_mgpu,
        "v2nounion": mgpu_v2nounion.paged_attention_mgpu, "v2": v2.paged_attention_mgpu, "triton": paged_attention}
def norm(n):
    p = None
    while p != n:
        p = n; n = re.sub(r"[._]\d+$", "", n)
    return n
rows = []
for B, ctx in ((1, 256), (1, 1024), (8, 1024)):
    nb = ctx // BS
    kk, kv_, kq = jax.random.split(jax.random.key(B * ctx), 3)
    blocks = B * nb + 16
    pool = pool_from_caches(jax.random.normal(kk, (blocks, BS, HKV, D), jnp.bfloat16), jax.random.normal(kv_, (blocks, BS, HKV, D), jnp.bfloat16))
    table = jnp.asarray(np.random.default_rng(0).permutation(blocks)[:B * nb].reshape(B, nb).astype(np.int32))
    q = jax.random.normal(kq, (B, HQ, D), jnp.bfloat16)
    cu = jnp.arange(B + 1, dtype=jnp.int32); kl = jnp.full((B,), ctx, jnp.int32)
    for name, fn in VARS.items():
        def chain(qq, pool, cu, kl, tb, fn=fn):
            for _ in range(CH):
                qq = fn(qq, pool, 0, cu, kl, tb)
            return qq
        f = jax.jit(chain)
        out = f(q, pool, cu, kl, table); jax.block_until_ready(out)
        for _ in range(5): out = f(out, pool, cu, kl, table)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(50): out = f(out, pool, cu, kl, table)
        jax.block_until_ready(out); wall = (time.perf_counter() - t0) / 50 / CH * 1e6
        d = tempfile.mkdtemp(); jax.profiler.start_trace(d)
        for _ in range(N): out = f(out, pool, cu, kl, table)
        jax.block_until_ready(out); jax.profiler.stop_trace()
        ev = json.load(gzip.open(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True)[0], "rt"))["traceEvents"]
        pids = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
        gpu = [e for e in ev if e.get("ph") == "X" and "/device:GPU:0" in pids.get(e.get("pid"), "")]
        tot = collections.Counter(); cnt = collections.Counter()
        for e in gpu: tot[norm(e["name"])] += e["dur"]; cnt[norm(e["name"])] += 1
        busy = sum(tot.values()) / N / CH
        gpu.sort(key=lambda e: e["ts"])
        gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(gpu, gpu[1:])]
        print(f"== B={B} ctx={ctx} {name}: wall {wall:.1f} us/launch, GPU busy {busy:.1f} us/launch, kernels/launch {len(gpu)/N/CH:.1f}, median gap {np.median(gaps):.1f} us, max gap {max(gaps):.1f}", flush=True)
        for k, v in tot.most_common(8):
            print(f"   {v / N / CH:8.2f} us  x{cnt[k] / N / CH:.1f}  {k[:100]}", flush=True)
        rows.append((B, ctx, name, wall, busy, len(gpu) / N / CH))
print("\nB ctx variant | wall us/launch (chained) | GPU busy us/launch | kernels/launch")
for r in rows: print(*r[:3], f"{r[3]:.1f} {r[4]:.1f} {r[5]:.1f}")
