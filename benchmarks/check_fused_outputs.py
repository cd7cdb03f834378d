"""Greedy float32 tokens with and without the GPU's fused decode kernels and cuBLAS GEMMs, on one
and two devices.

The tiny Qwen2 and Qwen3 checkpoints (float32), the engine's default backend (Pallas on a GPU): tokens
with the GPU's own kernels and fusions on (``fused_qkv``, ``decode_gemv``, ``fused_residual``, the
sampler kernel ``fused_sampler``, XLA's matmul-input fusion off; cuBLAS GEMMs for the steps of 33 to ``cublas_max_tokens`` tokens, which the prompts of 40 tokens
reach; the tokens read back by the default ``token_readback="auto"``, the stream reader on a GPU) must
equal those with XLA's Triton kernels and fusions only, read through jax, at ``tensor_parallel_size`` 1
and, when
there are two devices, 2 (the fused kernel then runs per shard on its own heads and pool half). Also
reports the bf16 Qwen3-0.6B-shaped random model's greedy tokens both ways (bf16: reported, not
required to be equal). Prints one line per comparison, exits 1 on a float32 mismatch.

    python benchmarks/check_fused_outputs.py            # GPU (nvidia-h200-x2 for the tp=2 rows)
    python benchmarks/check_fused_outputs.py --tiny-only  # CPU: the fused kernels are off there
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params  # noqa: E402
from jaxpaged.llm import run_to_completion  # noqa: E402
from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402
from jaxpaged.workloads import benchmark_params  # noqa: E402


def tokens(params, prompts, max_tokens, *, tp=1, fused=True, dtype="float32", max_model_len=64, cublas=None,
           readback="auto"):
    engine = LLMEngine(params, EngineConfig(
        dtype=dtype, block_size=8, num_blocks=64, max_model_len=max_model_len, max_num_batched_tokens=64,
        max_num_seqs=4, tensor_parallel_size=tp, decode_gemv=fused, fused_qkv=fused, fuse_matmul_inputs=not fused,
        fused_residual=fused, fused_sampler=fused, cublas_max_tokens=cublas, token_readback=readback,
        compilation_cache=False))
    if readback == "auto" and tp == 1 and jax.default_backend() == "gpu":  # the row must test the stream reader
        assert engine.token_readback == "stream", engine.token_readback
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
        want = tokens(one, prompts, 12, fused=False, cublas=0, readback="jax")
        rows = [("tp1 fused", tokens(one, prompts, 12)), ("tp1 unfused cublas", tokens(one, prompts, 12, fused=False)),
                ("tp1 fused no-cublas", tokens(one, prompts, 12, cublas=0)),
                ("tp1 fused, jax readback", tokens(one, prompts, 12, readback="jax"))]
        if jax.device_count() >= 2:
            two = load_params(tiny_checkpoint_path(name), "float32", use_cache=False, tensor_parallel_size=2)
            rows += [("tp2 fused", tokens(two, prompts, 12, tp=2)), ("tp2 unfused", tokens(two, prompts, 12, tp=2, fused=False))]
        for label, got in rows:
            same = got == want
            bad += not same
            print(f"{name} float32 {label:25s} vs tp1 unfused no-cublas jax-readback: {'identical' if same else 'DIFFERENT'}", flush=True)
    if not args.tiny_only:
        params = benchmark_params("qwen3-0.6b")
        a = tokens(params, prompts, 32, dtype="bfloat16", max_model_len=128)
        b = tokens(params, prompts, 32, fused=False, dtype="bfloat16", max_model_len=128)
        same = sum(x == y for x, y in zip(a, b))
        first = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None) for x, y in zip(a, b)]
        print(f"qwen3-0.6b bf16 fused vs unfused: {same}/{len(a)} requests identical; first differing token {first}")
    print("float32:", "all identical" if not bad else f"{bad} DIFFERENT")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
