"""Where does a request after idle spend its extra time? Host phases, and the GPU's and the host's idle states.

    python benchmarks/results/startup/after_idle.py

A warmed Qwen3-0.6B engine (random weights, max_model_len 4096); 32-token greedy requests of fresh tokens,
one new token each, timed whole ("ttft"), with the step's launch (``runner.step``: packing, the executable
call) and the wait for its tokens (the token reader) timed apart; 12 requests per row, the first two
dropped, medians. Rows: back to back; after 20 or 200 ms of ``time.sleep``; after 200 ms of the main
thread spinning; the GPU kept busy through the idle (tiny kernels with the host spinning, or queued
~1.4 ms kernels with the host asleep); and with every other core kept busy by ``nice 19`` spinners.
Last, ``nvidia-smi`` samples the SM clock every 20 ms across requests and 0.5 s idles.
"""
import os, sys, time, subprocess, glob, threading
import numpy as np, jax, jax.numpy as jnp
from jaxpaged import EngineConfig, LLMEngine, SamplingParams
from jaxpaged.llm import run_to_completion
from jaxpaged.workloads import QWEN3_0_6B, random_model

for f in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*")):
    try:
        print("cstate", open(f + "/name").read().strip(), "latency_us", open(f + "/latency").read().strip(),
              "disabled", open(f + "/disable").read().strip())
    except Exception as e:
        print("cstate?", e)
for f in ["/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor", "/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq"]:
    try: print(f, open(f).read().strip())
    except Exception as e: print(f, "n/a")
print(subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,persistence_mode,power.draw", "--format=csv"],
                     capture_output=True, text=True).stdout)

e = LLMEngine(random_model(QWEN3_0_6B), EngineConfig(max_model_len=4096))
e.warmup(use_tqdm=False)
ph = {}
orig_step, orig_read = e.runner.step, e._read_tokens
def step(*a, **k):
    t = time.perf_counter(); r = orig_step(*a, **k); ph.setdefault("launch", []).append(time.perf_counter() - t); return r
def read(x):
    t = time.perf_counter(); r = orig_read(x); ph.setdefault("wait", []).append(time.perf_counter() - t); return r
e.runner.step, e._read_tokens = step, read
rng = np.random.default_rng(0)
sp = SamplingParams(temperature=0, max_tokens=1)

def req():
    ph.clear()
    p = [int(x) for x in rng.integers(1, 30000, 32)]
    t = time.perf_counter(); run_to_completion(e, [p], sp); tot = time.perf_counter() - t
    return tot * 1e3, sum(ph.get("launch", [])) * 1e3, sum(ph.get("wait", [])) * 1e3

small = jnp.ones((1024, 1024), jnp.float32)
tiny_op = jax.jit(lambda x: x * 1.0001)
@jax.jit
def long_op(x):  # ~ a few ms per call: chain of matmuls
    def body(i, y): return jnp.tanh(y @ y) * 0.5
    return jax.lax.fori_loop(0, 40, body, x)
jax.block_until_ready(tiny_op(small)); jax.block_until_ready(long_op(small))
t = time.perf_counter(); jax.block_until_ready(long_op(small)); long_ms = (time.perf_counter() - t) * 1e3
print(f"long_op {long_ms:.2f} ms")

IDLE = 0.2
def idle_sleep(): time.sleep(IDLE)
def idle_spin():
    end = time.perf_counter() + IDLE
    while time.perf_counter() < end: pass
def idle_gpu_spin():  # host spins, GPU busy with tiny kernels
    end = time.perf_counter() + IDLE
    y = small
    while time.perf_counter() < end: y = tiny_op(y); y.block_until_ready()
def idle_gpu_sleep():  # GPU busy with queued long kernels, host sleeps
    n = max(1, int(IDLE * 1e3 / long_ms) - 1)
    y = small
    for _ in range(n): y = long_op(y)
    time.sleep(IDLE)
    y.block_until_ready()
def idle_short_sleep(): time.sleep(0.02)
def none(): pass

def run(name, idle, n=12, setup=None):
    rows = []
    for _ in range(n):
        idle(); rows.append(req())
    a = np.array(rows[2:])
    med = np.median(a, axis=0)
    print(f"ROW {name:28s} ttft {med[0]:.2f}  launch {med[1]:.2f}  wait {med[2]:.2f}  other {med[0]-med[1]-med[2]:.2f}  (min ttft {a[:,0].min():.2f} max {a[:,0].max():.2f})", flush=True)
    return med

for _ in range(20): req()
run("back-to-back", none, 30)
run("sleep 20 ms", idle_short_sleep)
run("sleep 200 ms", idle_sleep)
run("spin 200 ms", idle_spin)
run("GPU tiny kernels, host spin", idle_gpu_spin)
run("GPU long kernels, host sleep", idle_gpu_sleep)
# every core busy (nice 19 spinners) while the host sleeps
procs = [subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"]) for _ in range((os.cpu_count() or 4) - 2)]
time.sleep(1)
run("sleep 200 ms, cores spun", idle_sleep)
run("back-to-back, cores spun", none, 30)
for p in procs: p.kill()
# GPU clocks across an idle
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader", "-lms", "20"],
                       stdout=subprocess.PIPE, text=True)
time.sleep(0.5)
for _ in range(5): req()
time.sleep(0.5)
for _ in range(5): req()
time.sleep(0.3)
smi.terminate(); out = smi.communicate()[0]
print("SMI", out.replace("\n", " | ")[:3000])
