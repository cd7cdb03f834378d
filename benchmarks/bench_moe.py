"""A Qwen3-MoE layer's sparse MLP and its grouped GEMMs, per step size, against their floors.

For each token count ``T`` (``--tokens``: decode batches and prefill chunks) and ``--layers`` separate
layers' weights at Qwen3-30B-A3B shapes (random bf16; tokens routed by a random router, so about as many
distinct experts are hit as real routing hits), this times, median of ``--repeats``:

* ``moe``: the whole sparse MLP (``models/moe.sparse_moe`` with the engine's ops for this device: router,
  sort, gather, both grouped GEMMs, the weighting and the slots' sum);
* ``gate_up`` and ``down``: each grouped GEMM alone (``ops.grouped_matmul``) over rows already sorted by
  expert, with the same group sizes;
* ``gate_up_ragged``: the gate/up GEMM by XLA's ``jax.lax.ragged_dot`` (on a GPU only, against the
  engine's fixed-tile kernel; a size it runs out of memory at is reported as such);
* ``moe_fp8``: the sparse MLP with the experts in fp8 (per expert and output channel, as
  ``quantization="fp8"`` stores them), its floor at a byte a weight;
* ``gate_up@BMxBNxBKxWxS`` and ``down@...`` for each tile configuration in ``--configs``: the
  fixed-tile kernel with that ``MatmulConfig`` (block_m, block_n, block_k, num_warps, num_stages), to
  choose its tiles by measurement.

Each is set against its floor on the device measured in the same process (``floor.measure_device``):
the bytes of the distinct experts the routing hits (each read once) plus the activations, and the FLOPs
of the ``T k`` rows; achieved GB/s and TFLOP/s are those bytes and FLOPs over the time. The MoE layer's
share of a step is its time times the model's MoE layers over the step time ``bench_latency`` or
``bench_throughput`` reports.

    python benchmarks/bench_moe.py --out $OUT                          # GPU, Qwen3-30B-A3B shapes
    python benchmarks/bench_moe.py --tiny --tokens 1,16 --out /tmp/m   # CPU: the tiny MoE shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.floor import Device, measure_device, median_seconds  # noqa: E402
from jaxpaged.kernels.grouped_matmul import grouped_matmul as ragged_dot  # noqa: E402
from jaxpaged.kernels.grouped_matmul import grouped_matmul_fixed_tile  # noqa: E402
from jaxpaged.kernels.matmul import MatmulConfig  # noqa: E402
from jaxpaged.models.moe import route, sort_by_expert, sparse_moe  # noqa: E402
from jaxpaged.models.ops import get_model_ops  # noqa: E402
from jaxpaged.models.quantization import Fp8Weight, quantize_per_channel  # noqa: E402
from jaxpaged.workloads import QWEN3_30B_A3B  # noqa: E402

TINY = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)


@dataclasses.dataclass(frozen=True)
class MoeShape:
    hidden: int
    intermediate: int
    experts: int
    top_k: int

    def expert_bytes(self, itemsize: int) -> tuple[int, int]:
        """One expert's ``(gate_up, down)`` weight bytes."""
        return self.hidden * 2 * self.intermediate * itemsize, self.intermediate * self.hidden * itemsize

    def floor(self, tokens: int, distinct: int, itemsize: int, weight_itemsize: int | None = None
              ) -> dict[str, tuple[float, float]]:
        """``name -> (bytes, flops)`` that must move and be done: each hit expert's weights once (at
        ``weight_itemsize`` bytes, default ``itemsize``), the gathered rows in and the products out once;
        ``2 T k K N`` FLOPs per grouped GEMM."""
        h, i, rows = self.hidden, self.intermediate, tokens * self.top_k
        gu_w, down_w = self.expert_bytes(weight_itemsize or itemsize)
        gate_up = (distinct * gu_w + rows * (h + 2 * i) * itemsize, 2.0 * rows * h * 2 * i)
        down = (distinct * down_w + rows * (i + h) * itemsize, 2.0 * rows * i * h)
        router = h * self.experts * itemsize + tokens * h * itemsize
        moe = (gate_up[0] + down[0] + router, gate_up[1] + down[1] + 2.0 * tokens * h * self.experts)
        return dict(moe=moe, gate_up=gate_up, down=down)


