"""Query tiles of up to 64 // G tokens (the working tree) against tiles of one token a program (the kernel
before, `git show 325b3bd:kernels/paged_attention_mgpu.py > .gpu/mgpu_before.py`), the Mosaic prefill
kernel (decode=False) and the Triton kernel; chained wall time (8 launches a jit), Hq 16 / Hkv 8 / D 128,
block 16; largest difference from the Triton kernel's output.

  * decode: B sequences of one new token at context ctx;
  * batch1: one real sequence of T new tokens after a prefix, 8 padded sequences;
  * slots256: one real sequence, S = min(T, 256) padded sequences (a 256-slot engine's step: T <= 2 S
    takes the decode configuration).

Run from the repository root: python3 benchmarks/results/mosaic/decode_tiles/tiles_ab.py [decode,batch1,slots256]
"""
import sys, warnings, importlib.util
sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import numpy as np
from bench_attention import random_paged_batch, time_variants
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu
from jaxpaged.kernels.paged_attention import paged_attention as triton

spec = importlib.util.spec_from_file_location("mgpu_before", ".gpu/mgpu_before.py")
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)

HQ, HKV, D = 16, 8, 128
VARIANTS = {
    "before": lambda *a: before.paged_attention_mgpu(*a),
    "tiles": lambda *a: paged_attention_mgpu(*a),
    "prefill_kernel": lambda *a: paged_attention_mgpu(*a, decode=False),
    "triton": lambda *a: triton(*a),
}
FAMILIES = {
    "decode": [([1] * b, [c - 1] * b, b) for b, c in ((1, 1024), (8, 1024), (64, 1024), (256, 1024), (256, 4096))],
    "batch1": [([32] + [0] * 7, [p] + [0] * 7, 32) for p in (0, 4096)],
    "slots256": [([T] + [0] * (min(T, 256) - 1), [p] + [0] * (min(T, 256) - 1), T)
                 for p in (0, 4096, 16384) for T in (256, 512)],
}
fams = sys.argv[1].split(",") if len(sys.argv) > 1 else list(FAMILIES)
rows = []
for fam in fams:
    for q_lens, prefixes, T in FAMILIES[fam]:
        q, pool, cu, kl, table = random_paged_batch(q_lens, prefixes, HQ, HKV, D, 16, T)
        fns = {n: fn for n, fn in VARIANTS.items() if not (fam == "decode" and n == "prefill_kernel")}
        res, outs = time_variants(fns, q, pool, cu, kl, table, where=fam)
        ref = outs["triton"]
        diffs = {k: float(np.max(np.abs(v - ref))) for k, v in outs.items()}
        label = f"{len(q_lens)}x{prefixes[0] + 1}" if fam == "decode" else f"{q_lens[0]} + {prefixes[0]} (S {len(q_lens)})"
        rows.append((fam, label, res, diffs))
        print(fam, label, {k: f"{v:.1f} us" for k, v in res.items()}, "max diff", {k: f"{v:.1e}" for k, v in diffs.items()}, flush=True)
        del pool
print("\n| family | case | " + " | ".join(VARIANTS) + " | tiles / before |")
for fam, label, r, d in rows:
    ratio = r["tiles"] / r["before"] if "tiles" in r and "before" in r else float("nan")
    print(f"| {fam} | {label} | " + " | ".join(f"{r[k]:.1f}" if k in r else "-" for k in VARIANTS) + f" | {ratio:.2f} |")
