"""fp8 weights (``quantization="fp8"``): Qwen's FP8 checkpoint format loaded as it is, bf16/f32 checkpoints
quantized at load, the param cache, and the memory they take.

``write_fp8_checkpoint`` writes a checkpoint the way Qwen publishes its ``-FP8`` models: every linear
weight e4m3 with a ``weight_scale_inv`` per 128 x 128 block (partial blocks where the tiny model's dims
are not multiples of 128), ``quantization_config`` in ``config.json``; embeddings and norms as they were.
"""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpaged import LLM, EngineConfig, LLMEngine, SamplingParams
from jaxpaged.kernels.grouped_matmul import (fp8_supported, fp8_tile, grouped_matmul, grouped_matmul_fixed_tile,
                                             grouped_matmul_reference)
from jaxpaged.kernels.matmul import MatmulConfig
from jaxpaged.llm import run_to_completion
from jaxpaged.models.checkpoint import load_params
from jaxpaged.models.convert import read_hf_tensors
from jaxpaged.models.config import CheckpointError
from jaxpaged.models.kv_pool import init_kv_pool
from jaxpaged.models.quantization import (FP8_MAX, Fp8Config, Fp8Weight, accepting_fp8, dequantize,
                                          expand_block_scale, fp8_grouped_matmul, fp8_matmul,
                                          from_quantization_config, quantize_per_channel)
from jaxpaged.models.ops import (fp8_tiled_or_grouped, fused_add_rms_norm, fused_qkv, gemv_or_xla_matmul, matmul_parts,
                                 silu_mul_matmul_parts)
from jaxpaged.models.qwen import DEFAULT_OPS, ModelOps, xla_matmul
from jaxpaged.models.safetensors_io import write_safetensors
from jaxpaged.models.tiny import tiny_checkpoint_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the model checks' helpers
from paged_forward import build_chunk_step, forward_all_logits  # noqa: E402

BLOCK = (128, 128)
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": list(BLOCK)}
# Relative L2 error of the logits, fp8 per-channel weights against the same model's, on the tiny random
# checkpoints (docs/NUMERICS.md: at most 0.158 over Qwen2 and Qwen3, bf16 and f32, four 24-token prompts;
# the weights themselves 2.6% rms). A wrong scale or layout is off by ~1.
FP8_LOGITS_BOUND = 0.2


def quantize_blocks(w: np.ndarray, block: tuple[int, int] = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``w [out, in]`` -> e4m3 ``[out, in]`` and ``scale_inv f32[ceil(out/128), ceil(in/128)]`` (``amax/448`` per
    block), as Qwen's FP8 checkpoints store their linear weights."""
    bo, bi = block
    nb_o, nb_i = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    scale = np.ones((nb_o, nb_i), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(nb_o):
        for j in range(nb_i):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].astype(np.float32)
            amax = np.abs(blk).max()
            scale[i, j] = amax / FP8_MAX if amax > 0 else 1.0
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = np.clip(blk / scale[i, j], -FP8_MAX, FP8_MAX)
    return q, scale


def dequantize_blocks(q: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = BLOCK) -> np.ndarray:
    """numpy's reference: each 128 x 128 block of ``q`` times its scale, in float32."""
    rows = np.arange(q.shape[0]) // block[0]
    cols = np.arange(q.shape[1]) // block[1]
    return q.astype(np.float32) * scale_inv[rows][:, cols]


def copy_checkpoint(src: Path, dest: Path, tensors: dict, quantization_config: dict | None) -> Path:
    """``src``'s config and tokenizer files at ``dest`` with ``tensors`` as one ``model.safetensors``."""
    dest.mkdir()
    for f in src.iterdir():
        if f.suffix not in (".safetensors", ".npz") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dest / f.name)
    write_safetensors(dest / "model.safetensors", tensors)
    if quantization_config is not None:
        raw = json.loads((dest / "config.json").read_text())
        raw["quantization_config"] = quantization_config
        (dest / "config.json").write_text(json.dumps(raw))
    return dest


