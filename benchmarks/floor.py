"""The floor of a decode step and of a workload: the bytes they must move and the FLOPs they must do,
against the device's bandwidth and matmul rate measured in the same process.

A decode step must read every live token's K/V (by the pool's dtype: an fp8 pool's bytes include its
scale row) and every weight once, write each new token's K/V, and do ``2 x params`` FLOPs per token;
nothing faster is possible on the device measured. The floor of a stretch of work is its bytes over the
read bandwidth, or its FLOPs over the matmul rate where that is longer (prefill). Kernels are grouped by
what they do (:func:`kernel_group`), so a profile says how far each group is from its own floor:

* ``attention``: reads the KV of every sequence (its floor: KV bytes / bandwidth);
* ``gemm``: the projections, MLP and LM head (``max(weight bytes / bandwidth, FLOPs / matmul rate)`` for
  each product, summed);
* ``epilogue``: the qkv epilogue and the KV write (its floor: the new tokens' K/V rows written);
* ``other``: norms, sampling, gathers (no floor of their own: what is left).

Measured ceilings (:func:`measure_device`): the fastest XLA reduction over ``read_bytes`` of bf16 (a
ceiling for work that mostly reads) and an XLA bf16 matmul of ``matmul_size`` cubed. Medians of several
runs after a warm-up. A kernel reading faster than the measured ceiling shows above 100%: the ceiling,
not the kernel, is then what to improve.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

GROUPS = ("attention", "gemm", "epilogue", "other")
# Substrings of normalised kernel names (tools/profile_step.normalise_kernel_name) -> group; first match wins.
_GROUP_PATTERNS = (
    ("epilogue", ("qkv_epilogue", "kv_write", "scatter")),
    ("attention", ("paged_attention", "attention", "decode_", "prefill_", "flash", "mosaic_gpu")),
    ("gemm", ("gemm", "gemv", "matmul", "cutlass", "xmma", "cublas", "sm90_", "sm80_", "nvjet", "dot", "triton_")),
)


def kernel_group(name: str) -> str:
    """The group (:data:`GROUPS`) of a profiled kernel, from its normalised name."""
    low = name.lower()
    for group, patterns in _GROUP_PATTERNS:
        if any(p in low for p in patterns):
            return group
    return "other"


@dataclasses.dataclass(frozen=True)
class Device:
    """Ceilings measured on this process's device: read bandwidth (bytes/s) and bf16 matmul rate (FLOP/s)."""

    read_bytes_per_s: float
    matmul_flops_per_s: float
    name: str

    def seconds(self, num_bytes: float, flops: float = 0.0) -> float:
        """The floor of work that moves ``num_bytes`` and does ``flops``: the longer of the two."""
        return max(num_bytes / self.read_bytes_per_s, flops / self.matmul_flops_per_s)


