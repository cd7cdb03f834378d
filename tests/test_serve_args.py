"""``jaxpaged serve``'s engine flags (vLLM's names) become ``LLM`` keyword arguments that ``EngineConfig``
accepts: nothing parsed is dropped on the way; ``LLM(...)`` takes vLLM's names as the flags do."""

from __future__ import annotations

from jaxpaged import EngineConfig
from jaxpaged.__main__ import build_parser, serve_llm_args


def test_serve_flags_reach_the_engine_config():
    args = build_parser().parse_args([
        "serve", "tiny", "--kv-offloading-size", "2.5", "--kv-cache-dtype", "fp8", "--max-model-len", "512",
        "--block-size", "32", "--num-blocks", "64", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
        "--gpu-memory-utilization", "0.5", "--seed", "3", "--attention-backend", "reference", "--quantization", "fp8"])
    kwargs = serve_llm_args(args)
    assert kwargs["kv_offloading_size"] == 2.5 and kwargs["memory_fraction"] == 0.5
    config = EngineConfig(**{k: v for k, v in kwargs.items() if k not in ("model", "dtype", "load_format")})
    assert (config.kv_offloading_size, config.kv_cache_dtype, config.max_model_len, config.block_size,
            config.num_blocks, config.max_num_seqs, config.max_num_batched_tokens, config.seed, config.quantization) == \
        (2.5, "fp8", 512, 32, 64, 8, 256, 3, "fp8")
    default = serve_llm_args(build_parser().parse_args(["serve", "tiny"]))
    assert default["kv_offloading_size"] == 0 and default["enable_prefix_caching"] is True


def test_llm_takes_vllms_names_and_refuses_a_setting_given_twice():
    import pytest

    from jaxpaged import LLM

    config = EngineConfig.from_kwargs(gpu_memory_utilization=0.5, num_gpu_blocks_override=64, max_model_len=128)
    assert (config.memory_fraction, config.num_blocks, config.max_model_len) == (0.5, 64, 128)
    with pytest.raises(TypeError, match="'gpu_memory_utilization' and 'memory_fraction' are the same setting"):
        LLM("no/such-model", gpu_memory_utilization=0.5, memory_fraction=0.4)  # refused before any loading
    with pytest.raises(TypeError, match="did you mean 'gpu_memory_utilization'"):
        LLM("no/such-model", gpu_memory_utilisation=0.5)


def test_every_engine_flag_reaches_llm_under_a_name_it_takes():
    import dataclasses

    kwargs = serve_llm_args(build_parser().parse_args(["serve", "tiny"]))
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(kwargs) - fields == {"model", "dtype", "load_format"}