def write_fp8_checkpoint(src: Path, dest: Path, block: tuple[int, int] = BLOCK) -> tuple[Path, Path]:
    """``src`` as Qwen's FP8 format at ``dest`` (``block``: Qwen's 128 x 128), and at ``dest``-dequantized the
    same model in float32 with the weights numpy dequantizes from it (the reference)."""
    fp8, ref = {}, {}
    for name, t in read_hf_tensors(src).items():
        if name.endswith(".weight") and name.split(".")[-2] in LINEAR:  # a MoE layer's experts too, not its router
            q, scale = quantize_blocks(np.asarray(t), block)
            fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"] = q, scale
            ref[name] = dequantize_blocks(q, scale, block)
        else:
            fp8[name] = ref[name] = np.asarray(t)
    return (copy_checkpoint(src, dest, fp8, dict(QUANTIZATION_CONFIG, weight_block_size=list(block))),
            copy_checkpoint(src, dest.with_name(dest.name + "-dequantized"), ref, None))


def logits(params, prompt: list[int], ops: ModelOps = DEFAULT_OPS) -> np.ndarray:
    """The model's logits at every position of ``prompt`` (one prefill through the paged path)."""
    step = build_chunk_step([(prompt, 0, list(range(4)))], 8, width=4)
    pool = init_kv_pool(params.config, 8, 8, jnp.dtype(params.dtype))
    out, _ = forward_all_logits(params.graphdef, params.state, pool, step.token_ids, step.positions, step.meta,
                                ops=ops)
    return np.asarray(out, np.float32)[: len(prompt)]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def linear_bytes(params) -> int:
    """Bytes of the layers' projections and their scales (embeddings and norms apart)."""
    leaves = jax.tree_util.tree_flatten_with_path(params.state)[0]
    return sum(leaf.nbytes for path, leaf in leaves if "proj" in jax.tree_util.keystr(path))


PROMPT = [int(t) for t in np.random.default_rng(0).integers(1, 512, 24)]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    return write_fp8_checkpoint(tiny_checkpoint_path("qwen3"), tmp_path_factory.mktemp("fp8") / "qwen3-fp8")


def test_fp8_checkpoint_matches_numpy_dequantized_reference(fp8_checkpoint):
    """Qwen's format loads as it is (e4m3 weights, block scales expanded, partial blocks included) and
    computes what the numpy-dequantized float32 model computes."""
    fp8_path, ref_path = fp8_checkpoint
    params = load_params(fp8_path, "float32", use_cache=False)
    assert params.quantization == Fp8Config(weight_block_size=BLOCK)  # inferred from config.json
    attn = params.state["layers"][0]["attn"]
    assert attn["qkv_proj"][...].dtype == jnp.float8_e4m3fn and attn["qkv_proj_block_scale"][...].shape == (1, 256)
    assert params.state["layers"][0]["mlp"]["down_proj_block_scale"][...].shape == (2, 128)  # in = 256: 2 blocks
    assert params.state["embed_tokens"][...].dtype == jnp.float32
    ref = load_params(ref_path, "float32", use_cache=False)
    assert rel_err(logits(params, PROMPT), logits(ref, PROMPT)) < 1e-6  # (measured: bitwise equal)


@pytest.fixture(scope="module")
def bf16_fp8():
    """The tiny Qwen3 checkpoint (float32) loaded as bf16 and quantized at load."""
    return load_params(tiny_checkpoint_path("qwen3"), "bfloat16", use_cache=False, quantization="fp8")


def test_quantized_at_load_within_the_bound_and_half_the_bytes(bf16_fp8):
    """A checkpoint with ``quantization="fp8"``: per-channel scales, logits within the documented bound of
    the unquantized model's, the projections in half the bytes of bf16."""
    base = load_params(tiny_checkpoint_path("qwen3"), "bfloat16", use_cache=False)
    assert bf16_fp8.quantization == Fp8Config() and base.quantization is None
    assert rel_err(logits(bf16_fp8, PROMPT), logits(base, PROMPT)) < FP8_LOGITS_BOUND
    # A byte a weight and 4 a column (K >= 128 rows here; 1,024+ in real models: 0.502x bf16)
    ratio = linear_bytes(bf16_fp8) / linear_bytes(base)
    assert ratio <= (1 + 4 / 128) / 2, ratio
    assert bf16_fp8.state["embed_tokens"][...].dtype == jnp.bfloat16


