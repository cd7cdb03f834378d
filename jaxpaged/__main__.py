"""Command line: python -m jaxpaged demo | generate --model PATH --prompt ... | bench | serve MODEL.

``demo`` needs nothing: it runs the packaged tiny random Qwen3 checkpoint (so the text is gibberish,
but every mechanism is real), sends requests that share a system prompt, and prints the generated
tokens and text, the prefix-cache hits and the KV pool statistics.
"""

from __future__ import annotations

import argparse
import sys
import time

from .config import EngineConfig
from .llm import LLM
from .models.tiny import tiny_checkpoint_path
from .sampling.sampler import SamplingParams

DEMO_SYSTEM = "PagedAttention stores the key and value cache in fixed-size blocks, like pages of virtual memory. "
DEMO_QUESTIONS = ["Hello, world!", "How are you today?", "Once upon a time", "The quick brown fox"]


def _print_outputs(outputs) -> None:
    for out in outputs:
        c = out.outputs[0]
        ttft = out.metrics.time_to_first_token
        print(f"[{out.request_id}] prompt {len(out.prompt_token_ids)} tokens ({out.num_cached_tokens} from the "
              f"prefix cache), TTFT {ttft * 1e3:.1f} ms, finish={c.finish_reason}")
        print(f"    prompt: {out.prompt!r}")
        print(f"    tokens: {c.token_ids}")
        print(f"    text:   {c.text!r}")


def _print_stats(llm: LLM) -> None:
    s = llm.stats()
    print("\nKV cache statistics")
    print(f"  pool: {s['num_blocks']} blocks x {s['block_size']} tokens = {s['kv_pool_bytes'] / 2**20:.2f} MiB "
          f"({s['kv_bytes_per_token']} bytes per token)")
    print(f"  blocks: used {s['blocks_used']}, free {s['blocks_free']}, cached {s['blocks_cached']}, "
          f"peak used {s['peak_blocks_used']} ({(s['peak_kv_bytes_in_use'] or 0) / 2**10:.1f} KiB of KV)")
    print(f"  prefix cache: {s['prefix_hit_tokens']}/{s['prefix_query_tokens']} prompt tokens hit "
          f"({s['prefix_hit_rate']:.1%}), {s['blocks_inserted']} blocks inserted, {s['evictions']} evictions")
    print(f"  scheduler: {s['steps']} steps, {s['prefill_tokens']} prefill + {s['decode_tokens']} decode tokens, "
          f"{s['preemptions']} preemptions")
    print(f"  compile: {s['compile_seconds']:.1f} s for {s['compiled_shapes']} step shapes "
          f"({s['attention_backend']} attention)")


def demo(args: argparse.Namespace) -> None:
    path = tiny_checkpoint_path("qwen3")
    print(f"jaxpaged demo: tiny random Qwen3 checkpoint at {path}\n")
    llm = LLM(path, dtype="float32", block_size=8, num_blocks=128, max_model_len=256, max_num_batched_tokens=256,
              attention_backend=args.attention_backend)
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    first = llm.generate([DEMO_SYSTEM + DEMO_QUESTIONS[0]], sp, use_tqdm=False)
    rest = llm.generate([DEMO_SYSTEM + q for q in DEMO_QUESTIONS[1:]], sp, use_tqdm=False)
    _print_outputs(first + rest)
    print(f"\n{len(DEMO_QUESTIONS)} requests in {time.perf_counter() - t0:.2f} s (steps compiled at start-up)")
    print(f"first divergence of two prompts: {llm.explain_prefix(DEMO_SYSTEM + DEMO_QUESTIONS[0], DEMO_SYSTEM + DEMO_QUESTIONS[1])}")
    _print_stats(llm)


def generate_cmd(args: argparse.Namespace) -> None:
    # One batch of prompts: compiling every step shape first would cost more than it saves.
    llm = LLM(args.model, dtype=args.dtype, block_size=args.block_size, max_model_len=args.max_model_len,
              attention_backend=args.attention_backend, warmup=False)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed)
    _print_outputs(llm.generate(args.prompt, sp, use_tqdm=False))
    _print_stats(llm)


# Workload defaults: the full one (nano-vllm's) for real and random Qwen3-0.6B weights; a small one for
# the packaged tiny checkpoint (1,024 positions), which runs in seconds on a CPU.
FULL_BENCH = dict(num_seqs=256, max_len=2048, max_num_batched_tokens=8192, max_num_seqs=256)
TINY_BENCH = dict(num_seqs=16, max_len=256, max_num_batched_tokens=256, max_num_seqs=16)


