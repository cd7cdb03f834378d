"""Decode rows in a prefill launch: the checkout's kernel (sequences of one new token computed by the
decode tiles, a KV head's G query heads in one wgmma tile) against the in-place prefill kernel that
computed them itself (an item a query head: G items of 64 rows for one token) and the kernel before that
(tiles laid out by XLA, a KV head's G heads packed in a tile); one process, one GPU. Chained wall time,
GPU busy time (the profiler's sum over the launch's kernels) and the largest difference from the tiled
kernel's output (correctness against the reference: ``check_attention_mgpu.py``). Make
the two earlier kernels first (git-excluded copies):

    d=benchmarks/results/mosaic/prefill_one_token
    git show a1feab8:kernels/paged_attention_mgpu_prefill.py > $d/prefill_tiles.py
    git show 499c662:kernels/paged_attention_mgpu_prefill.py > $d/prefill_in_place.py
    python3 $d/one_token_ab.py [case,...]    # of CASES; default all

Shapes (Hq, Hkv, D): Qwen3-0.6B (16, 8, 128, G 2), Qwen2.5-7B (28, 4, 128, G 7), Qwen2.5-0.5B (14, 2, 64, G 7).
"""
import sys, warnings
sys.path[:0] = ["benchmarks", "tools", "benchmarks/results/mosaic", "benchmarks/results/mosaic/prefill_one_token"]
warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from decode_profile import traced
from bench_attention import chain_time, random_paged_batch
import prefill_tiles, prefill_in_place
from jaxpaged.kernels import paged_attention_mgpu_prefill as checkout
from jaxpaged.kernels.paged_attention_mgpu import prefill_kv_tile

BS = 16
SHAPES = {"qwen3": (16, 8, 128), "7b": (28, 4, 128), "0.5b": (14, 2, 64)}
# name: (shape, new tokens a sequence, cached tokens before them)
CASES = {
    # a mixed step: 64 decode rows of 1,024 tokens of context and a 2,048-token chunk
    "mixed64": ("qwen3", [1] * 64 + [2048], [1024] * 64 + [0]),
    "mixed64-7b": ("7b", [1] * 64 + [2048], [1024] * 64 + [0]),
    # a server's step: 255 sequences decoding at 4k tokens of context, one 512-token prompt arriving
    "mixed255": ("qwen3", [1] * 255 + [512], [4096] * 255 + [0]),
    "mixed255-7b": ("7b", [1] * 255 + [512], [4096] * 255 + [0]),
    "mixed255-0.5b": ("0.5b", [1] * 255 + [512], [4096] * 255 + [0]),
    # launches without decode rows: what the extra (empty) decode launch costs
    "128": ("qwen3", [128], [0]), "2k": ("qwen3", [2048], [0]), "16k": ("qwen3", [16384], [0]),
    "ragged": ("qwen3", [1000, 37, 3000, 513, 5], [0, 500, 1024, 0, 77]),
}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
VARIANTS = (("tiles", prefill_tiles), ("in_place", prefill_in_place), ("checkout", checkout))
if len(sys.argv) > 2:  # a comma list of variants (default all three; the table needs all three)
    VARIANTS = tuple(v for v in VARIANTS if v[0] in sys.argv[2].split(","))
rows = []
for name in names:
    shape, qls, pres = CASES[name]
    HQ, HKV, D = SHAPES[shape]
    T = sum(qls)  # padded to a power of two, as the engine's token buckets are
    q, pool, cu, kl, table = random_paged_batch(qls, pres, HQ, HKV, D, BS, 1 << (T - 1).bit_length())
    kw = dict(scale=D ** -0.5, interpret=None, block_kv=prefill_kv_tile(BS), num_slots=2)
    res = {}
    for vname, mod in VARIANTS:
        fn = lambda qq, cs, tb, mod=mod: mod.paged_prefill_mgpu(qq, cs[0], jnp.int32(0), cs[1], cs[2], tb, **kw)
        out = np.asarray(jax.block_until_ready(fn(q, (pool, cu, kl), table)), np.float32)
        ref = out if vname == VARIANTS[0][0] else ref  # (the reference here: the first variant's output)
        err = float(np.max(np.abs(out - ref)))
        _, t = chain_time(fn, q, (pool, cu, kl), [table], 10, 8)
        jf = jax.jit(fn)  # the pool an argument: closed over, it would be a constant of the program (2 GB and more)
        f = lambda qq, jf=jf: jf(qq, (pool, cu, kl), table)
        tot, cnt, _ = traced(f, q, 20)
        res[vname] = (t * 1e6, sum(tot.values()), err)
        print(f"== {name} {vname}: chained {t*1e6:.1f} us, busy {sum(tot.values()):.1f}, max diff {err:.2e}", flush=True)
        for k, v in tot.most_common(5):
            print(f"   {v:8.2f} us x{cnt[k]:.1f} {k[:90]}", flush=True)
    rows.append((name, res))
    del pool
print("\n| case | tiles chained / busy | in place chained / busy | checkout chained / busy | checkout / in place | checkout / tiles | max diff from tiles (in place, checkout) |")
for name, r in rows:
    if len(r) < 3:
        continue
    a, b, c = r["tiles"], r["in_place"], r["checkout"]
    print(f"| {name} | {a[0]:.1f} / {a[1]:.1f} | {b[0]:.1f} / {b[1]:.1f} | {c[0]:.1f} / {c[1]:.1f} | "
          f"{c[0]/b[0]:.3f} | {c[0]/a[0]:.3f} | {b[2]:.1e}, {c[2]:.1e} |")