def test_per_channel_quantization_error_is_half_an_e4m3_step():
    """Every weight within half a step of e4m3 (3 mantissa bits: 2**-4 relative) or of its smallest
    subnormal step (2**-10 of the column's scale); the product scaled after the dot equals the
    dequantized weight's."""
    w = jax.random.normal(jax.random.key(0), (256, 96), jnp.float32) * jnp.linspace(0.01, 3, 96)
    w = w.at[:, 5].set(0.0)  # an all-zero column: scale 1, exact
    q, scale = quantize_per_channel(w)
    fp8 = Fp8Weight(q, scale, jnp.float32)
    deq = dequantize(fp8)
    assert bool(jnp.all(jnp.abs(deq - w) <= 2.0 ** -4 * jnp.abs(w) + 2.0 ** -10 * scale))
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == FP8_MAX
    x = jax.random.normal(jax.random.key(1), (5, 256), jnp.float32)
    assert rel_err(np.asarray(fp8_matmul(x, fp8, matmul=xla_matmul)), np.asarray(xla_matmul(x, deq))) < 1e-6
    # Any array matmul of the ops (batch_invariant=True's kernel is wrapped so) takes it the same way.
    plain = accepting_fp8(lambda x, w, out_dtype=None: jnp.matmul(x, w, precision="highest",
                                                                   preferred_element_type=out_dtype))
    assert rel_err(np.asarray(plain(x, fp8)), np.asarray(xla_matmul(x, deq))) < 1e-6


def test_block_scale_expansion_handles_partial_blocks():
    scale_inv = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)  # out 130 (2 blocks), in 200 (2 blocks)
    e = expand_block_scale(scale_inv, 130, 200, BLOCK)
    assert e.shape == (130, 25)  # gcd(128, 200) = 8 input columns a scale
    assert e[0, 15] == 1.0 and e[0, 16] == 2.0 and e[128, 0] == 3.0 and e[129, 24] == 4.0
    with pytest.raises(CheckpointError, match="expected"):
        expand_block_scale(scale_inv[:1], 130, 200, BLOCK)


def test_orbax_cache_round_trips_fp8_weights_and_scales(fp8_checkpoint, tmp_path):
    for path, quantization in ((fp8_checkpoint[0], None), (tiny_checkpoint_path("qwen3"), "fp8")):
        first = load_params(path, cache_dir=tmp_path, quantization=quantization)
        second = load_params(path, cache_dir=tmp_path, quantization=quantization)
        assert not first.from_cache and second.from_cache
        a, b = jax.tree.leaves(first.state), jax.tree.leaves(second.state)
        assert [x.dtype for x in a] == [y.dtype for y in b] and jnp.float8_e4m3fn in [x.dtype for x in a]
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    assert not load_params(tiny_checkpoint_path("qwen3"), cache_dir=tmp_path).from_cache  # not the fp8 copy


