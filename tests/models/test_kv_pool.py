"""The KV pool's owner (``models/kv_pool.py``). How many blocks a pool gets without ``num_blocks``: what
``memory_fraction`` of the device leaves after the weights, capped by what the engine's sequences can use, so
a small model on a large GPU starts with a small pool."""

from __future__ import annotations

import types

import pytest

from jaxpaged import EngineConfig, QwenConfig
from jaxpaged.models import kv_pool as pool_size

QWEN3_06B = QwenConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960)
TINY = QwenConfig(model_type="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def _device(platform, stats):
    return types.SimpleNamespace(platform=platform, memory_stats=lambda: stats)


def test_free_memory_is_the_share_of_the_allocator_limit_minus_its_use():
    gpu = _device("gpu", {"bytes_limit": 100, "bytes_in_use": 30})
    assert pool_size.free_device_memory(gpu) == 70
    assert pool_size.free_device_memory(gpu, 0.9) == 60  # large weights keep the 10% working room
    assert pool_size.free_device_memory(_device("gpu", {"bytes_limit": 100, "bytes_in_use": 95}), 0.9) == -5
    assert pool_size.free_device_memory(_device("cpu", None)) is None


@pytest.mark.parametrize("cfg, max_len, capped", [(TINY, 128, True), (QWEN3_06B, 4096, False)])
def test_gpu_pool_takes_free_memory_up_to_what_its_sequences_can_use(monkeypatch, cfg, max_len, capped):
    gib = 1 << 30
    monkeypatch.setattr(pool_size, "free_device_memory", lambda d, fraction: 100 * gib)  # an H200 after the weights
    params = types.SimpleNamespace(config=cfg, mesh=None)
    config = EngineConfig(max_model_len=max_len)
    blocks = pool_size.size_pool(params, config, max_len, "bfloat16")
    bs = config.resolved_block_size(cfg.head_dim)
    by_memory = 100 * gib // (cfg.kv_bytes_per_token(2) * bs)
    cap = pool_size.GPU_POOL_CAP_SEQUENCES * config.max_num_seqs * (max_len // bs)
    assert blocks == (cap if capped else by_memory)
    assert blocks == min(by_memory, cap)
    if capped:  # the tiny model: 8,192 blocks instead of millions
        assert blocks == 4 * 256 * 8 and by_memory > 1_000_000
    assert pool_size.size_pool(params, EngineConfig(num_blocks=7), max_len, "bfloat16") == 7  # as given


def test_weights_past_the_memory_share_leave_no_pool_and_a_clear_error(monkeypatch):
    """Qwen3-30B-A3B's 57 GiB of weights under a 59 GiB allocator limit at ``memory_fraction=0.9``: no
    blocks (the step keeps its working memory), and the engine's check names the settings to change."""
    gpu = _device("gpu", {"bytes_limit": 59 << 30, "bytes_in_use": 57 << 30})
    monkeypatch.setattr(pool_size.jax, "devices", lambda: [gpu])
    params = types.SimpleNamespace(config=QWEN3_06B, mesh=None)
    assert pool_size.size_pool(params, EngineConfig(max_model_len=2048), 2048, "bfloat16") == 0
    with pytest.raises(ValueError, match="got no block.*memory_fraction"):
        pool_size.check_holds_one_sequence(0, 16, 2048)


def test_an_engine_without_a_block_or_with_a_tiny_gpu_pool_is_an_error_naming_the_settings(monkeypatch):
    """Through the engine, default max_model_len: no block is refused (not shrunk to a 0-token model), and
    on a GPU a pool below the default max_model_len is refused rather than silently shortened."""
    from jaxpaged import LLMEngine
    from jaxpaged.engine import llm_engine
    from jaxpaged.workloads import benchmark_params

    params = benchmark_params("tiny")
    monkeypatch.setattr(llm_engine, "size_pool", lambda *a, **k: 0)
    with pytest.raises(ValueError, match="got no block"):
        LLMEngine(params, EngineConfig(compilation_cache=False))
    monkeypatch.setattr(llm_engine, "size_pool", lambda *a, **k: 2)
    monkeypatch.setattr(llm_engine.jax, "default_backend", lambda: "gpu")
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        LLMEngine(params, EngineConfig(compilation_cache=False))

def test_an_fp8_pool_holds_about_twice_the_tokens_in_the_same_memory(monkeypatch):
    """Qwen3-0.6B on 100 GiB free, each pool at its default block size: an fp8 pool (one byte an
    element plus a scale row a block of 64) holds 2 * 64/65 times the tokens of a bf16 pool (blocks of 16)."""
    monkeypatch.setattr(pool_size, "free_device_memory", lambda d, fraction: 100 << 30)
    params = types.SimpleNamespace(config=QWEN3_06B, mesh=None)
    config = EngineConfig(max_model_len=4096, kv_cache_dtype="fp8")
    bf16 = pool_size.size_pool(params, EngineConfig(max_model_len=4096), 4096, "bfloat16")
    fp8 = pool_size.size_pool(params, config, 4096, config.resolved_kv_cache_dtype("bfloat16"))
    assert config.resolved_kv_cache_dtype("bfloat16") == "float8_e4m3fn"
    assert fp8 == (100 << 30) // (QWEN3_06B.kv_bytes_per_token(1) * 65)
    assert abs(fp8 * 64 / (bf16 * 16) - 2 * 64 / 65) < 1e-4


FP8_BLOCK_BYTES = QWEN3_06B.kv_bytes_per_token(1) * 65  # Qwen3-0.6B, fp8, a block of 64 slots + its scale row


def test_an_fp8_pool_of_2_to_4_gib_is_sized_like_any_other(monkeypatch):
    """16 sequences of 1,024 tokens: the cap (4 x 16 x 16 blocks) makes a 3.55 GiB fp8 pool, more than
    2**31 one-byte elements, which the kernels address with 64-bit offsets (``kv_write.widen_triton_offsets``):
    the cap is kept, and a ``num_blocks`` in that range is taken as given."""
    monkeypatch.setattr(pool_size, "free_device_memory", lambda d, fraction: 100 << 30)
    params = types.SimpleNamespace(config=QWEN3_06B, mesh=None)
    config = EngineConfig(max_model_len=1024, max_num_seqs=16, kv_cache_dtype="fp8")
    assert 2**31 < 4 * 16 * 16 * FP8_BLOCK_BYTES <= 2**32
    assert pool_size.size_pool(params, config, 1024, "float8_e4m3fn") == 4 * 16 * 16
    n = 2**31 // FP8_BLOCK_BYTES + 100
    assert pool_size.size_pool(params, EngineConfig(num_blocks=n, kv_cache_dtype="fp8"), 1024, "float8_e4m3fn") == n
