"""What the engine costs without any Pallas-Triton kernel: the step's model ops and sampler on XLA
(what a CPU runs: ``models.qwen.DEFAULT_OPS``, the sampler's XLA path) instead of the Triton
kernels (GEMV, qkv epilogue, add + RMSNorm, one-pass sampler), with either attention kernel.

    python without_triton.py triton|triton_xla|mosaic_xla|xla:KERNEL [--latency-only] --out $OUT
    (a GPU; one process a variant)

``triton`` is the default engine; ``triton_xla`` keeps Triton's attention and runs the rest on XLA;
``mosaic_xla`` has no Pallas-Triton kernel at all (attention on Mosaic GPU). Each runs the nano-vllm
workload (``bench_throughput.py --hf-requests 0``) and batch-1 latency (``bench_latency.py --batches 1
--prompts 32,1536``) over a fresh compilation cache, so every kernel is lowered in this process; the
Pallas-Triton lowerings are counted (the Mosaic GPU kernels take another lowering path and are not):
``mosaic_xla`` must show none.

One kernel at a time on XLA, the rest (and attention) on Triton: ``xla:gemv`` (every GEMV use, including
the qkv projection before its epilogue kernel; the add + RMSNorm then takes XLA's finished product, its
own rule for one split), ``xla:epilogue`` (the qkv projection, norms, RoPE and KV write: XLA's ops and
scatter), ``xla:norm`` (the residual add + RMSNorm over the GEMV's partials), ``xla:sampler`` (the
one-pass sampler): which of them XLA could take over, and at what cost, kernel by kernel. ``--latency-only``
skips the workload (batch-1 latency is where these kernels matter: 1.65x ITL for all four together).
"""
import collections
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "..")]
os.environ["JAXPAGED_COMPILE_CACHE"] = tempfile.mkdtemp()

from jax._src.pallas import core as pallas_core  # noqa: E402

lowered = collections.Counter()
_rule = getattr(pallas_core, "get_lowering_rule", None)


def _counting_rule(params_type, platform):
    lowered[params_type.__module__] += 1
    return _rule(params_type, platform)


if _rule is not None:
    pallas_core.get_lowering_rule = _counting_rule

import bench_latency  # noqa: E402
import bench_throughput  # noqa: E402

import dataclasses  # noqa: E402

from jaxpaged.engine import model_runner  # noqa: E402
from jaxpaged.kernels import add_rms_norm, gemv  # noqa: E402
from jaxpaged.models import ops  # noqa: E402
from jaxpaged.models.qwen import DEFAULT_OPS  # noqa: E402
from jaxpaged.sampling import sampler  # noqa: E402

ONE_KERNEL = ("xla:gemv", "xla:epilogue", "xla:norm", "xla:sampler")
variant, out = sys.argv[1], sys.argv[sys.argv.index("--out") + 1]
if variant not in ("triton", "triton_xla", "mosaic_xla") + ONE_KERNEL:
    raise SystemExit(f"variant must be triton, triton_xla, mosaic_xla or one of {ONE_KERNEL}, got {variant!r}")


def xla_sampler():
    sampler.sample.__defaults__ = sampler.sample.__defaults__[:-1] + (False,)  # argmax_kernel=False


if variant in ("triton_xla", "mosaic_xla"):
    model_runner.get_model_ops = lambda batch_invariant=False: DEFAULT_OPS
    xla_sampler()
elif variant == "xla:gemv":
    gemv.supported = lambda *a, **k: False
elif variant == "xla:sampler":
    xla_sampler()
elif variant != "triton":
    xla = {"xla:epilogue": dict(qkv_epilogue=None),
           "xla:norm": dict(add_rms_norm=lambda parts, residual, weight, eps: add_rms_norm.add_rms_norm_ops(
               parts, residual, weight, eps, DEFAULT_OPS.rms_norm))}[variant]
    gpu_ops = ops.get_model_ops
    model_runner.get_model_ops = lambda batch_invariant=False: dataclasses.replace(gpu_ops(batch_invariant), **xla)
backend = "mosaic" if variant == "mosaic_xla" else "triton"
name = variant.replace(":", "_")
if "--latency-only" not in sys.argv:
    bench_throughput.main(["--backend", backend, "--hf-requests", "0", "--out", os.path.join(out, name)])
lat = bench_latency.main(["--backend", backend, "--batches", "1", "--prompts", "32,1536",
                          "--out", os.path.join(out, name)])
print(f"RESULT {variant}: pallas lowerings by backend {dict(lowered)}", flush=True)