def test_llm_generates_with_fp8_weights_and_the_engine_refuses_unquantized_ones():
    settings = dict(quantization="fp8", num_blocks=16, block_size=8, max_model_len=64, max_num_seqs=2,
                    max_num_batched_tokens=32, compilation_cache=False)
    llm = LLM(tiny_checkpoint_path("qwen3"), dtype="float32", warmup=False, **settings)
    assert llm.params.quantization == Fp8Config()
    out = llm.generate([PROMPT[:9]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="not quantized"):
        LLMEngine(load_params(tiny_checkpoint_path("qwen3"), "float32", load_format="dummy"), EngineConfig(**settings))


def test_quantization_settings_are_checked(fp8_checkpoint):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="awq")
    with pytest.raises(ValueError, match="quantization"):
        load_params(tiny_checkpoint_path("qwen3"), use_cache=False, quantization="int8")
    with pytest.raises(CheckpointError, match="not supported"):
        from_quantization_config({"quant_method": "gptq"})
    with pytest.raises(CheckpointError, match="block-wise"):
        from_quantization_config({"quant_method": "fp8", "activation_scheme": "static"})


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (the suite forces 4 CPU devices without a GPU)")
def test_fp8_checkpoint_splits_its_block_scales_with_its_weights(fp8_checkpoint, tmp_path):
    """``tensor_parallel_size=2``: every shard's e4m3 rows or columns come with their scales, so each
    shard's dequantized weight (what its step multiplies by) is that shard of the numpy reference's.
    32 x 32 blocks: the tiny model's 128-row o_proj split in two keeps them whole; 128 x 128 does not."""
    fp8_path, ref_path = write_fp8_checkpoint(tiny_checkpoint_path("qwen3"), tmp_path / "fp8-32", (32, 32))
    fp8 = load_params(fp8_path, "float32", use_cache=False, tensor_parallel_size=2)
    ref = load_params(ref_path, "float32", use_cache=False, tensor_parallel_size=2)
    for module, name in (("attn", "qkv_proj"), ("attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj")):
        w, scale = (fp8.state["layers"][1][module][name + k][...] for k in ("", "_block_scale"))
        per_shard = jax.shard_map(lambda w, s: dequantize(Fp8Weight(w, s, jnp.float32)), mesh=fp8.mesh,
                                  in_specs=(w.sharding.spec, scale.sharding.spec), out_specs=w.sharding.spec)
        assert w.sharding.spec == scale.sharding.spec and len(scale.sharding.device_set) == 2
        np.testing.assert_array_equal(per_shard(w, scale), ref.state["layers"][1][module][name][...])
    with pytest.raises(ValueError, match="scale blocks"):
        load_params(fp8_checkpoint[0], use_cache=False, tensor_parallel_size=2)


def test_gpu_ops_take_fp8_weights(bf16_fp8):
    """The GPU's op set (GEMV, qkv epilogue, add + RMSNorm: interpret mode) takes fp8 weights where it takes
    bf16 ones (through XLA's dequantizing matmul: the GEMV reads no fp8) and computes what XLA's ops
    compute, on a decode step."""
    gpu = ModelOps(matmul=functools.partial(gemv_or_xla_matmul, interpret=True),
                   qkv_epilogue=functools.partial(fused_qkv, interpret=True),
                   matmul_parts=functools.partial(matmul_parts, interpret=True),
                   silu_mul_matmul_parts=functools.partial(silu_mul_matmul_parts, interpret=True),
                   add_rms_norm=functools.partial(fused_add_rms_norm, interpret=True))
    assert rel_err(logits(bf16_fp8, PROMPT[:1], gpu), logits(bf16_fp8, PROMPT[:1])) < 1e-2


