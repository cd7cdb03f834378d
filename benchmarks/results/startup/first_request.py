"""Do throwaway requests at the end of the warm-up absorb the first requests' CUDA-graph re-records?

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
        python benchmarks/results/startup/first_request.py {plain|same3|other3|same6} 2> xla.log

N throwaway requests (32 tokens = the measured request's bucket, or 100 tokens = another bucket), then
a first 32-token request after 0.2 s of idle; "MARK" lines in stderr separate its part of XLA's log
(count "updated_allocs"). Since 48924e0 the engine's warm-up ends with ``settle`` itself, so "plain"
then includes three throwaway requests.
"""
import sys, time, warnings
warnings.filterwarnings("ignore")
import numpy as np, jax
from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import QWEN3_0_6B, random_model
mode = sys.argv[1]
e = LLMEngine(random_model(QWEN3_0_6B), EngineConfig(max_model_len=4096))
e.warmup(use_tqdm=False)
rng = np.random.default_rng(0)
def req(n=32, mt=1):
    p = [int(x) for x in rng.integers(1, 30000, n)]
    t = time.perf_counter(); run_to_completion(e, [p], SamplingParams(temperature=0, max_tokens=mt))
    return (time.perf_counter() - t) * 1e3
n_dummy = {"plain": 0, "same3": 3, "other3": 3, "same6": 6}[mode]
for _ in range(n_dummy):
    req(100 if mode.startswith("other") else 32)
print("MARK first", file=sys.stderr, flush=True)
time.sleep(0.2)
first = req()
print("MARK after", file=sys.stderr, flush=True)
after = []
for _ in range(6):
    time.sleep(0.2); after.append(req())
b2b = [req() for _ in range(10)]
print(f"RESULT {mode}: first {first:.2f} ms; after 0.2 s idle {' '.join(f'{x:.2f}' for x in after)}; "
      f"back to back median {np.median(b2b):.2f}")
