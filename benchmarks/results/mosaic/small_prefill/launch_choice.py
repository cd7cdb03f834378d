"""Which kernel a small non-decode launch should run: the warp-specialised prefill kernel (what launches of
more than 2 S tokens ran), the one-warpgroup kernel's query tiles (up to 64 // G tokens a tile, queries and
outputs in place) unsplit, or the same with the decode launches' split-K rule; the Triton kernel beside
them. Chained wall time (8 launches a jit), block 16, D 128; largest difference from the Triton kernel's
output.

Families (S = padded sequences, as the engine pads a step):
  * one: one sequence of T new tokens after a prefix, S = 8 (an engine of max_num_seqs 1-8);
  * ragged: four sequences of T / 4 new tokens after 1,024 cached each, S = 8;
  * mixed: 255 decode rows at 4,096 + one 512-token prompt, T = 1,024, S = 256 (a 256-slot step).

  * g2fp8: the one family over an e4m3 pool of 64-slot blocks (no split variant: over fp8 a decode
    launch is the fp8 decode kernel's).

Run from the repository root: python3 benchmarks/results/mosaic/small_prefill/launch_choice.py [g2,g7]
"""
import sys, warnings
sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import jax, numpy as np
from bench_attention import random_paged_batch, time_variants
from jaxpaged.kernels.paged_attention_mgpu import MAX_TILE_TOKENS, paged_attention_mgpu
from jaxpaged.kernels.paged_attention import paged_attention as triton
from jaxpaged.kernels.fp8 import quantize_pool

SHAPES = {"g2": (16, 8, 128), "g7": (28, 4, 128), "g2fp8": (16, 8, 128)}  # g2fp8: an e4m3 pool, block 64


def variants(hq, hkv):
    block_q = min(64 // (hq // hkv), MAX_TILE_TOKENS)
    return {
        "prefill_kernel": lambda *a: paged_attention_mgpu(*a, decode=False),
        "tiles": lambda *a: paged_attention_mgpu(*a, block_q=block_q, num_splits=1),
        "tiles_split": lambda *a: paged_attention_mgpu(*a, decode=True),
        "triton": lambda *a: triton(*a),
    }


def cases(name):
    one_t = {"g2": (32, 128, 512, 1024, 2048), "g7": (32, 256, 1024), "g2fp8": (32, 128, 512)}[name]
    if name == "g2fp8":
        return [("one", [t] + [0] * 7, [p] + [0] * 7, t) for p in (0, 4096) for t in one_t]
    out = [("one", [t] + [0] * 7, [p] + [0] * 7, t) for p in (0, 4096) for t in one_t]
    out += [("ragged", [t // 4] * 4 + [0] * 4, [1024] * 4 + [0] * 4, t) for t in (256, 1024)]
    out += [("mixed", [1] * 255 + [512], [4095] * 255 + [0], 1024)]
    return out


rows = []
for shape in (sys.argv[1].split(",") if len(sys.argv) > 1 else list(SHAPES)):
    hq, hkv, d = SHAPES[shape]
    fns = variants(hq, hkv)
    if shape == "g2fp8":
        fns.pop("tiles_split")  # over fp8, decode=True is the fp8 decode kernel (a token a program)
    bs = 64 if shape == "g2fp8" else 16
    for fam, q_lens, prefixes, T in cases(shape):
        q, pool, cu, kl, table = random_paged_batch(q_lens, prefixes, hq, hkv, d, bs, T)
        if shape == "g2fp8":
            pool = jax.jit(quantize_pool, static_argnums=1)(pool, jax.numpy.dtype("float8_e4m3fn"))
        res, outs = time_variants(fns, q, pool, cu, kl, table, where=f"{shape} {fam}")
        ref = outs.get("triton")
        diffs = {k: float(np.max(np.abs(v - ref))) for k, v in outs.items()} if ref is not None else {}
        label = f"{shape} {fam} T {T} prefix {prefixes[0]} S {len(q_lens)}"
        rows.append((label, res))
        print(label, {k: f"{v:.1f} us" for k, v in res.items()}, "max diff",
              {k: f"{v:.1e}" for k, v in diffs.items()}, flush=True)
        del pool
names = ["prefill_kernel", "tiles", "tiles_split", "triton"]
print("\n| case | " + " | ".join(names) + " | best tiles / prefill kernel |")
for label, r in rows:
    best = min(r.get("tiles", np.inf), r.get("tiles_split", np.inf))
    ratio = best / r["prefill_kernel"] if "prefill_kernel" in r else float("nan")
    print(f"| {label} | " + " | ".join(f"{r[k]:.1f}" if k in r else "-" for k in names) + f" | {ratio:.2f} |")
