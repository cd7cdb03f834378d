"""The first request after warm-up with the warm-up's heap freeze (`gc.collect(); gc.freeze()`) before its launches
(`new`, what `warmup()` does) or after them (`old`): python gc_order.py new|old (a GPU; Qwen3-0.6B shapes)."""
import sys, time, json
import numpy as np, jax
from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.engine.heap import freeze_long_lived_heap
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import QWEN3_0_6B, random_model
mode = sys.argv[1]
e = LLMEngine(random_model(QWEN3_0_6B), EngineConfig(max_model_len=4096))
t = time.perf_counter()
if mode == "old":
    e.warmup(use_tqdm=False, freeze_gc=False); freeze_long_lived_heap()
else:
    e.warmup(use_tqdm=False)
tw = time.perf_counter() - t
rng = np.random.default_rng(0)
sp = SamplingParams(temperature=0, max_tokens=1)
def ttft():
    p = [int(x) for x in rng.integers(1, 1000, 32)]
    t = time.perf_counter(); run_to_completion(e, [p], sp); return (time.perf_counter() - t) * 1e3
first = ttft()
steady = [ttft() for _ in range(20)]
idle = []
for _ in range(10):
    time.sleep(0.1); idle.append(ttft())
print(f"RESULT {mode:4s} warmup {tw:5.1f}s first {first:.2f} steady {np.median(steady):.2f} after-idle {np.median(idle):.2f} first/steady {first/np.median(steady):.2f}", flush=True)