# ---- Qwen3-MoE: fp8 experts -----------------------------------------------------------------------
MOE = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_moe"


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_grouped_matmul_matches_the_dequantized_experts(per_channel):
    """Rows sorted by expert, an expert with no rows and two rows past the groups (another device's
    experts): each row is its expert's dequantized product; rows past the groups stay zero. The same
    through ``ragged_dot``, its dense reference and the fixed-tile kernel (interpret mode) of the
    converted experts, and through the fixed-tile kernel reading the e4m3 tiles and scales itself (per
    channel after the depth loop; block scales of 16 rows, one per 16-deep step); and the op a GPU's
    step uses reads the e4m3 tiles at every step size where the tiles allow."""
    rng = np.random.default_rng(3)
    e, k, n, sizes = 4, 64, 32, [3, 0, 4, 2]
    m = sum(sizes) + 2
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    if per_channel:
        w = Fp8Weight(*quantize_per_channel(jnp.asarray(rng.standard_normal((e, k, n)), jnp.float32)), jnp.float32)
        assert w.scale.shape == (e, n)
    else:
        q = jnp.asarray(rng.standard_normal((e, k, n)) * 100, jnp.float8_e4m3fn)
        w = Fp8Weight(q, jnp.asarray(rng.uniform(0.001, 0.01, (e, 4, n)), jnp.float32), jnp.float32)  # 16 rows a scale
    real = np.asarray(dequantize(w))
    want = np.zeros((m, n), np.float32)
    row = 0
    for g, size in enumerate(sizes):
        want[row:row + size] = np.asarray(x[row:row + size]) @ real[g]
        row += size
    group_sizes = jnp.asarray(sizes, jnp.int32)
    for gm in (grouped_matmul, grouped_matmul_reference,
               functools.partial(grouped_matmul_fixed_tile, interpret=True)):
        got = np.asarray(fp8_grouped_matmul(x, w, group_sizes, grouped_matmul=gm))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert not got[-2:].any()
    small = MatmulConfig(block_m=16, block_n=16, block_k=16)
    assert fp8_supported(x, w.weight, w.scale, small)
    got = np.asarray(grouped_matmul_fixed_tile(x, w.weight, group_sizes, w.scale, config=small, interpret=True))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[-2:].any()
    assert not fp8_supported(x, w.weight, w.scale, MatmulConfig(block_m=16, block_n=16, block_k=32)) or per_channel
    assert not fp8_supported(x, w.weight[:, :, :24], w.scale[..., :24], small)  # a partial column tile

    def kernels(rows):  # which path the GPU's op takes for a step of ``rows`` rows (traced, not run)
        xs = jax.ShapeDtypeStruct((rows, k), jnp.float32)
        return str(jax.make_jaxpr(lambda x: fp8_tiled_or_grouped(x, w, group_sizes))(xs))

    # The e4m3 tiles read as they are at every step size; the float32 default tiles step 32 deep, so over
    # 16-row block scales the kernel steps 16 deep (one scale row a step).
    for rows in (16, 4 * 64 + 1):
        assert "fixed_tile_grouped_matmul_fp8" in kernels(rows) and "ragged_dot" not in kernels(rows), rows
        assert ("_k32" if per_channel else "_k16") in kernels(rows), rows


@pytest.fixture(scope="module")
def moe_fp8_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """The 6-expert top-4 fixture in Qwen's FP8 format with 8 x 8 blocks (several scales per expert)."""
    return write_fp8_checkpoint(MOE / "e6_k4_norm", tmp_path_factory.mktemp("moe-fp8") / "moe-fp8", (8, 8))


def test_moe_fp8_checkpoint_matches_numpy_dequantized_reference(moe_fp8_checkpoint):
    """Qwen3-MoE's FP8 format (every expert's projections e4m3 with block scales, the router as it was)
    loads as it is and computes what the numpy-dequantized float32 model computes, through the engine
    too (chunked prefill, preemption, a prefix-cache hit): the same greedy tokens."""
    fp8_path, ref_path = moe_fp8_checkpoint
    params = load_params(fp8_path, "float32", use_cache=False)
    mlp = params.state["layers"][0]["mlp"]
    assert mlp["experts_gate_up"][...].dtype == jnp.float8_e4m3fn and mlp["gate"][...].dtype == jnp.float32
    assert mlp["experts_gate_up_block_scale"][...].shape == (6, 4, 32)  # H = 32 in blocks of 8
    assert mlp["experts_down_block_scale"][...].shape == (6, 2, 32)  # moe_intermediate_size 16
    ref = load_params(ref_path, "float32", use_cache=False)
    assert rel_err(logits(params, PROMPT[:12]), logits(ref, PROMPT[:12])) < 1e-6
    prompts = [[int(t) for t in np.random.default_rng(i).integers(1, 128, n)] for i, n in enumerate((30, 9, 21))]
    prompts.append(prompts[0][:24] + [5, 6])
    config = EngineConfig(kv_cache_dtype="float32", block_size=8, num_blocks=12, max_model_len=64,
                          max_num_batched_tokens=16, max_num_seqs=4, attention_backend="reference",
                          compilation_cache=False)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name, p in (("fp8", params), ("ref", ref)):
        engine = LLMEngine(p, config)
        outs[name] = run_to_completion(engine, prompts, greedy)
        assert engine.stats()["preemptions"] > 0 and outs[name][3].num_cached_tokens == 24
    assert [o.outputs[0].token_ids for o in outs["fp8"]] == [o.outputs[0].token_ids for o in outs["ref"]]


