"""Full-size check on the GPU: our Qwen3-0.6B / Qwen2.5-0.5B (random weights) vs Hugging Face transformers.

Builds random weights under Hugging Face names, loads them into transformers (torch, CUDA) and into
jaxpaged, runs one prompt through our paged path in two chunks plus token-by-token decode steps, and
reports the relative error of the logits: fp32 vs fp32, and bf16 vs fp32 next to transformers' own
bf16 vs fp32 error. Needs torch + transformers (the GPU machine has them).

    python benchmarks/check_model_vs_hf.py [--out DIR] [--backend reference|pallas]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

jax.config.update("jax_default_matmul_precision", "highest")  # true fp32 matmuls, as torch does by default
import jax.numpy as jnp
import numpy as np

from jaxpaged.models.attention_backends import get_attention_fn
from jaxpaged.models.config import QwenConfig
from jaxpaged.models.convert import convert_tensors, abstract_model
from jaxpaged.models.kv_pool import init_kv_pool
from jaxpaged.models.tiny import random_hf_tensors
from jaxpaged.workloads import QWEN2_5_0_5B, QWEN3_0_6B

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (its helper modules)
from paged_forward import build_chunk_step, forward_all_logits  # noqa: E402

SHAPES = {"Qwen3-0.6B": QWEN3_0_6B, "Qwen2.5-0.5B": QWEN2_5_0_5B}
BLOCK_SIZE, PROMPT_LEN, SPLIT, DECODE = 16, 300, 193, 8


def hf_logits(raw: dict, tensors: dict, ids: np.ndarray, dtype) -> np.ndarray:
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**raw)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    state = {k: torch.from_numpy(np.asarray(v)) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model = model.to("cuda", dtype=dtype).eval()
    with torch.no_grad():
        out = model(torch.from_numpy(ids[None].astype(np.int64)).cuda()).logits[0].float().cpu().numpy()
    del model
    torch.cuda.empty_cache()
    return out


def our_logits(cfg, tensors, ids, dtype, backend):
    state = convert_tensors(cfg, tensors, dtype)
    graphdef, _ = abstract_model(cfg, dtype)
    attn = get_attention_fn(backend)
    nblocks = -(-len(ids) // BLOCK_SIZE) + 4
    pool = init_kv_pool(cfg, nblocks + 8, BLOCK_SIZE, dtype)
    pool = jnp.full_like(pool, jnp.nan)
    table = list(np.random.default_rng(0).permutation(nblocks + 8)[:nblocks])
    chunks = [(0, SPLIT), (SPLIT, len(ids) - DECODE)] + [(p, p + 1) for p in range(len(ids) - DECODE, len(ids))]
    logits = []
    for a, b in chunks:
        step = build_chunk_step([(ids[a:b], a, table)], BLOCK_SIZE, width=32)
        out, pool = forward_all_logits(graphdef, state, pool, step.token_ids, step.positions, step.meta, attn)
        logits.append(np.asarray(out)[: b - a])
    return np.concatenate(logits)


def rel(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--backend", default="reference")
    args = ap.parse_args()
    rows = []
    for name, raw in SHAPES.items():
        cfg = QwenConfig.from_dict(raw)
        t0 = time.time()
        tensors = random_hf_tensors(cfg, seed=1, std=0.02)
        ids = np.random.default_rng(2).integers(0, cfg.vocab_size, PROMPT_LEN).astype(np.int32)
        ref32 = hf_logits(raw, tensors, ids, torch.float32)
        ref16 = hf_logits(raw, tensors, ids, torch.bfloat16)
        ours32 = our_logits(cfg, tensors, ids, "float32", args.backend)
        ours16 = our_logits(cfg, tensors, ids, "bfloat16", args.backend)
        row = dict(model=name, backend=args.backend, ours_fp32_vs_hf_fp32=rel(ours32, ref32),
                   ours_bf16_vs_hf_fp32=rel(ours16, ref32), hf_bf16_vs_hf_fp32=rel(ref16, ref32),
                   ours_bf16_vs_hf_bf16=rel(ours16, ref16),
                   argmax_agree_fp32=float(np.mean(ours32.argmax(-1) == ref32.argmax(-1))),
                   seconds=round(time.time() - t0, 1))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, f"model_vs_hf_{args.backend}.json"), "w") as f:
        json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "rows": rows}, f, indent=2)
    print(f"\n{'model':14s} {'backend':9s} {'fp32 vs HF fp32':>16s} {'bf16 vs HF fp32':>16s} "
          f"{'HF bf16 vs fp32':>16s} {'argmax agree':>12s}")
    for r in rows:
        print(f"{r['model']:14s} {r['backend']:9s} {r['ours_fp32_vs_hf_fp32']:16.2e} {r['ours_bf16_vs_hf_fp32']:16.2e} "
              f"{r['hf_bf16_vs_hf_fp32']:16.2e} {r['argmax_agree_fp32']:12.3f}")


if __name__ == "__main__":
    main()