def median_seconds(fn, *args, repeats: int) -> float:
    """Median wall seconds of ``fn(*args)`` over ``repeats`` runs, after one run that compiles and warms."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_device(read_bytes: int = 4 << 30, matmul_size: int = 8192, repeats: int = 10) -> Device:
    """Measures the read bandwidth (the fastest of three XLA reductions over ``read_bytes`` of bf16: the
    whole array, its rows, its columns; XLA picks different kernels for each and none is always best)
    and the bf16 matmul rate (``matmul_size``-cubed XLA matmul) on the default device. Smaller sizes for
    a CPU."""
    x = jnp.ones((read_bytes // 2 // 8192, 8192), jnp.bfloat16)
    readers = (lambda a: jnp.sum(a, dtype=jnp.float32), lambda a: jnp.max(a, axis=1), lambda a: jnp.max(a, axis=0))
    read_s = min(median_seconds(jax.jit(f), x, repeats=repeats) for f in readers)
    del x
    n = matmul_size
    a = jnp.ones((n, n), jnp.bfloat16)
    mm_s = median_seconds(jax.jit(lambda p, q: p @ q), a, a, repeats=max(3, repeats // 2))
    return Device(read_bytes_per_s=(read_bytes // 2 // 8192) * 8192 * 2 / read_s, matmul_flops_per_s=2 * n**3 / mm_s,
                  name=jax.devices()[0].device_kind)


def kv_bytes_per_token(cfg, kv_dtype, block_size: int) -> float:
    """K and V bytes of one token over all layers, as the pool stores them: an fp8 pool's scale row
    (one per block of ``block_size`` slots, ``kernels/fp8.py``) counted pro rata."""
    itemsize = jnp.dtype(kv_dtype).itemsize
    rows = (block_size + 1) / block_size if itemsize == 1 else 1.0
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize * rows


def gemm_shapes(cfg) -> dict[str, tuple[int, int, int]]:
    """The step's weight matrices as ``name -> (K, N, count)``: ``count`` of them per step (one a layer,
    the LM head once). A Qwen3-MoE layer counts its router and the ``num_experts_per_tok`` experts one
    token runs (the bytes a lone token must read: a lower bound for a batch, which reads more experts)."""
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    moe = sum(cfg.is_moe_layer(i) for i in range(layers)) if getattr(cfg, "num_experts", 0) else 0
    shapes = {"qkv": (h, q + 2 * kv, layers), "o_proj": (q, h, layers)}
    if moe < layers:
        dense = layers - moe
        shapes.update(gate_up=(h, 2 * cfg.intermediate_size, dense), down=(cfg.intermediate_size, h, dense))
    if moe:
        i, k = cfg.moe_intermediate_size, cfg.num_experts_per_tok
        shapes.update(router=(h, cfg.num_experts, moe), experts_gate_up=(h, 2 * i, moe * k),
                      experts_down=(i, h, moe * k))
    shapes["lm_head"] = (h, cfg.vocab_size, 1)
    return shapes


@dataclasses.dataclass(frozen=True)
class StepFloor:
    """What one step must move and compute, by group; ``seconds`` on a :class:`Device`."""

    kv_read_bytes: float
    kv_write_bytes: float
    weight_bytes: float
    gemm_flops: float
    attention_flops: float
    gemm_seconds: float  # the GEMMs' floor, each product at its own bound, summed
    device: Device

    @property
    def attention_seconds(self) -> float:
        return self.device.seconds(self.kv_read_bytes, self.attention_flops)

    @property
    def epilogue_seconds(self) -> float:
        return self.device.seconds(self.kv_write_bytes)

    @property
    def seconds(self) -> float:
        """The step's floor: its groups' floors summed."""
        return self.attention_seconds + self.gemm_seconds + self.epilogue_seconds

    def by_group(self) -> dict[str, float]:
        return {"attention": self.attention_seconds, "gemm": self.gemm_seconds, "epilogue": self.epilogue_seconds}


def step_floor(cfg, device: Device, *, num_tokens: int, context_lens, kv_dtype, block_size: int,
               weight_dtype=jnp.bfloat16, num_logits: int | None = None) -> StepFloor:
    """The floor of a step computing ``num_tokens`` tokens for sequences whose contexts (after the step)
    are ``context_lens`` tokens, with logits for ``num_logits`` rows (default: one a sequence)."""
    context_lens = np.asarray(context_lens, np.int64)
    num_logits = len(context_lens) if num_logits is None else num_logits
    kv_tok = kv_bytes_per_token(cfg, kv_dtype, block_size)
    wsize = jnp.dtype(weight_dtype).itemsize
    gemm_s = weight_bytes = flops = 0.0
    for name, (k, n, count) in gemm_shapes(cfg).items():
        m = num_logits if name == "lm_head" else num_tokens
        w, f = k * n * wsize * count, 2.0 * m * k * n * count
        weight_bytes, flops = weight_bytes + w, flops + f
        gemm_s += count * device.seconds(k * n * wsize, 2.0 * m * k * n)
    # attention: q.k and p.v over every context token, per query head (decode: one query a sequence)
    attn_flops = 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * float(context_lens.sum())
    return StepFloor(kv_read_bytes=kv_tok * float(context_lens.sum()), kv_write_bytes=kv_tok * num_tokens,
                     weight_bytes=weight_bytes, gemm_flops=flops, attention_flops=attn_flops, gemm_seconds=gemm_s,
                     device=device)


def workload_floor(cfg, device: Device, prompt_lens, output_lens, *, kv_dtype, block_size: int,
                   decode_steps: int, weight_dtype=jnp.bfloat16) -> dict:
    """The floor of a whole offline workload: prefill at the matmul rate (every prompt token's
    ``2 x params`` FLOPs and its causal attention), each of ``decode_steps`` decode steps reading the
    weights once, and each generated token reading its sequence's whole context. Returns its parts
    (bytes, FLOPs, seconds) and ``seconds``."""
    prompt_lens = np.asarray(prompt_lens, np.int64)
    output_lens = np.asarray(output_lens, np.int64)
    kv_tok = kv_bytes_per_token(cfg, kv_dtype, block_size)
    wsize = jnp.dtype(weight_dtype).itemsize
    shapes = gemm_shapes(cfg)
    weight_bytes = sum(k * n * count for k, n, count in shapes.values()) * wsize
    layer_flops_per_token = 2.0 * sum(k * n * count for name, (k, n, count) in shapes.items() if name != "lm_head")
    attn = 2.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
    prefill_flops = float(prompt_lens.sum()) * layer_flops_per_token + attn * float((prompt_lens**2).sum())
    # a generated token at position p reads the p tokens before it and itself (p from prompt_len to prompt_len + out - 1)
    ctx_tokens = float((output_lens * prompt_lens + output_lens * (output_lens + 1) // 2).sum())
    kv_read = kv_tok * ctx_tokens
    decode_weights = weight_bytes * decode_steps
    prefill_s = prefill_flops / device.matmul_flops_per_s
    decode_s = (kv_read + decode_weights) / device.read_bytes_per_s
    return dict(kv_read_bytes=kv_read, decode_weight_bytes=decode_weights, prefill_flops=prefill_flops,
                prefill_s=prefill_s, decode_s=decode_s, seconds=prefill_s + decode_s)


def group_times(kernels: list[dict]) -> dict[str, float]:
    """Seconds per step by group, from a profile's kernel table (rows with ``name`` and ``us_per_step``:
    ``tools/profile_step.analyse_trace``)."""
    out = dict.fromkeys(GROUPS, 0.0)
    for k in kernels:
        out[kernel_group(k["name"])] += k["us_per_step"] / 1e6
    return out


def floor_table(floor: StepFloor, measured: dict[str, float], step_seconds: float) -> list[dict]:
    """Rows ``group, measured ms, floor ms, % of floor`` (floor / measured) for each group with a floor,
    and the whole step against ``step_seconds``."""
    rows = []
    for group, floor_s in floor.by_group().items():
        took = measured.get(group, 0.0)
        rows.append(dict(group=group, ms=took * 1e3, floor_ms=floor_s * 1e3,
                         pct_of_floor=100 * floor_s / took if took else None))
    rows.append(dict(group="other", ms=measured.get("other", 0.0) * 1e3, floor_ms=0.0, pct_of_floor=None))
    rows.append(dict(group="step", ms=step_seconds * 1e3, floor_ms=floor.seconds * 1e3,
                     pct_of_floor=100 * floor.seconds / step_seconds if step_seconds else None))
    return rows


def print_floor_table(rows: list[dict], device: Device) -> None:
    print(f"floor on {device.name}: read {device.read_bytes_per_s / 1e12:.2f} TB/s, "
          f"bf16 matmul {device.matmul_flops_per_s / 1e12:.0f} TFLOP/s (measured in this process)")
    print(f"{'group':<10} {'ms':>8} {'floor ms':>9} {'% of floor':>11}")
    for r in rows:
        pct = "" if r["pct_of_floor"] is None else f"{r['pct_of_floor']:.0f}%"
        print(f"{r['group']:<10} {r['ms']:8.3f} {r['floor_ms']:9.3f} {pct:>11}")