def parse_configs(text: str) -> list[MatmulConfig]:
    """``"64x128x64x4x3,16x64x128x4x3"`` -> tile configurations (block_m x block_n x block_k x warps x stages;
    the blocks powers of two >= 16)."""
    configs = []
    for c in filter(None, text.split(",")):
        values = [int(v) for v in c.split("x")]
        if len(values) != 5 or any(b < 16 or b & (b - 1) for b in values[:3]):
            raise SystemExit(f"--configs: bad configuration {c!r} (want BMxBNxBKxWARPSxSTAGES, blocks powers of two >= 16)")
        configs.append(MatmulConfig(*values))
    return configs


def config_name(cfg: MatmulConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}x{cfg.num_warps}x{cfg.num_stages}"


def measure(shape: MoeShape, tokens: int, layers: int, repeats: int, device: Device, dtype=jnp.bfloat16,
            seed: int = 0, configs: tuple[MatmulConfig, ...] = (), ragged_max_tokens: int = 512) -> dict:
    """One row of the table: times per layer, floors and achieved rates for ``tokens`` tokens."""
    ops = get_model_ops()
    keys = iter(jax.random.split(jax.random.key(seed), 3 * layers + 2))
    normal = lambda shape_, scale=0.02: (jax.random.normal(next(keys), shape_, jnp.float32) * scale).astype(dtype)  # noqa: E731
    h, i, e, k = shape.hidden, shape.intermediate, shape.experts, shape.top_k
    weights = [(normal((h, e)), normal((e, h, 2 * i)), normal((e, i, h))) for _ in range(layers)]
    x = normal((tokens, h), 1.0)
    _, experts = route(ops.matmul(x, weights[0][0]).astype(jnp.float32), k, True)
    order, group_sizes = sort_by_expert(experts, 0, e)
    distinct = int(jnp.count_nonzero(group_sizes))
    rows_x = x[order // k]
    rows_i = normal((tokens * k, i), 1.0)

    def over_layers(product, layer_weights, *args) -> float:
        """Median seconds of ``product`` over every layer's weights, passed as arguments (closed over,
        XLA would take them as constants of the program)."""
        def run(layer_weights, *args):
            acc = jnp.zeros((), jnp.float32)
            for w in layer_weights:
                acc = acc + product(w, *args)[:1, :1].astype(jnp.float32).sum()
            return acc
        return median_seconds(jax.jit(run), layer_weights, *args, repeats=repeats)

    moe = lambda w, x: sparse_moe(x, *w, top_k=k, norm_topk_prob=True, ops=ops)  # noqa: E731
    times = dict(
        moe=over_layers(moe, weights, x),
        gate_up=over_layers(lambda w, r, g: ops.grouped_matmul(r, w[1], g), weights, rows_x, group_sizes),
        down=over_layers(lambda w, r, g: ops.grouped_matmul(r, w[2], g), weights, rows_i, group_sizes),
    )
    on_gpu = jax.default_backend() == "gpu"
    for cfg in configs:  # interpret mode off the GPU
        tiled = functools.partial(grouped_matmul_fixed_tile, config=cfg, interpret=not on_gpu)
        times[f"gate_up@{config_name(cfg)}"] = over_layers(lambda w, r, g: tiled(r, w[1], g), weights, rows_x, group_sizes)
        times[f"down@{config_name(cfg)}"] = over_layers(lambda w, r, g: tiled(r, w[2], g), weights, rows_i, group_sizes)
    if on_gpu and tokens <= ragged_max_tokens:
        try:
            times["gate_up_ragged"] = over_layers(lambda w, r, g: ragged_dot(r, w[1], g), weights, rows_x, group_sizes)
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            times["gate_up_ragged"] = float("inf")  # out of memory
    fp8 = [(r, Fp8Weight(*quantize_per_channel(gu), jnp.dtype(dtype)), Fp8Weight(*quantize_per_channel(d), jnp.dtype(dtype)))
           for r, gu, d in weights]
    del weights
    times["moe_fp8"] = over_layers(moe, fp8, x)
    floors = shape.floor(tokens, distinct, jnp.dtype(dtype).itemsize)
    floors["moe_fp8"] = shape.floor(tokens, distinct, jnp.dtype(dtype).itemsize, weight_itemsize=1)["moe"]
    for name in times:
        if name.startswith(("gate_up_ragged", "gate_up@", "down@")):
            floors[name] = floors[name.split("@")[0].removesuffix("_ragged")]
    row = dict(tokens=tokens, distinct_experts=distinct)
    for name, (num_bytes, flops) in floors.items():
        seconds = times[name] / layers
        row[name] = dict(us=seconds * 1e6, floor_us=device.seconds(num_bytes, flops) * 1e6,
                         gb_s=num_bytes / seconds / 1e9, tflop_s=flops / seconds / 1e12)
        row[name]["pct_of_floor"] = 100 * row[name]["floor_us"] / row[name]["us"]
    return row


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8,64,256,2048,8192", help="tokens per step (decode batch or chunk)")
    ap.add_argument("--layers", type=int, default=4, help="separate layers' weights per timed function")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tiny", action="store_true", help="the tiny MoE shapes (a CPU run)")
    ap.add_argument("--configs", default="64x128x64x4x3,16x64x128x4x3", help="fixed-tile configurations to time beside the default, "
                                                  "e.g. 16x64x128x4x3,64x128x64x4x3: block_m x block_n x block_k x warps x stages")
    ap.add_argument("--ragged-max-tokens", type=int, default=512,
                    help="time ragged_dot up to this many tokens (it needed a 32 GiB temporary at 2,048)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else QWEN3_30B_A3B
    shape = MoeShape(cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], cfg["num_experts_per_tok"])
    device = measure_device(**(dict(read_bytes=8 << 20, matmul_size=256, repeats=3) if args.tiny else {}))
    print(f"{device.name}: read {device.read_bytes_per_s / 1e12:.2f} TB/s, bf16 matmul "
          f"{device.matmul_flops_per_s / 1e12:.0f} TFLOP/s; {shape}", flush=True)
    configs = tuple(parse_configs(args.configs))  # a malformed one fails here, before any timing
    rows = []
    os.makedirs(args.out, exist_ok=True)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        rows.append(measure(shape, tokens, args.layers, args.repeats, device, configs=configs,
                            ragged_max_tokens=args.ragged_max_tokens))
        print(json.dumps(rows[-1]), flush=True)
        with open(os.path.join(args.out, "bench_moe.json"), "w") as f:  # after each row: a later one may not finish
            json.dump(dict(device=device.name, read_tb_s=device.read_bytes_per_s / 1e12,
                           matmul_tflop_s=device.matmul_flops_per_s / 1e12, shape=dataclasses.asdict(shape), rows=rows),
                      f, indent=1)
    names = list(dict.fromkeys(n for r in rows for n in r if isinstance(r[n], dict)))
    print(f"\n{'T':>5} {'experts':>7} {'':24} {'us':>9} {'floor':>7} {'%':>4} {'GB/s':>6} {'TF/s':>5}")
    for r in rows:
        for n in names:
            if n in r:
                print(f"{r['tokens']:5d} {r['distinct_experts']:7d} {n:24} {r[n]['us']:9.1f} {r[n]['floor_us']:7.1f} "
                      f"{r[n]['pct_of_floor']:4.0f} {r[n]['gb_s']:6.0f} {r[n]['tflop_s']:5.1f}")
    return rows


if __name__ == "__main__":
    main()