def bench(args: argparse.Namespace) -> None:
    """nano-vllm's throughput workload (scaled by --num-seqs / --max-len) on a checkpoint or random weights."""
    from .engine.llm_engine import LLMEngine
    from .llm import run_to_completion
    from .models.checkpoint import load_params
    from .workloads import QWEN3_0_6B, nano_vllm_workload, random_model

    tiny = args.model == "tiny"
    for name, value in (TINY_BENCH if tiny else FULL_BENCH).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if tiny:
        params = load_params(tiny_checkpoint_path("qwen3"), "float32")
    elif args.model:
        params = load_params(args.model, args.dtype)
    else:
        params = random_model(QWEN3_0_6B, args.dtype)
    half = args.max_len // 2
    if half < 100:
        raise SystemExit("bench: --max-len must be at least 200 (prompts and outputs of 100..max_len/2 tokens)")
    prompts, sps = nano_vllm_workload(args.num_seqs, half, half)
    vocab = params.config.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    engine = LLMEngine(params, EngineConfig(block_size=args.block_size, max_model_len=args.max_len,
                                            max_num_seqs=args.max_num_seqs, attention_backend=args.attention_backend,
                                            max_num_batched_tokens=args.max_num_batched_tokens))
    compile_s = engine.warmup()
    t0 = time.perf_counter()
    outs = run_to_completion(engine, prompts, sps, use_tqdm=True)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {sum(map(len, prompts))} prompt + {tokens} output tokens in {seconds:.2f} s: "
          f"{tokens / seconds:,.0f} output tok/s (compile {compile_s:.1f} s, not included)")
    s = engine.stats()
    print(f"steps {s['steps']}, preemptions {s['preemptions']}, host {s['host_seconds']:.2f} s, "
          f"device wait {s['device_wait_seconds']:.2f} s, peak KV {(s['peak_kv_bytes_in_use'] or 0) / 2**30:.2f} GiB")


def serve_llm_args(args: argparse.Namespace) -> dict:
    """The ``LLM`` keyword arguments of a ``serve`` command line (its engine flags under vLLM's names)."""
    return dict(model=str(tiny_checkpoint_path("qwen3")) if args.model == "tiny" else args.model,
                dtype=args.dtype, load_format=args.load_format, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, memory_fraction=args.gpu_memory_utilization,
                enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype,
                tensor_parallel_size=args.tensor_parallel_size, attention_backend=args.attention_backend,
                num_blocks=args.num_blocks, seed=args.seed, kv_offloading_size=args.kv_offloading_size)


def serve_cmd(args: argparse.Namespace) -> None:
    """The OpenAI-compatible server (``jaxpaged/serve``): loads and warms up the model, then listens."""
    import os

    try:
        from .serve.api_server import serve
    except ImportError as err:
        raise SystemExit(f"serve needs the server's dependencies: pip install 'jaxpaged[serve]' ({err})")
    serve(serve_llm_args(args), args.host, args.port, args.served_model_name, args.api_key or os.environ.get("JAXPAGED_API_KEY"))


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (every subcommand and flag)."""
    ap = argparse.ArgumentParser(prog="python -m jaxpaged", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="generate with the packaged tiny model and print KV statistics")
    d.add_argument("--max-tokens", type=int, default=16)
    d.add_argument("--attention-backend", default="auto")
    g = sub.add_parser("generate", help="generate from a Hugging Face Qwen checkpoint folder")
    g.add_argument("--model", required=True, help="checkpoint folder (config.json, *.safetensors, tokenizer.json)")
    g.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--attention-backend", default="auto")
    b = sub.add_parser("bench", help="throughput on nano-vllm's workload (random Qwen3-0.6B weights by default)")
    b.add_argument("--model", default=None, help="checkpoint folder, 'tiny' for the packaged model, or none")
    b.add_argument("--num-seqs", type=int, default=None, help="requests (default 256; 16 with --model tiny)")
    b.add_argument("--max-len", type=int, default=None,
                   help="max_model_len; prompts and outputs up to half each (default 2048; 256 with --model tiny)")
    b.add_argument("--dtype", default="bfloat16")
    b.add_argument("--block-size", type=int, default=16)
    b.add_argument("--max-num-seqs", type=int, default=None, help="default 256; 16 with --model tiny")
    b.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 8192; 256 with --model tiny")
    b.add_argument("--attention-backend", default="auto")
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install 'jaxpaged[serve]')")
    s.add_argument("model", help="checkpoint folder or Hub id in the local cache ('tiny': the packaged model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="required as 'Authorization: Bearer KEY' (or $JAXPAGED_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the name clients use (default: the model argument)")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="'dummy': random weights of the folder's config.json (for benchmarks)")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    s.add_argument("--num-blocks", type=int, default=None)
    s.add_argument("--gpu-memory-utilization", type=float, default=EngineConfig.memory_fraction)
    s.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    s.add_argument("--max-num-batched-tokens", type=int, default=EngineConfig.max_num_batched_tokens)
    s.add_argument("--kv-cache-dtype", default="auto")
    s.add_argument("--kv-offloading-size", type=float, default=0,
                   help="GiB of host memory for evicted prefix-cache blocks (0: none)")
    s.add_argument("--tensor-parallel-size", type=int, default=1)
    s.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    s.add_argument("--attention-backend", default="auto")
    s.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.cmd == "serve" and args.served_model_name is None:
        args.served_model_name = args.model
    {"demo": demo, "generate": generate_cmd, "bench": bench, "serve": serve_cmd}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
