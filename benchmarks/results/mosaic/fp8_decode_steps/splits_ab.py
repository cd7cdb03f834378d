"""The query tiles' split-K on the launches they run unmarked in an engine that marks its decode steps:
a prompt chunk in a decode-shaped launch (one real sequence, padded to as many sequences as tokens)
and a mixed step (decode rows and a chunk). Counting a program per padded sequence and KV head gives
a lone 32-token chunk padded to 32 sequences one split; counting the tiles its tokens fill, 32; on a
mixed step that count is low (a decode row is a tile of its own), and extra splits cost split-K's
merge. Here: the query tiles (``block_q`` given, so that an fp8 decode-shaped launch does not take
the decode kernel by shape) at 1-32 splits, against the keys-on-M decode kernel (a program a token);
both counts' splits printed. Qwen3-0.6B's heads (16 / 8, D 128), fp8 (e4m3, block 64) and bf16 (block
16). Chained us, variants in turn over two rounds (``time_variants``); max |diff| vs the first variant.

Run from the repository root: python3 benchmarks/results/mosaic/fp8_decode_steps/splits_ab.py
"""
import sys
import warnings

sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import random_paged_batch, time_variants  # noqa: E402
from jaxpaged.kernels.fp8 import quantize_pool  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import choose_splits, kv_tile, paged_attention_mgpu  # noqa: E402

pad = lambda v, s: v + [0] * (s - len(v))  # noqa: E731
S_CHUNK, S_MIXED = (1, 4, 16, 32), (1, 4)
CASES = [  # label, dtype, new tokens, cached prefixes, padded tokens, sequences, splits tried
    ("chunk 32+4096", "fp8", [32], [4096], 32, 32, S_CHUNK),
    ("mixed 200x1024 + 56+4096", "fp8", [56] + [1] * 200, [4096] + [1023] * 200, 256, 256, S_MIXED),
    ("mixed 200x1024 + 56+4096", "bf16", [56] + [1] * 200, [4096] + [1023] * 200, 256, 256, S_MIXED),
    ("chunk 32+4096", "bf16", [32], [4096], 32, 32, S_CHUNK),
]
quantize = jax.jit(quantize_pool, static_argnums=1)
print(jax.devices()[0].device_kind, flush=True)
for label, dt, ql, pre, t, s, tried in CASES:
    bs = 64 if dt == "fp8" else 16
    q, pool, cu, kl, tb = random_paged_batch(pad(ql, s), pad(pre, s), 16, 8, 128, bs, t)
    if dt == "fp8":
        pool = quantize(pool, jnp.float8_e4m3fn)
    block_q = 32  # (64 // G, at most 32)
    fns = {f"s{n}": (lambda *a, n=n: paged_attention_mgpu(*a, decode=True, block_q=block_q, num_splits=n))
           for n in tried}
    fns["keys_on_m"] = lambda *a: paged_attention_mgpu(*a, uniform_decode=True)
    auto = choose_splits(t, s, 8, kv_tile(bs), tb.shape[1] * bs, decode=True)  # (by padded sequences)
    tiles = min(s, -(-t // block_q))
    by_tiles = choose_splits(t, tiles, 8, kv_tile(bs), tb.shape[1] * bs, decode=True)  # (by the tokens' tiles)
    times, outs = time_variants(fns, q, pool, cu, kl, tb, reps=5, chain=8, where=label, rounds=2)
    first = next(iter(outs.values()))
    diff = max(float(np.max(np.abs(o - first))) for o in outs.values())
    best = min(times, key=times.get)
    print(f"{label} {dt} T{t} S{s} by sequences s{auto}, by tiles s{by_tiles}", {k: f"{v:.1f}" for k, v in times.items()},
          f"max diff {diff:.1e}, best {best}", flush=True)