def test_moe_quantized_at_load_within_the_bound_and_half_the_bytes():
    """``quantization="fp8"`` on a bf16 Qwen3-MoE load: the experts per expert and output channel
    (``[E, N]`` scales), the router kept; logits within the documented bound of the bf16 model's."""
    base = load_params(MOE / "e4_k2_norm", "bfloat16", use_cache=False)
    fp8 = load_params(MOE / "e4_k2_norm", "bfloat16", use_cache=False, quantization="fp8")
    moe_layer = next(i for i, layer in enumerate(fp8.state["layers"].values()) if "experts_down" in layer["mlp"])
    mlp = fp8.state["layers"][moe_layer]["mlp"]
    assert mlp["experts_gate_up_scale"][...].shape == (4, 32) and mlp["gate"][...].dtype == jnp.bfloat16
    w = mlp["experts_down"][...]
    assert w.dtype == jnp.float8_e4m3fn
    assert rel_err(logits(fp8, PROMPT[:12]), logits(base, PROMPT[:12])) < FP8_LOGITS_BOUND
    experts = sum(fp8.state["layers"][moe_layer]["mlp"][k][...].nbytes
                  for k in ("experts_gate_up", "experts_gate_up_scale", "experts_down", "experts_down_scale"))
    base_experts = sum(base.state["layers"][moe_layer]["mlp"][k][...].nbytes for k in ("experts_gate_up", "experts_down"))
    assert experts / base_experts <= (1 + 4 / 16) / 2  # a byte a weight, 4 a column of 16 or 32 rows


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (the suite forces 4 CPU devices without a GPU)")
def test_moe_fp8_experts_split_with_their_scales(moe_fp8_checkpoint):
    """``tensor_parallel_size=2``: each device holds whole experts with their scales (block scales from the
    checkpoint, per-channel ones quantized at load), so each shard's dequantized experts are that shard of
    the unsplit model's."""
    for path, quantization, suffix in ((moe_fp8_checkpoint[0], None, "_block_scale"),
                                       (MOE / "e6_k4_norm", "fp8", "_scale")):
        split = load_params(path, "float32", use_cache=False, tensor_parallel_size=2, quantization=quantization)
        whole = load_params(path, "float32", use_cache=False, quantization=quantization)
        for name in ("experts_gate_up", "experts_down"):
            w, scale = (split.state["layers"][1]["mlp"][name + k][...] for k in ("", suffix))
            per_shard = jax.shard_map(lambda w, s: dequantize(Fp8Weight(w, s, jnp.float32)), mesh=split.mesh,
                                      in_specs=(w.sharding.spec, scale.sharding.spec), out_specs=w.sharding.spec)
            assert w.sharding.spec[0] == scale.sharding.spec[0] == "tp" and len(scale.sharding.device_set) == 2
            m = whole.state["layers"][1]["mlp"]
            np.testing.assert_array_equal(per_shard(w, scale), dequantize(Fp8Weight(m[name][...], m[name + suffix][...],
                                                                                    jnp.float32)))


def test_fp8_grouped_kernel_lowers_for_hopper_with_unmasked_weight_loads(sm90_triton_modules):
    """The fixed-tile grouped kernel over e4m3 experts (Qwen3-30B-A3B's gate/up, 4 of its experts) lowered to
    Triton IR for an sm_90 GPU, without one: each e4m3 tile is one load without mask or fill value, per
    channel and with 128-row block scales."""
    modules = sm90_triton_modules
    s = jax.ShapeDtypeStruct
    x, w, sizes = s((64, 2048), jnp.bfloat16), s((4, 2048, 1536), jnp.float8_e4m3fn), s((4,), jnp.int32)
    for scale in (s((4, 1536), jnp.float32), s((4, 16, 1536), jnp.float32)):
        modules.clear()
        jax.jit(grouped_matmul_fixed_tile).trace(x, w, sizes, scale).lower(lowering_platforms=("cuda",))
        loads = [line for line in modules[0].splitlines() if "tt.load" in line and "f8E4M3FN" in line]
        # one pointer operand: a masked load would print ``tt.load %ptr, %mask, %other``
        assert len(loads) == 1 and "," not in loads[0].split("tt.load")[1].split(":")[0], loads


