"""What split-K's merge costs on the GPU, as ``kernels/split_k.merge_splits`` stands and as one
reduction whose combiner merges two partial softmaxes (one_reduction_merge.patch): the GPU time of 50
merges summed by kernel, at the shapes an engine's split steps give it (Qwen3-0.6B's 16 query heads of
128): a decode step of 1 and 8 sequences at 32 splits, a 32-token chunk at 4-32 splits, 8 chunks of 32
at 4. Partials: random, a third of the splits empty (``lse`` ``-inf``, zeros), as a short context
leaves them.

Run from the repository root: python3 benchmarks/results/split_k/merge_cost.py (with the patch applied
or not: it times the tree's merge_splits against the patch's, written out below)
"""
import sys
import warnings

sys.path[:0] = ["benchmarks/results/mosaic"]
warnings.filterwarnings("ignore")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from decode_profile import traced  # noqa: E402
from jax import lax  # noqa: E402


def three_reductions(o, lse, dtype):  # the merge before the patch
    top = jnp.max(lse, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp2(lse - top[None])
    denom = jnp.sum(w, axis=0)
    return (jnp.sum(o * w[..., None], axis=0) / jnp.where(denom == 0, 1.0, denom)[..., None]).astype(dtype)


def _two(a, b):
    (o_a, l_a), (o_b, l_b) = a, b
    top = jnp.maximum(l_a, l_b)
    top = jnp.where(top == -jnp.inf, 0.0, top)
    w_a, w_b = jnp.exp2(l_a - top), jnp.exp2(l_b - top)
    s = w_a + w_b
    return (o_a * w_a + o_b * w_b) / jnp.where(s == 0, 1.0, s), jnp.where(s == 0, -jnp.inf, top + jnp.log2(s))


def one_reduction(o, lse, dtype):  # the patch's
    init = (jnp.zeros((), jnp.float32), jnp.full((), -jnp.inf, jnp.float32))
    return lax.reduce((o, jnp.broadcast_to(lse[..., None], o.shape)), init, _two, (0,))[0].astype(dtype)


print(jax.devices()[0].device_kind, flush=True)
rows = []
for label, p, t in (("decode 1", 32, 1), ("decode 8", 32, 8), ("chunk 32", 4, 32), ("chunk 32", 16, 32),
                    ("chunk 32", 32, 32), ("8 chunks of 32", 4, 256)):
    k = jax.random.split(jax.random.key(p * t), 3)
    lse = jax.random.normal(k[1], (p, t, 16)) * 4
    lse = jnp.where(jax.random.bernoulli(k[2], 1 / 3, lse.shape), -jnp.inf, lse)
    o = jnp.where(jnp.isfinite(lse)[..., None], jax.random.normal(k[0], (p, t, 16, 128)), 0.0)
    ref = three_reductions(o, lse, jnp.float32)
    for name, merge in (("three reductions", three_reductions), ("one reduction", one_reduction)):
        f = jax.jit(lambda x, merge=merge: (x[0], x[1], merge(x[0], x[1], jnp.bfloat16)))
        x = jax.block_until_ready(f((o, lse, None)))
        err = float(jnp.max(jnp.abs(x[2].astype(jnp.float32) - ref)))
        tot, cnt, _ = traced(f, x, 50)
        busy = sum(tot.values())
        print(f"{label} P{p}: {name}: GPU busy {busy:.1f} us in {sum(cnt.values()):.0f} kernels "
              f"(max |diff| {err:.3g}):", "; ".join(f"{v:.1f} {n[:40]}" for n, v in tot.most_common(4)), flush=True)
        rows.append((label, p, name, busy, sum(cnt.values())))
print("\n| launch | splits | merge | GPU busy us | kernels |")
print("| --- | --- | --- | --- | --- |")
for label, p, name, busy, n in rows:
    print(f"| {label} | {p} | {name} | {busy:.1f} | {n:.0f} |")
