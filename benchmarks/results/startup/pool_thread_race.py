"""A Qwen2.5-7B engine, then GIB of device memory allocated and freed right after construction, then the
warm-up; prints the allocator's stats. Run at b1060ec-48924e0, whose engine made its pool in a thread:
with GIB=2 the warm-up's first step failed to allocate 81.33 GiB (`pool_thread_race_grow2_2026-12-02.err`).
XLA_PYTHON_CLIENT_PREALLOCATE=true|false python benchmarks/results/startup/pool_thread_race.py GIB"""
import sys, time, warnings, json
warnings.filterwarnings("ignore")
import jax, jax.numpy as jnp
from jaxpaged import EngineConfig, LLMEngine
from jaxpaged.workloads import QWEN2_5_7B, random_model
gib = float(sys.argv[1])
params = random_model(QWEN2_5_7B)
jax.block_until_ready(params.state)
dev = jax.local_devices()[0]
t0 = time.perf_counter()
e = LLMEngine(params, EngineConfig(max_model_len=4096))
if gib > 0:
    x = jax.jit(lambda: jnp.zeros((int(gib * 2**30),), jnp.uint8))()
    x.block_until_ready(); x.delete()
t1 = time.perf_counter()
e.warmup(use_tqdm=False)
t2 = time.perf_counter()
st = dev.memory_stats()
keep = {k: st[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved", "pool_bytes",
                           "largest_alloc_size", "num_allocs") if k in st}
print("RESULT", json.dumps(dict(reserve_gib=gib, engine_s=t1 - t0, warmup_s=t2 - t1, num_blocks=e.num_blocks,
                                 mem={k: round(v / 2**30, 2) if "bytes" in k or "size" in k else v for k, v in keep.items()})))