def test_fp8_experts_through_the_decode_tile(sm90_triton_modules):
    """``by_rows`` over a decode step's few rows an expert: e4m3 experts (per channel, 128-row and 64-row
    block scales) read by the decode tile (16 x 64 x 128, 64 deep over 64-row scales) give the dequantized
    product (interpret mode), and the kernel at Qwen3-30B-A3B's gate/up shapes lowers for an sm_90 GPU
    with that tile."""
    rng = np.random.default_rng(7)
    sizes = [2, 0, 3, 1]
    x = jnp.asarray(rng.standard_normal((8, 256)), jnp.bfloat16)
    w32 = jnp.asarray(rng.standard_normal((4, 256, 128)), jnp.float32)
    block = [Fp8Weight(jnp.asarray(w32 * 50, jnp.float8_e4m3fn),
                       jnp.asarray(rng.uniform(0.001, 0.01, (4, rows, 128)), jnp.float32), jnp.bfloat16)
             for rows in (2, 4)]  # 128 and 64 rows a scale: the tile steps 128, then 64 deep
    for w in [Fp8Weight(*quantize_per_channel(w32), jnp.bfloat16)] + block:
        cfg = fp8_tile(x, w.weight, w.scale, by_rows=True)
        assert (cfg.block_m, cfg.block_n, cfg.block_k) == (16, 64, min(128, 256 // w.scale.shape[1]) if w.scale.ndim == 3
                                                           else 128)
        got = np.asarray(grouped_matmul_fixed_tile(x, w.weight, jnp.asarray(sizes, jnp.int32), w.scale, by_rows=True,
                                                   interpret=True), np.float64)
        want = np.asarray(grouped_matmul_reference(x.astype(jnp.float32), dequantize(w).astype(jnp.float32),
                                                   jnp.asarray(sizes, jnp.int32)), np.float64)
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-2
        assert not got[sum(sizes):].any()
    s = jax.ShapeDtypeStruct
    jax.jit(grouped_matmul_fixed_tile, static_argnames="by_rows").trace(
        s((64, 2048), jnp.bfloat16), s((128, 2048, 1536), jnp.float8_e4m3fn), s((128,), jnp.int32),
        s((128, 16, 1536), jnp.float32), by_rows=True).lower(lowering_platforms=("cuda",))
    (module,) = sm90_triton_modules
    assert "fixed_tile_grouped_matmul_fp8_m16_n64_k128" in module


def test_moe_layer_with_fp8_experts_is_batch_invariant(random_moe_layer):
    """``batch_invariant`` ops over fp8 experts (the fixed-tile kernel reading e4m3, interpret mode): a
    token's MoE output is bitwise the same alone, in a batch of 20 and reversed, and within the e4m3 error of
    the bf16 experts' output."""
    from jaxpaged.models.moe import sparse_moe
    from jaxpaged.models.ops import get_model_ops

    x, router, gate_up, down = random_moe_layer(1, 20, 32, 16, 6, jnp.bfloat16, 0.3)
    k = 4
    fp8 = [Fp8Weight(*quantize_per_channel(w), jnp.dtype(jnp.bfloat16)) for w in (gate_up, down)]
    ops = get_model_ops(batch_invariant=True)
    moe = jax.jit(lambda rows, ws: sparse_moe(rows, router, *ws, top_k=k, norm_topk_prob=True, ops=ops))
    jaxpr = str(jax.make_jaxpr(lambda rows: sparse_moe(rows, router, *fp8, top_k=k, norm_topk_prob=True, ops=ops))(x))
    assert "fixed_tile_grouped_matmul_fp8" in jaxpr and "bf16[6,32,32] = convert_element_type" not in jaxpr  # never whole
    batch = np.asarray(moe(x, fp8).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(moe(x[7:8], fp8).astype(jnp.float32))[0], batch[7])
    np.testing.assert_array_equal(np.asarray(moe(x[::-1], fp8).astype(jnp.float32))[::-1], batch)
    assert rel_err(batch, np.asarray(moe(x, (gate_up, down)).astype(jnp.float32))) < 0.1
