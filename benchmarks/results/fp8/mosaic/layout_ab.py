"""bench_throughput with the fp8 value slab in its previous layout (``old``: ``V[t, d]`` at row ``d // (D / bs)``,
column ``(d % (D / bs)) * bs + t``) or the current one (``new``, kernels/fp8.py): the write, the Triton
kernel and the reference patched together. ``python3 benchmarks/results/fp8/mosaic/layout_ab.py old|new
--model qwen3-0.6b --hf-requests 0 --kv-cache-dtype fp8 --out DIR``"""
import sys
sys.path.insert(0, "benchmarks")
which = sys.argv.pop(1)
import jax.numpy as jnp
import jaxpaged.kernels.fp8 as F
if which == "old":
    def v_slab_index(d, t, block_size, head_dim):
        per = head_dim // block_size
        return d // per, (d % per) * block_size + t
    def values_to_slab(v):
        *lead, bs, h, d = v.shape
        x = v.reshape(*lead, bs, h, bs, d // bs)
        x = jnp.moveaxis(x, (-4, -3, -2, -1), (-1, -3, -4, -2))
        return x.reshape(*lead, bs, h, d)
    def values_from_slab(slab):
        *lead, bs, h, d = slab.shape
        x = slab.reshape(*lead, bs, h, d // bs, bs)
        x = jnp.moveaxis(x, (-4, -3, -2, -1), (-2, -3, -1, -4))
        return x.reshape(*lead, bs, h, d)
    F.v_slab_index, F.values_to_slab, F.values_from_slab = v_slab_index, values_to_slab, values_from_slab
import bench_throughput
import jaxpaged.kernels.paged_attention as P, jaxpaged.kernels.qkv_epilogue as Q, jaxpaged.kernels.kv_write as W
import jaxpaged.kernels.paged_attention_reference as R
P.v_slab_index = Q.v_slab_index = W.v_slab_index = F.v_slab_index
R.values_from_slab = F.values_from_slab
assert P.v_slab_index is F.v_slab_index and Q.v_slab_index is F.v_slab_index and W.v_slab_index is F.v_slab_index
print("layout", which, flush=True)
bench_throughput.main()
