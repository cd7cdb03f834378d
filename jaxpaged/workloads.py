"""Standard workloads and random full-size models, shared by the benchmarks, experiments and CLI.

``nano_vllm_workload`` reproduces nano-vllm's ``bench.py`` exactly (``random.seed(0)``; per request a
prompt of ``randint(100, 1024)`` ids from ``randint(0, 10000)``; then ``max_tokens = randint(100,
1024)``, ``temperature=0.6``, ``ignore_eos=True``), so throughput numbers compare with published ones.
"""

from __future__ import annotations

import random

import jax

from .models.checkpoint import ModelParams
from .models.config import QwenConfig
from .sampling.sampler import SamplingParams

QWEN3_0_6B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                  num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  max_position_embeddings=40960, attention_bias=False, eos_token_id=151645,
                  architectures=["Qwen3ForCausalLM"])
QWEN2_5_0_5B = dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                    num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                    max_position_embeddings=32768, eos_token_id=151645, architectures=["Qwen2ForCausalLM"])

# Qwen2.5-7B(-Instruct)'s shapes: the design notes' "7B model" (random bf16 weights, ~15.2 GB, fit one H200).
QWEN2_5_7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                  num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  max_position_embeddings=32768, attention_bias=True, eos_token_id=151645,
                  architectures=["Qwen2ForCausalLM"])
# Qwen3-30B-A3B's shapes: 128 experts of which 8 run per token, every layer MoE (random bf16 weights, ~61 GB).
QWEN3_30B_A3B = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, max_position_embeddings=40960, attention_bias=False,
                     eos_token_id=151645, architectures=["Qwen3MoeForCausalLM"])
# The experiments' --model choices: "tiny" is the packaged tiny Qwen3 checkpoint (fp32, CPU-friendly).
EXPERIMENT_MODELS = {"tiny": None, "qwen3-0.6b": QWEN3_0_6B, "qwen2.5-7b": QWEN2_5_7B}
# Larger shapes for the tensor-parallel benchmark (benchmarks/bench_tp.py).
QWEN3_8B = dict(QWEN3_0_6B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
QWEN2_5_72B = dict(model_type="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                   num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, rope_theta=1000000.0,
                   rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768,
                   eos_token_id=151645, architectures=["Qwen2ForCausalLM"])


def nano_vllm_workload(num_seqs: int = 256, max_input_len: int = 1024, max_output_len: int = 1024,
                       seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts (token ids) and sampling params of nano-vllm's throughput benchmark."""
    random.seed(seed)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))]
               for _ in range(num_seqs)]
    sps = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, max_output_len))
           for _ in range(num_seqs)]
    return prompts, sps


