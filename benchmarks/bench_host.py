"""Host-side cost of the KV memory manager: admission (prefix match + allocate) and one decode step
(grow block tables, build the padded block-table and slot-mapping arrays, advance + cache full blocks)
for a batch of sequences. Pure Python + numpy, no device; the step must stay far below a GPU decode
step (target: < 500 us per step for 256 sequences of ~1,000 tokens).

    python benchmarks/bench_host.py [--num-seqs 256] [--prompt-len 1000] [--block-size 16] [--steps 512]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxpaged.engine.step_inputs import bucket, slot_mapping_batch  # noqa: E402
from jaxpaged.kv import KVCacheManager  # noqa: E402
from jaxpaged.engine.sequence import Sequence  # noqa: E402


def make_prompts(rng: np.random.Generator, num: int, length: int, shared: int) -> list[list[int]]:
    """~``length``-token prompts; half share a ``shared``-token system prompt (prefix hits)."""
    system = rng.integers(0, 150_000, shared).tolist()
    prompts = []
    for i in range(num):
        n = int(rng.integers(length * 9 // 10, length * 11 // 10 + 1))
        body = rng.integers(0, 150_000, n).tolist()
        prompts.append(system + body[shared:] if i % 2 == 0 else body)
    return prompts


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--shared-prefix", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    bs, S = args.block_size, args.num_seqs
    max_len = args.prompt_len * 11 // 10 + args.steps + 1
    num_blocks = S * -(-max_len // bs) + 64
    # KV bytes per token slot of a Qwen2.5-7B-like model: K and V, 28 layers, 4 KV heads x 128, bf16.
    mgr = KVCacheManager(num_blocks, bs, bytes_per_token_slot=2 * 28 * 4 * 128 * 2)
    prompts = make_prompts(rng, S, args.prompt_len, args.shared_prefix)
    seqs = [Sequence(f"req-{i}", p) for i, p in enumerate(prompts)]

    # ---- admission: prefix match + allocate, then a simulated prefill + cache full blocks ----------
    t_admit = []
    for s in seqs:
        t0 = time.perf_counter()
        assert mgr.can_admit(s)
        mgr.admit(s)
        t_admit.append(time.perf_counter() - t0)
        s.num_computed_tokens = s.num_tokens  # the prefill step
        mgr.cache_full_blocks(s)
        s.append_token(int(rng.integers(0, 150_000)))
    # Re-admission of the same prompts by new requests: long prefix hits (match cost dominates).
    t_hit, hit_blocks = [], []
    for i, p in enumerate(prompts[:32]):
        r = Sequence(f"again-{i}", p)
        t0 = time.perf_counter()
        mgr.admit(r)
        t_hit.append(time.perf_counter() - t0)
        hit_blocks.append(r.num_cached_tokens // bs)
        mgr.free(r)

    # ---- decode steps ----------------------------------------------------------------------------
    rows = np.arange(S, dtype=np.int32)
    sampled = rng.integers(0, 150_000, (args.steps, S)).tolist()
    t_grow, t_arrays, t_post, t_step = [], [], [], []
    width = bucket(max(len(mgr.block_table(s)) for s in seqs) + args.steps // bs + 1, 4)
    table_rows = np.array([s.block_table_row for s in seqs], np.int64)
    for step in range(args.steps):
        t0 = time.perf_counter()
        for s in seqs:  # scheduler: make room for the token being computed
            if not mgr.can_append(s, 1):
                raise RuntimeError("pool sized too small for the benchmark")
            mgr.append(s, 1)
        t1 = time.perf_counter()
        tables = mgr.tables.gather(table_rows, width)  # i32[S, W]
        positions = np.fromiter((s.num_computed_tokens for s in seqs), np.int32, count=S)  # new tokens' positions
        slots = slot_mapping_batch(tables, rows, positions, bs)  # i32[S]
        kv_lens = positions + 1
        t2 = time.perf_counter()
        for s, tok in zip(seqs, sampled[step]):  # postprocess: K/V written, token sampled
            s.num_computed_tokens += 1
            s.append_token(tok)
            mgr.cache_full_blocks(s)
        t3 = time.perf_counter()
        t_grow.append(t1 - t0)
        t_arrays.append(t2 - t1)
        t_post.append(t3 - t2)
        t_step.append(t3 - t0)
    assert slots.dtype == np.int32 and kv_lens.shape == (S,)

    t0 = time.perf_counter()
    for s in seqs:
        mgr.free(s)
    t_free = time.perf_counter() - t0
    mgr.check_invariants()
    st = mgr.stats()

    us = 1e6
    print(f"# bench_host: {S} seqs, prompts ~{args.prompt_len} tokens ({args.shared_prefix}-token "
          f"shared prefix on half), block_size={bs}, {args.steps} decode steps, pool {num_blocks} blocks")
    print(f"# {platform.python_implementation()} {platform.python_version()}, numpy {np.__version__}, "
          f"{platform.machine()}, {os.cpu_count()} cpus")
    print(f"admit (match+allocate), per request: median {statistics.median(t_admit) * us:.1f} us, "
          f"p99 {pct(t_admit, 99) * us:.1f} us")
    print(f"re-admit an identical prompt (median {statistics.median(hit_blocks):.0f}-block hit), per "
          f"request: median {statistics.median(t_hit) * us:.1f} us")
    print(f"decode step total ({S} seqs): median {statistics.median(t_step) * us:.0f} us, "
          f"mean {statistics.fmean(t_step) * us:.0f} us, p99 {pct(t_step, 99) * us:.0f} us")
    print(f"  grow block tables (can_append+append): median {statistics.median(t_grow) * us:.0f} us")
    print(f"  block_tables i32[{S},{width}] + slot_mapping i32[{S}]: median "
          f"{statistics.median(t_arrays) * us:.0f} us")
    print(f"  advance + append_token + cache_full_blocks: median {statistics.median(t_post) * us:.0f} us")
    print(f"free {S} requests: {t_free * us / S:.1f} us per request")
    print(f"stats: {st}")


if __name__ == "__main__":
    main()
