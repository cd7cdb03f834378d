"""What a lone short prompt's step launches, per attention backend.

A batch-1 32-token prompt's step on Mosaic spent more host time launching (``ExecuteThunks``) and more
GPU time than on Triton. This compiles that step for each backend (Qwen3-0.6B shapes, random bf16
weights, the engine's defaults, a small pool; the step built by ``benchmarks/check_step_hlo.py``) and
counts the optimised ENTRY computation's instructions by opcode (custom calls by target, fusions by
kind): each is a kernel or a thunk of the step. Command-buffer calls, where XLA forms them in the HLO,
are counted apart with the instructions inside them; jax 0.11.2's XLA forms them later, from the
thunks, so there every instruction is "outside".

    python benchmarks/results/mosaic/ttft_thunks/thunks.py [--backends triton,mosaic] [--kv-cache-dtype auto] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))  # benchmarks/: check_step_hlo

from check_step_hlo import check  # noqa: E402
from jaxpaged import EngineConfig, LLMEngine  # noqa: E402
from jaxpaged.workloads import benchmark_params  # noqa: E402

SKIP = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def computations(text: str) -> dict[str, list[str]]:
    """The HLO module's computations: name -> instruction lines (ENTRY under 'ENTRY')."""
    comps, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m:
            name = "ENTRY" if m.group(1) else m.group(2)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None and "=" in line:
            comps[name].append(line.strip())
    return comps


def opcode(line: str) -> str:
    rhs = line.split("=", 1)[1]
    m = re.search(r"\s([a-z][\w\-]*)\(", rhs)
    op = m.group(1) if m else "?"
    if op == "custom-call":
        t = re.search(r'custom_call_target="([^"]+)"', line)
        op += ":" + (t.group(1) if t else "?")
    elif op == "fusion":
        k = re.search(r"kind=(k\w+)", line)
        op += ":" + (k.group(1) if k else "?")
    return op


def layout(text: str) -> dict:
    comps = computations(text)
    top, in_buffers, n_buffers = collections.Counter(), collections.Counter(), 0
    for line in comps["ENTRY"]:
        op = opcode(line)
        if op.split(":")[0] in SKIP:
            continue
        callee = re.search(r"to_apply=%?([\w.\-]+)", line)
        if op == "call" and callee and "command_buffer" in callee.group(1):
            n_buffers += 1
            for inner in comps.get(callee.group(1), []):
                iop = opcode(inner)
                if iop.split(":")[0] not in SKIP:
                    in_buffers[iop] += 1
        else:
            top[op] += 1
    return dict(command_buffers=n_buffers, inside=dict(in_buffers), outside=dict(top))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="triton,mosaic")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--model", default="qwen3-0.6b", help="qwen3-0.6b, or tiny for a CPU run of the script")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    params = benchmark_params(args.model)
    rows = {}
    for backend in args.backends.split(","):
        engine = LLMEngine(params, EngineConfig(block_size=16, num_blocks=4096 if args.model != "tiny" else 64, max_num_seqs=256 if args.model != "tiny" else 16, attention_backend=backend,
                                                kv_cache_dtype=args.kv_cache_dtype))
        path = os.path.join(args.out, f"prompt{args.prompt}_{backend}.hlo.txt")
        check(engine, [list(np.random.default_rng(0).integers(1, 500, args.prompt))], dump=path)
        with open(path) as f:
            text = f.read()
        rows[backend] = layout(text)
        del engine
    with open(os.path.join(args.out, "thunks.json"), "w") as f:
        json.dump(rows, f, indent=1)
    for backend, r in rows.items():
        print(f"{backend}: {r['command_buffers']} command buffers, {sum(r['inside'].values())} instructions in them;"
              f" outside: {sum(r['outside'].values())}")
        for op, n in sorted(r["outside"].items(), key=lambda kv: -kv[1]):
            print(f"   outside {n:4d} {op}")
        for op, n in sorted(r["inside"].items(), key=lambda kv: -kv[1])[:12]:
            print(f"   inside  {n:4d} {op}")


if __name__ == "__main__":
    main()