def agent_workload(agents: int, prefix_len: tuple[int, int], question_len: tuple[int, int], requests: int,
                   vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """An agent workload: ``agents`` system prompts (``prefix_len`` tokens, a range), then ``requests``
    prompts, each a random agent's system prompt + a distinct question (``question_len`` tokens).
    Returns the prompts, each one's agent, and the system prompts."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, vocab) for _ in range(rng.randint(*prefix_len))] for _ in range(agents)]
    prompts, picks = [], []
    for _ in range(requests):
        picks.append(rng.randrange(agents))
        prompts.append(systems[picks[-1]] + [rng.randrange(1, vocab) for _ in range(rng.randint(*question_len))])
    return prompts, picks, systems


def random_model(raw_config: dict, dtype: str = "bfloat16", seed: int = 0,
                 tensor_parallel_size: int = 1, quantization: str | None = None) -> ModelParams:
    """A randomly initialised model of the given Hugging Face config (no download needed): weights
    normal * 0.02 and norms one (``models.sharding.random_state``), committed to the first device.

    ``tensor_parallel_size > 1``: created directly split over that many devices, never whole on one
    device (the same values as on one device). ``quantization="fp8"``: the linear weights then quantized
    at load (per output channel), as a bf16 checkpoint with ``LLM(path, quantization="fp8")``."""
    from .models.checkpoint import random_params
    from .models.quantization import resolve_quantization

    return random_params(QwenConfig.from_dict(raw_config), dtype, seed, tensor_parallel_size,
                         quantization=resolve_quantization(quantization, None))


def experiment_params(full: bool, model: str | None = None) -> ModelParams:
    """The experiments' model. ``model`` is a key of ``EXPERIMENT_MODELS``; ``None`` means
    ``qwen3-0.6b`` when ``full`` (random bf16 weights at Qwen3-0.6B shapes, for a GPU), else ``tiny``
    (the packaged tiny Qwen3 checkpoint in fp32, CPU-friendly)."""
    model = model or ("qwen3-0.6b" if full else "tiny")
    if model not in EXPERIMENT_MODELS:
        raise ValueError(f"model must be one of {sorted(EXPERIMENT_MODELS)}, got {model!r}")
    if model != "tiny":
        return random_model(EXPERIMENT_MODELS[model])
    from .models.checkpoint import load_params
    from .models.tiny import tiny_checkpoint_path

    return load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)


def params_bytes(params: ModelParams) -> int:
    """Bytes of the weights (every array of the NNX state)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params.state) if hasattr(x, "dtype"))


def device_memory() -> dict:
    """JAX's allocator statistics for device 0: ``bytes_in_use``, ``peak_bytes_in_use`` (process-wide,
    never reset) and ``bytes_limit``; each ``None`` where the backend keeps none (CPU).

    The engine's KV pool is allocated whole when the engine is made (``num_blocks`` or
    ``memory_fraction``), so these count the pool, not the KV a workload actually used: that comes
    from the block counters (``engine.stats()``: ``peak_blocks_used``, ``peak_kv_bytes_in_use``).
    """
    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


BENCHMARK_MODELS = ("qwen3-0.6b", "qwen2.5-7b", "qwen3-30b-a3b", "tiny")
_BENCHMARK_SHAPES = {"qwen3-0.6b": QWEN3_0_6B, "qwen2.5-7b": QWEN2_5_7B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def benchmark_params(model: str, quantization: str | None = None) -> ModelParams:
    """The benchmarks' ``--model``: ``qwen3-0.6b``, ``qwen2.5-7b`` or ``qwen3-30b-a3b`` (full-size shapes,
    random bf16 weights) or ``tiny`` (the packaged tiny checkpoint, for CPU runs). ``quantization="fp8"``:
    the linear weights (and a MoE model's experts) quantized at load (per output channel), as
    ``LLM(path, quantization="fp8")`` does."""
    if model in _BENCHMARK_SHAPES:
        return random_model(_BENCHMARK_SHAPES[model], quantization=quantization)
    if model == "tiny":
        from .models.checkpoint import load_params
        from .models.tiny import tiny_checkpoint_path

        if quantization is None:
            return experiment_params(full=False)
        return load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False, quantization=quantization)
    raise ValueError(f"--model must be one of {BENCHMARK_MODELS}, got {model!r}")


def output_divergence(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How ``other``'s token lists differ from ``reference``'s, request by request: the number of
    requests that differ and, for each, the first position where they diverge."""
    first = {}
    for i, (a, b) in enumerate(zip(reference, other, strict=True)):
        if a != b:
            first[i] = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return dict(num_requests=len(reference), num_differ=len(first), first_divergence=first)


def outputs_guaranteed_identical(dtype: str, batch_invariant: bool) -> bool:
    """Whether batching, caching and paging choices are promised not to change outputs: with
    ``batch_invariant`` always; in float32 too (IEEE dots: measured 0 changes on the H200, though
    only ``batch_invariant`` makes it bitwise by construction). Default bf16 is not (docs/NUMERICS.md)."""
    return batch_invariant or str(dtype) == "float32"
