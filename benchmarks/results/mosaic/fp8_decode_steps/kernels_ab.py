"""fp8 pools (e4m3, block 64) at Qwen3-0.6B's heads (Hq 16 / Hkv 8 / D 128) and Qwen2.5-7B's (28 / 4):
where each launch an fp8 engine makes should run if the engine marked its decode steps.

* decode-shaped launches holding a prompt chunk (one real sequence, the step padded to as many
  sequences as tokens): ``keys_on_m`` (what they run by shape: the decode kernel, a program a token),
  ``tiles`` (the query tiles, what they would run with the decode steps marked), ``prefill`` (the
  warp-specialised kernel);
* short launches that are not decode-shaped (a 32- or 128-token prompt alone, 8 sequences): ``prefill``
  (what they ran over fp8) against ``tiles`` (what they run over bf16: ``SMALL_LAUNCH_TOKENS``);
* decode steps: ``keys_on_m`` (marked ``uniform_decode``) against ``tiles``.
Each against the Triton kernel over the same pool (time and max difference). Chained us, variants in
turn over two rounds (``time_variants``).

Run from the repository root: python3 benchmarks/results/mosaic/fp8_decode_steps/kernels_ab.py
"""
import sys
import warnings

sys.path[:0] = ["benchmarks"]
warnings.filterwarnings("ignore")
import jax.numpy as jnp  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_attention import random_paged_batch, time_variants  # noqa: E402
from jaxpaged.kernels.fp8 import quantize_pool  # noqa: E402
from jaxpaged.kernels.paged_attention import paged_attention as triton  # noqa: E402
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu  # noqa: E402

V = {"keys_on_m": lambda *a: paged_attention_mgpu(*a, uniform_decode=True),
     "tiles": lambda *a: paged_attention_mgpu(*a, decode=True),
     "prefill": lambda *a: paged_attention_mgpu(*a, decode=False),
     "triton": lambda *a: triton(*a)}
one = lambda n, s: [n] + [0] * (s - 1)  # noqa: E731
CASES = [  # family, heads (Hq, Hkv), new tokens, cached prefixes, padded tokens, variants
    ("chunk", (16, 8), one(32, 32), one(4096, 32), 32, ("keys_on_m", "tiles", "prefill")),
    ("chunk", (16, 8), one(256, 256), one(4096, 256), 256, ("keys_on_m", "tiles", "prefill")),
    ("chunk", (28, 4), one(32, 32), one(4096, 32), 32, ("keys_on_m", "tiles", "prefill")),
    ("short", (16, 8), one(32, 8), one(4096, 8), 32, ("tiles", "prefill")),
    ("short", (16, 8), one(128, 8), one(4096, 8), 128, ("tiles", "prefill")),
    ("short", (16, 8), one(32, 8), one(0, 8), 32, ("tiles", "prefill")),
    ("short", (16, 8), one(128, 8), one(0, 8), 128, ("tiles", "prefill")),
    ("short", (28, 4), one(32, 8), one(4096, 8), 32, ("tiles", "prefill")),
    ("short", (28, 4), one(128, 8), one(0, 8), 128, ("tiles", "prefill")),
    ("decode", (16, 8), [1] * 64, [1023] * 64, 64, ("keys_on_m", "tiles")),
    ("decode", (16, 8), [1] * 256, [1023] * 256, 256, ("keys_on_m", "tiles")),
]
quantize = jax.jit(quantize_pool, static_argnums=1)
print(jax.devices()[0].device_kind, flush=True)
print("# case: family, heads, new tokens of the first sequence + its cached prefix, S sequences; "
      "us per launch (chained); max |diff| vs triton", flush=True)
for fam, (hq, hkv), ql, pre, t, names in CASES:
    q, pool, cu, kl, tb = random_paged_batch(ql, pre, hq, hkv, 128, 64, t)
    pool = quantize(pool, jnp.float8_e4m3fn)
    fns = {n: V[n] for n in (*names, "triton")}
    label = f"{fam} {hq}/{hkv} {ql[0]}+{pre[0]} S{len(ql)}"
    times, outs = time_variants(fns, q, pool, cu, kl, tb, reps=5, chain=8, where=label, rounds=2)
    diff = {n: float(np.max(np.abs(o - outs["triton"]))) for n, o in outs.items() if n != "triton"}
    best = min((n for n in times if n != "triton"), key=times.get)
    print(label, {k: f"{v:.1f}" for k, v in times.items()}, {k: f"{v:.1e}" for k, v in diff.items()},
          f"best {best}", flush=True)
