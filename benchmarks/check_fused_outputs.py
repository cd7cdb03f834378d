"""Greedy float32 tokens with the GPU's decode-path kernels and cuBLAS GEMMs equal those with XLA's ops
only, on one and two devices.

The tiny Qwen2 and Qwen3 checkpoints (float32), the engine's default backend (Pallas on a GPU). The
engine's own path on a GPU (``models.ops.get_model_ops``: the split-K GEMV, the fused qkv epilogue and
the fused residual add + RMSNorm; cuBLAS GEMMs for the steps of 33 to ``StepTuning.cublas_max_tokens``
tokens, which the prompts of 40 tokens reach) must give the same tokens as XLA's model ops with XLA's
Triton GEMMs everywhere (``cublas_max_tokens=0``), at ``tensor_parallel_size`` 1 and, when there are
two devices, 2 (the fused kernels then run per shard on their own heads and pool half). Also reports
the bf16 Qwen3-0.6B-shaped random model's greedy tokens both ways (bf16: reported, not required to be
equal). Prints one line per comparison, exits 1 on a float32 mismatch.

    python benchmarks/check_fused_outputs.py            # GPU (nvidia-h200-x2 for the tp=2 rows)
    python benchmarks/check_fused_outputs.py --tiny-only  # CPU: XLA's ops are the engine's there
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params  # noqa: E402
from jaxpaged.engine import model_runner  # noqa: E402
from jaxpaged.engine.tuning import StepTuning  # noqa: E402
from jaxpaged.llm import run_to_completion  # noqa: E402
from jaxpaged.models.qwen import DEFAULT_OPS  # noqa: E402
from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402
from jaxpaged.workloads import benchmark_params  # noqa: E402


def xla_ops_only():
    """While active, new engines build their step from XLA's model ops (``DEFAULT_OPS``, as on a CPU)
    instead of the device's kernels."""
    return mock.patch.object(model_runner, "get_model_ops", lambda batch_invariant=False: DEFAULT_OPS)


def tokens(params, prompts, max_tokens, *, tp=1, kernels=True, cublas=True, max_model_len=64):
    """Greedy tokens of a fresh engine: the device's kernels (``kernels``) or XLA's ops; cuBLAS GEMMs
    for decode-sized steps at the device's default (``cublas``) or never."""
    tuning = StepTuning.default()
    if not cublas:
        tuning = dataclasses.replace(tuning, cublas_max_tokens=0)
    with contextlib.nullcontext() if kernels else xla_ops_only():
        engine = LLMEngine(params, EngineConfig(
            block_size=8, num_blocks=64, max_model_len=max_model_len, max_num_batched_tokens=64,
            max_num_seqs=4, tensor_parallel_size=tp, compilation_cache=False), tuning=tuning)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in run_to_completion(engine, prompts, sp)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny-only", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 500, n).tolist() for n in (3, 11, 25, 40)]
    bad = 0
    for name in ("qwen2", "qwen3"):
        one = load_params(tiny_checkpoint_path(name), "float32", use_cache=False)
        want = tokens(one, prompts, 12, kernels=False, cublas=False)
        rows = [("tp1 kernels + cuBLAS", tokens(one, prompts, 12)),
                ("tp1 kernels, no cuBLAS", tokens(one, prompts, 12, cublas=False)),
                ("tp1 XLA ops + cuBLAS", tokens(one, prompts, 12, kernels=False))]
        if jax.device_count() >= 2:
            two = load_params(tiny_checkpoint_path(name), "float32", use_cache=False, tensor_parallel_size=2)
            rows += [("tp2 kernels", tokens(two, prompts, 12, tp=2)),
                     ("tp2 XLA ops", tokens(two, prompts, 12, tp=2, kernels=False))]
        for label, got in rows:
            same = got == want
            bad += not same
            print(f"{name} float32 {label:25s} vs tp1 XLA ops, no cuBLAS: {'identical' if same else 'DIFFERENT'}",
                  flush=True)
    if not args.tiny_only:
        params = benchmark_params("qwen3-0.6b")
        a = tokens(params, prompts, 32, max_model_len=128)
        b = tokens(params, prompts, 32, kernels=False, max_model_len=128)
        same = sum(x == y for x, y in zip(a, b))
        first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in zip(a, b)]
        print(f"qwen3-0.6b bf16 kernels vs XLA ops: {same}/{len(a)} requests identical; first differing token {first}")
    print("float32:", "all identical" if not bad else f"{bad} DIFFERENT")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
