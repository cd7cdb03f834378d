"""Prefill variants on the H200: cuDNN, jax's FA3-style `attention_mgpu` (contiguous), our Mosaic kernels (the
default launch, the one-warpgroup kernel forced with `block_q`, the warp-specialised kernel with KV tiles of 128 and 64
and the FA3 ping-pong schedule) and the Triton kernel, causal, 2k-16k tokens, Hq 16 / Hkv 8 / D 128. Ran at e21bc0a,
where `paged_prefill_mgpu` had a `pingpong` option (removed since: it timed the same as the default schedule)."""
import sys, os, functools, math
sys.path.insert(0, "benchmarks")
import warnings; warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp, numpy as np
from bench_attention import _chain_simple, chain_time, timed, prefill_flops, rel_err
from jax.experimental.pallas.ops.gpu import attention_mgpu as am
from jaxpaged.kernels.paged_attention_mgpu import paged_attention_mgpu
from jaxpaged.kernels.paged_attention import paged_attention
from jaxpaged.kernels.paged_attention_mgpu_prefill import paged_prefill_mgpu
HQ, HKV, D, BS = 16, 8, 128, 16
OURS = len(sys.argv) > 1 and sys.argv[1] == 'ours'
rows = []
for T in (2048, 4096, 8192, 16384):
    flops = prefill_flops(T, 0)
    kq, kk, kv = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(kq, (1, T, HQ, D), jnp.bfloat16)
    k = jax.random.normal(kk, (1, T, HKV, D), jnp.bfloat16)
    v = jax.random.normal(kv, (1, T, HKV, D), jnp.bfloat16)
    r = {"T": T}
    fn = lambda qq, kc, vc: jax.nn.dot_product_attention(qq, kc, vc, is_causal=True, implementation="cudnn")
    ref = fn(q, k, v)
    _, t = timed(lambda qq, kc, vc: _chain_simple(fn, qq, kc, vc, 8), (q, k, v), 5); r["cudnn"] = t / 8 * 1e6
    for bq, bkv, mcs in (() if OURS else ((64, 128, 2), (64, 128, 3))):
        name = f"jax_mgpu_{bq}_{bkv}_{mcs}"
        try:
            cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=mcs, causal=True)
            f = functools.partial(am.attention, config=cfg)
            out = f(q, k, v)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            _, t = timed(lambda qq, kc, vc: _chain_simple(f, qq, kc, vc, 8), (q, k, v), 5)
            r[name] = t / 8 * 1e6; r[name + "_err"] = err
        except Exception as ex:
            print(name, "FAILED", type(ex).__name__, str(ex)[:600], flush=True)
    # paged, ours
    nb = T // BS
    pool = jnp.zeros((1, nb + 8, BS, 2, HKV, D), jnp.bfloat16)
    perm = np.random.default_rng(T).permutation(nb + 8)[:nb].astype(np.int32)
    pool = pool.at[0, perm].set(jnp.stack([k[0].reshape(nb, BS, HKV, D), v[0].reshape(nb, BS, HKV, D)], axis=2))
    table = jnp.asarray(perm.reshape(1, nb))
    cu = jnp.array([0, T], jnp.int32); kl = jnp.array([T], jnp.int32)
    ws = lambda bkv, ns, pp=False: (lambda q, pool, layer, cu, kl, bt: paged_prefill_mgpu(q, pool, jnp.asarray(layer, jnp.int32), cu, kl, bt, scale=D ** -0.5, interpret=None, block_kv=bkv, num_slots=ns, pingpong=pp))
    for name, kf in (("mosaic", paged_attention_mgpu), ("one_wg", functools.partial(paged_attention_mgpu, block_q=64 // (HQ // HKV))), ("ws_pp_128_2", ws(128, 2, True)), ("ws_pp_64_2", ws(64, 2, True))) + (() if OURS else (("triton", paged_attention),)):
        try:
            out = kf(q[0], pool, 0, cu, kl, table)
            r[name + "_err"] = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref[0].astype(jnp.float32))))
            _, t = chain_time(lambda qq, cs, tb, kf=kf: kf(qq, cs[0], 0, cs[1], cs[2], tb), q[0], (pool, cu, kl), [table], 5, 8)
            r[name] = t * 1e6
        except Exception as ex:
            print(name, "FAILED", type(ex).__name__, str(ex)[:600], flush=True)
    print("ROW", {a: (round(b, 1) if isinstance(b, float) and b > 0.1 else b) for a, b in r.items()}, flush=True)
    rows.append(r)
print("\nT | cudnn us | " + " | ".join(k for k in rows[0] if k not in ("T", "cudnn") and not k.endswith("_err")))
for r in rows:
    c = r["cudnn"]
    print(r["T"], f"{c:.1f}", " ".join(f"{k}={r[k]:.1f}({r[k]/c:.2f}x, {flops_t:.0f}TF)" for k in r if k not in ("T","cudnn") and not k.endswith("_err") for flops_t in [prefill_flops(r['T'],0)/r[k]/1e6]))
