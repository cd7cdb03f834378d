"""benchmarks/floor.py: the bytes and FLOPs a step and a workload must move, by hand on known shapes."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.workloads import QWEN3_0_6B

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("floor", ROOT / "benchmarks" / "floor.py")
floor = sys.modules.setdefault("floor", importlib.util.module_from_spec(spec))  # dataclasses look it up
spec.loader.exec_module(floor)

CFG = types.SimpleNamespace(**QWEN3_0_6B)
H100ISH = floor.Device(read_bytes_per_s=3.35e12, matmul_flops_per_s=700e12, name="test")


def test_kv_bytes_per_token():
    assert floor.kv_bytes_per_token(CFG, jnp.bfloat16, 16) == 114_688  # 2 x 28 x 8 x 128 x 2 B
    # fp8: half, plus the block's scale row pro rata (one row per 64 slots)
    assert floor.kv_bytes_per_token(CFG, jnp.float8_e4m3fn, 64) == pytest.approx(57_344 * 65 / 64)


def test_decode_step_floor_batch_256():
    f = floor.step_floor(CFG, H100ISH, num_tokens=256, context_lens=[350] * 256, kv_dtype=jnp.bfloat16,
                         block_size=16)
    assert f.kv_read_bytes == 256 * 350 * 114_688  # ~10.3 GB
    params = 28 * (1024 * 4096 + 2048 * 1024 + 1024 * 6144 + 3072 * 1024) + 1024 * 151_936
    assert f.weight_bytes == 2 * params  # ~1.2 GB
    assert f.gemm_flops == 2 * 256 * params
    assert f.attention_seconds == pytest.approx(f.kv_read_bytes / 3.35e12)
    # each product is at its own bound: never below the whole weight read, never below all FLOPs
    assert f.gemm_seconds >= max(f.weight_bytes / 3.35e12, f.gemm_flops / 700e12) * (1 - 1e-9)
    assert f.seconds == pytest.approx(f.attention_seconds + f.gemm_seconds + f.epilogue_seconds)
    assert 3.4e-3 < f.seconds < 3.8e-3


def test_workload_floor_counts_every_context_token():
    prompts, outs = np.array([5, 100]), np.array([3, 7])
    f = floor.workload_floor(CFG, H100ISH, prompts, outs, kv_dtype=jnp.bfloat16, block_size=16, decode_steps=7)
    ctx = sum(p + i + 1 for p, o in zip(prompts, outs) for i in range(o))  # token i reads p + i + 1 positions
    assert f["kv_read_bytes"] == 114_688 * ctx
    assert f["seconds"] == pytest.approx(f["prefill_s"] + f["decode_s"])


@pytest.mark.parametrize("name,group", [
    ("ragged_paged_attention_m16_k64_p1", "attention"), ("nvjet_sm90_tst_64x32_64x16_1x2_h_bx_NNT", "gemm"),
    ("gemv_n128_k256_s4_w4_p3", "gemm"), ("qkv_epilogue_t8", "epilogue"), ("gumbel_argmax_b4096_s4", "other"),
    ("loop_multiply_fusion", "other"), ("add_rms_norm_p4", "other")])
def test_kernel_groups(name, group):
    assert floor.kernel_group(name) == group


def test_floor_table_percentages():
    f = floor.step_floor(CFG, H100ISH, num_tokens=256, context_lens=[350] * 256, kv_dtype=jnp.bfloat16,
                         block_size=16)
    rows = {r["group"]: r for r in floor.floor_table(f, {"attention": 2 * f.attention_seconds}, 2 * f.seconds)}
    assert rows["attention"]["pct_of_floor"] == pytest.approx(50)
    assert rows["step"]["pct_of_floor"] == pytest.approx(50)
    assert rows["gemm"]["pct_of_floor"] is None  # no time measured for it


def test_moe_layer_floor_counts_each_hit_expert_once():
    """bench_moe's floor at Qwen3-30B-A3B shapes: the distinct experts' weights once, whatever the rows."""
    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "benchmarks" / "bench_moe.py")
    bench_moe = sys.modules.setdefault("bench_moe", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(bench_moe)
    shape = bench_moe.MoeShape(hidden=2048, intermediate=768, experts=128, top_k=8)
    one = shape.floor(tokens=1, distinct=8, itemsize=2)
    assert one["gate_up"][0] == 8 * 2048 * 1536 * 2 + 8 * (2048 + 1536) * 2
    assert one["down"][1] == 2 * 8 * 768 * 2048
    batch = shape.floor(tokens=256, distinct=128, itemsize=2)
    assert batch["gate_up"][0] - 256 * 8 * (2048 + 1536) * 2 == 128 * 2048 * 1536 * 2  # all 128 experts, once
    assert batch["moe"][1] == batch["gate_up"][1] + batch["down"][1] + 2 * 256 * 2048 * 128


def test_moe_tile_configurations_are_timed_against_their_products_floors(tmp_path):
    """``bench_moe --configs``: each fixed-tile configuration times both grouped GEMMs, each against the
    floor of the product it computes (the tiny shapes, interpret mode)."""
    spec = importlib.util.spec_from_file_location("bench_moe", ROOT / "benchmarks" / "bench_moe.py")
    bench_moe = sys.modules.setdefault("bench_moe", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(bench_moe)
    cfg = bench_moe.parse_configs("16x32x16x4x2")[0]
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages) == (16, 32, 16, 4, 2)
    (row,) = bench_moe.main(["--tiny", "--tokens", "4", "--repeats", "1", "--layers", "1",
                             "--configs", "16x32x16x4x2", "--out", str(tmp_path)])
    for product in ("gate_up", "down"):
        timed = row[f"{product}@16x32x16x4x2"]
        assert timed["floor_us"] == row[product]["floor_us"] and timed["us"] > 0
