"""Command line: python -m jaxpaged {demo,generate,bench,serve} [MODEL] [engine flags].

Every subcommand takes its model the same way (a checkpoint folder, ``tiny`` for the packaged tiny
random Qwen3 checkpoint, or a Hugging Face Hub id already in the local cache) and the same engine
flags, under vLLM's names (``add_engine_arguments``; ``LLM(...)`` takes the same names with
underscores). A failure is one line on stderr naming the problem, exit status 2; ``--debug`` shows the
traceback. JAX is imported only when a command runs, so ``--help`` answers at once.

``demo`` needs nothing: it runs the packaged tiny random Qwen3 checkpoint (so the text is gibberish,
but every mechanism is real), sends requests that share a system prompt, and prints the generated
tokens and text, the prefix-cache hits and the KV pool statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from .config import (ATTENTION_BACKENDS, KV_CACHE_DTYPES, QUANTIZATIONS, SCHEDULING_POLICIES, EngineConfig, KVEventsConfig,
                     split_host_port)

PROG = "python -m jaxpaged"
DTYPES = ("auto", "bfloat16", "float16", "float32")
LOAD_FORMATS = ("auto", "dummy")
TINY = "tiny"
DEMO_SYSTEM = "PagedAttention stores the key and value cache in fixed-size blocks, like pages of virtual memory. "
DEMO_QUESTIONS = ["Hello, world!", "How are you today?", "Once upon a time", "The quick brown fox"]
# Workload defaults: the full one (nano-vllm's) for real and random Qwen3-0.6B weights; a small one for
# the packaged tiny checkpoint (1,024 positions), which runs in seconds on a CPU.
FULL_BENCH = dict(num_seqs=256, max_model_len=2048, max_num_batched_tokens=8192, max_num_seqs=256)
TINY_BENCH = dict(num_seqs=16, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=16)


class CLIError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2."""


# ---- arguments -----------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (exit status 2, as argparse's own)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where the help already says it in words (a ``None`` default)."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _host_port(text: str) -> str:
    try:
        split_host_port(text, "the address")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _power_of_two(text: str) -> int:
    value = _positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"must be a power of two, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _gib(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of GiB >= 0, got {text}")
    return value


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.parse(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# Registering the names lets argparse print "invalid positive integer value: '0'".
for _f, _name in ((_positive_int, "positive integer"), (_power_of_two, "power of two"), (_fraction, "fraction"),
                  (_gib, "GiB"), (_kv_events_config, "KV events config")):
    _f.__name__ = _name


def add_model_argument(p: argparse.ArgumentParser, default: str | None = None, what: str = "") -> None:
    """The model, the same way in every subcommand: ``MODEL`` or ``--model MODEL`` (vLLM takes both)."""
    forms = ("a checkpoint folder (config.json, *.safetensors, tokenizer.json), 'tiny' (the packaged tiny "
             "random Qwen3 checkpoint) or a Hugging Face Hub id already in the local cache (hf download ID)")
    p.add_argument("model", nargs="?", default=None, metavar="MODEL", help=forms + what)
    p.add_argument("--model", dest="model_flag", default=None, metavar="MODEL", help="the same as MODEL")
    p.set_defaults(model_default=default)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine flags every subcommand shares, under vLLM's names (``engine_kwargs`` reads them)."""
    e = EngineConfig
    g = p.add_argument_group("engine (vLLM's names; LLM(...) takes the same names with underscores)")
    g.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="the weights' dtype; auto: the checkpoint's (config.json), bfloat16 for random weights")
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: random weights of the folder's config.json (no weight files needed)")
    g.add_argument("--quantization", "-q", choices=QUANTIZATIONS, default=None,
                   help="fp8: e4m3 linear weights (a bf16 checkpoint quantized at load; default: the "
                        "checkpoint's, so an fp8 checkpoint loads as fp8)")
    g.add_argument("--max-model-len", type=_positive_int, default=None, metavar="N",
                   help="prompt + output tokens per request (default: the model's max_position_embeddings, "
                        "at most 8192, lowered to what the KV pool holds)")
    g.add_argument("--block-size", type=_power_of_two, default=None, metavar="N",
                   help="tokens per KV block, a power of two (default: 16; 64 with an fp8 --kv-cache-dtype)")
    g.add_argument("--num-blocks", "--num-gpu-blocks-override", dest="num_blocks", type=_positive_int, default=None,
                   metavar="N", help="KV pool size in blocks (default: sized from --gpu-memory-utilization; "
                                     "on a CPU from a capped share of host memory)")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=e.memory_fraction, metavar="F",
                   help="share of the device memory the engine holds, weights and KV pool together")
    g.add_argument("--max-num-seqs", type=_positive_int, default=e.max_num_seqs, metavar="N",
                   help="sequences in one step (the decode batch)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=e.max_num_batched_tokens, metavar="N",
                   help="new tokens in one step (longer prompts are chunked)")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=e.kv_cache_dtype,
                   help="the KV pool's dtype; auto: the weights'; fp8 stores K and V in 8 bits")
    g.add_argument("--kv-offloading-size", type=_gib, default=e.kv_offloading_size, metavar="GIB",
                   help="GiB of host memory for prefix-cache blocks the device pool evicts (0: none)")
    g.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=e.tensor_parallel_size, metavar="N",
                   help="devices the model is split over")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=e.enable_prefix_caching,
                   help="reuse the KV blocks of earlier prompts' shared prefixes")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=e.enable_chunked_prefill, help="split long prompts over several steps")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=e.async_scheduling,
                   help="schedule step N+1 while step N runs on the device")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default=e.scheduling_policy,
                   help="the order waiting requests are admitted in")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=e.attention_backend,
                   help="auto: the Pallas kernels on a GPU, the jnp reference elsewhere")
    g.add_argument("--seed", type=int, default=e.seed, metavar="N", help="the generator of requests without their own seed")
    p.add_argument("--debug", action="store_true", help="on an error, print the traceback, not one line")


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """``serve``'s own flags: where it listens, who may call it, and its limits."""
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="the port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $JAXPAGED_API_KEY if set, else none)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the MODEL argument)")
    from .serve.limits import MAX_N, MAX_STOP_STRINGS, ServerLimits  # (stdlib only: --help stays fast)

    d = ServerLimits()
    g = p.add_argument_group("server limits (a request over one gets an OpenAI error naming it)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body, chunked or not (413)")
    g.add_argument("--max-prompt-bytes", type=int, default=d.max_prompt_bytes,
                   help="largest text prompt, refused before it is tokenized (default: what max_model_len "
                        "tokens of the tokenizer's longest tokens can hold)")
    g.add_argument("--max-n", type=int, default=d.max_n, help=f"largest n (at most {MAX_N})")
    g.add_argument("--max-stop", type=int, default=d.max_stop,
                   help=f"most stop strings a request may give (at most {MAX_STOP_STRINGS})")
    g.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                   help="requests in progress at once; more are refused with 429")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a connection has to send a request's headers")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds a request has to send its body (408)")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM, seconds running requests may finish before they are aborted "
                        "(a second signal exits at once)")
    g = p.add_argument_group("scale-out (what routers and orchestrators read)")
    g.add_argument("--kv-events-config", type=_kv_events_config, default=None, metavar="JSON",
                   help="publish the prefix cache's changes in vLLM's KV-events format, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                        "\"topic\": \"kv-events\"}' (pip install 'jaxpaged[kv-events]'; default: none)")
    g.add_argument("--data-parallel-size", "-dp", type=_positive_int, default=1, metavar="N",
                   help="N engines (each of --tensor-parallel-size devices) on Ray Serve behind one HTTP endpoint, "
                        "requests routed by prefix-cache affinity and load (pip install 'jaxpaged[ray]'; "
                        "RAY_ADDRESS: an existing cluster, else a local one)")


def add_distributed_arguments(p: argparse.ArgumentParser) -> None:
    """One engine over several hosts (``jax.distributed``): ``serve`` and ``generate``. Each flag's default is
    its environment variable, so one command line serves every host of a deployment."""
    env = os.environ.get
    g = p.add_argument_group("several hosts (one process per host; --tensor-parallel-size: all their devices)")
    g.add_argument("--coordinator-address", type=_host_port, default=env("JAXPAGED_COORDINATOR_ADDRESS"),
                   metavar="HOST:PORT",
                   help="process 0's address for jax.distributed (it also listens on PORT+1 for the other "
                        "processes; default: $JAXPAGED_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=_positive_int, default=env("JAXPAGED_NUM_PROCESSES", "1"), metavar="N",
                   help="processes, one per host (default: $JAXPAGED_NUM_PROCESSES, else 1)")
    g.add_argument("--process-id", type=int, default=env("JAXPAGED_PROCESS_ID", "0"), metavar="I",
                   help="this process's index; 0 takes the requests, the others follow its engine "
                        "(default: $JAXPAGED_PROCESS_ID, else 0)")


def _set_defaults(p: argparse.ArgumentParser, note: str = "", **values) -> None:
    """A subcommand's own defaults for shared flags, its help saying so (``note``: for ``None`` defaults)."""
    p.set_defaults(**values)
    for action in p._actions:
        if action.dest in values:
            words = note.format(full=FULL_BENCH.get(action.dest), tiny=TINY_BENCH.get(action.dest))
            action.help = " ".join([action.help.split(" (default")[0], words]).strip()


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (every subcommand and flag)."""
    ap = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=_Formatter)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{demo,generate,bench,serve}")

    def command(name: str, help: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=description, formatter_class=_Formatter)

    d = command("demo", "generate with the packaged tiny model and print the KV cache statistics",
                "Requests that share a system prompt: their tokens, text, prefix-cache hits and KV statistics.")
    add_model_argument(d, TINY, what=" (default: tiny)")
    d.add_argument("--max-tokens", type=_positive_int, default=16, metavar="N", help="tokens to generate per request")
    add_engine_arguments(d)
    _set_defaults(d, block_size=8, num_blocks=128, max_model_len=256, max_num_batched_tokens=256)

    g = command("generate", "generate from a model and print the outputs and KV statistics",
                "Generates a reply to each --prompt (steps compile on first use: one batch does not pay for "
                "a warm-up).")
    add_model_argument(g)
    g.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for several")
    g.add_argument("--max-tokens", type=_positive_int, default=64, metavar="N", help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (default: the checkpoint's generation_config.json, else 1.0)")
    g.add_argument("--top-p", type=float, default=None, help="(default: the checkpoint's, else 1.0)")
    g.add_argument("--top-k", type=int, default=None, help="-1: off (default: the checkpoint's, else off)")
    add_engine_arguments(g)
    add_distributed_arguments(g)

    b = command("bench", "throughput on nano-vllm's workload (random Qwen3-0.6B weights by default)",
                "nano-vllm's throughput workload: --num-seqs requests, prompts and outputs of 100 to "
                "max-model-len/2 tokens each.")
    add_model_argument(b, what=" (default: random weights at Qwen3-0.6B's shapes)")
    b.add_argument("--num-seqs", type=_positive_int, default=None, metavar="N",
                   help="requests (default: 256; 16 with the tiny model)")
    add_engine_arguments(b)
    _set_defaults(b, note="(default: {full}; {tiny} with the tiny model)",  # the workload's (bench())
                  max_model_len=None, max_num_seqs=None, max_num_batched_tokens=None)

    s = command("serve", "an OpenAI-compatible HTTP server (pip install 'jaxpaged[serve]')",
                "Serves /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.")
    add_model_argument(s)
    add_server_arguments(s)
    add_engine_arguments(s)
    add_distributed_arguments(s)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line, its model settled (``MODEL`` or ``--model``, or the subcommand's default)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    flag, positional = args.model_flag, args.model
    if flag is not None and positional is not None and flag != positional:
        parser.error(f"MODEL {positional!r} and --model {flag!r} disagree: give one")
    args.model = positional or flag or args.model_default
    if args.model is None and args.cmd in ("generate", "serve"):
        parser.error(f"{args.cmd} needs a MODEL: a checkpoint folder, 'tiny', or a Hub id in the local cache")
    return args


def model_path(model: str) -> str:
    """The folder of a model argument: ``tiny``'s packaged checkpoint, else the folder or cached Hub id
    (checked now, so that a wrong one is reported before anything loads)."""
    if model == TINY:
        from .models.tiny import tiny_checkpoint_path

        return str(tiny_checkpoint_path("qwen3"))
    from .models.hub import resolve_model_path

    resolve_model_path(model)
    return model


DISTRIBUTED_FLAGS = ("coordinator_address", "num_processes", "process_id")  # add_distributed_arguments


def follow(llm_kwargs: dict) -> None:
    """A process other than 0 of several: builds the same engine, then runs process 0's calls until it stops."""
    from .llm import LLM

    print(f"{PROG}: process {llm_kwargs['process_id']} of {llm_kwargs['num_processes']}, following process 0 at "
          f"{llm_kwargs['coordinator_address']}", flush=True)
    LLM(**llm_kwargs).follow()


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``LLM`` keyword arguments of the engine flags (``EngineConfig``'s names, plus dtype and load_format)."""
    return dict(dtype=args.dtype, load_format=args.load_format, block_size=args.block_size,
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, memory_fraction=args.gpu_memory_utilization,
                enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
                async_scheduling=args.async_scheduling, scheduling_policy=args.scheduling_policy,
                kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
                attention_backend=args.attention_backend, num_blocks=args.num_blocks, seed=args.seed,
                kv_offloading_size=args.kv_offloading_size, quantization=args.quantization,
                **{name: getattr(args, name) for name in DISTRIBUTED_FLAGS if hasattr(args, name)})


def serve_llm_args(args: argparse.Namespace) -> dict:
    """The ``LLM`` keyword arguments of a ``serve`` command line (its engine flags under vLLM's names)."""
    return dict(model=model_path(args.model or args.model_flag), kv_events_config=args.kv_events_config,
                **engine_kwargs(args))


# ---- output --------------------------------------------------------------------------------------
def _print_outputs(outputs) -> None:
    for out in outputs:
        c = out.outputs[0]
        ttft = out.metrics.time_to_first_token
        print(f"[{out.request_id}] prompt {len(out.prompt_token_ids)} tokens ({out.num_cached_tokens} from the "
              f"prefix cache), TTFT {ttft * 1e3:.1f} ms, finish={c.finish_reason}")
        print(f"    prompt: {out.prompt!r}")
        print(f"    tokens: {c.token_ids}")
        print(f"    text:   {c.text!r}")


def _print_stats(llm) -> None:
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
    when = "at start-up" if llm.warmed_up else "on first use"
    n = s["compiled_shapes"]
    print(f"  compile: {s['compile_seconds']:.1f} s for {n} step shape{'' if n == 1 else 's'}, {when} "
          f"({s['attention_backend']} attention)")


# ---- commands ------------------------------------------------------------------------------------
def demo(args: argparse.Namespace) -> None:
    from .llm import LLM
    from .sampling import SamplingParams

    path = model_path(args.model)
    print(f"jaxpaged demo: {'tiny random Qwen3 checkpoint' if args.model == TINY else 'model'} at {path}\n")
    llm = LLM(path, **engine_kwargs(args))
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    compiled = llm.stats()["compile_seconds"]
    t0 = time.perf_counter()
    first = llm.generate([DEMO_SYSTEM + DEMO_QUESTIONS[0]], sp, use_tqdm=False)
    rest = llm.generate([DEMO_SYSTEM + q for q in DEMO_QUESTIONS[1:]], sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    _print_outputs(first + rest)
    compiling = llm.stats()["compile_seconds"] - compiled
    print(f"\n{len(DEMO_QUESTIONS)} requests in {seconds:.2f} s "
          + ("(steps compiled at start-up)" if llm.warmed_up else f"({compiling:.1f} s of it compiling steps on first use)"))
    print("first divergence of two prompts: "
          f"{llm.explain_prefix(DEMO_SYSTEM + DEMO_QUESTIONS[0], DEMO_SYSTEM + DEMO_QUESTIONS[1])}")
    _print_stats(llm)


def generate_cmd(args: argparse.Namespace) -> None:
    from .llm import LLM

    # One batch of prompts: compiling every step shape first would cost more than it saves.
    kwargs = dict(model=model_path(args.model), warmup=False, **engine_kwargs(args))
    if args.process_id:  # (its --prompt are process 0's to run)
        follow(kwargs)
        return
    llm = LLM(**kwargs)
    chosen = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
              if v is not None}
    sp = dataclasses.replace(llm.default_sampling_params, max_tokens=args.max_tokens, **chosen)
    _print_outputs(llm.generate(args.prompt, sp, use_tqdm=False))
    _print_stats(llm)
    llm.close()  # (with several processes: the others stop following)


def bench(args: argparse.Namespace) -> None:
    """nano-vllm's throughput workload (scaled by --num-seqs / --max-model-len) on a model or random weights."""
    from .engine.llm_engine import LLMEngine
    from .llm import run_to_completion
    from .models.checkpoint import load_params
    from .workloads import QWEN3_0_6B, nano_vllm_workload, random_model

    for name, value in (TINY_BENCH if args.model == TINY else FULL_BENCH).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    half = args.max_model_len // 2
    if half < 100:
        raise CLIError("--max-model-len must be at least 200 (prompts and outputs of 100..max_model_len/2 tokens)")
    dtype = None if args.dtype == "auto" else args.dtype
    if args.model:
        params = load_params(model_path(args.model), dtype, load_format=args.load_format,
                             tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization)
    else:
        params = random_model(QWEN3_0_6B, dtype or "bfloat16", tensor_parallel_size=args.tensor_parallel_size,
                              quantization=args.quantization)
    prompts, sps = nano_vllm_workload(args.num_seqs, half, half)
    vocab = params.config.vocab_size
    prompts = [[t % vocab for t in p] for p in prompts]
    config = {k: v for k, v in engine_kwargs(args).items() if k not in ("dtype", "load_format")}
    engine = LLMEngine(params, EngineConfig(**config))
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


def serve_cmd(args: argparse.Namespace) -> None:
    """The OpenAI-compatible server (``jaxpaged/serve``): loads the model, then listens; a process other than 0
    of several serves nothing and follows process 0's engine."""
    if args.process_id:
        if args.data_parallel_size > 1:
            raise CLIError("serve: --data-parallel-size is not supported with --num-processes > 1")
        follow(serve_llm_args(args))
        return
    try:
        from .serve.http_server import serve
    except ImportError as err:
        raise CLIError(f"serve needs the server's dependencies: pip install 'jaxpaged[serve]' ({err})") from err
    from .serve.limits import ServerLimits

    try:
        limits = ServerLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)})
    except ValueError as err:
        raise CLIError(f"serve: {err}") from err
    api_key = args.api_key or os.environ.get("JAXPAGED_API_KEY")
    if args.data_parallel_size > 1 and args.num_processes > 1:
        raise CLIError("serve: --data-parallel-size is not supported with --num-processes > 1")
    if args.data_parallel_size > 1:
        if api_key:
            raise CLIError("serve: --api-key is not supported with --data-parallel-size yet (put the key check "
                           "in front of Ray Serve's proxy)")
        try:
            from .serve.ray_serve import run
        except ImportError as err:
            raise CLIError(f"serve --data-parallel-size needs Ray Serve: pip install 'jaxpaged[ray]' ({err})") from err
        run(serve_llm_args(args), args.data_parallel_size, args.host, args.port,
            args.served_model_name or args.model, limits)
        return
    serve(serve_llm_args(args), args.host, args.port, args.served_model_name or args.model, api_key, limits)


COMMANDS = {"demo": demo, "generate": generate_cmd, "bench": bench, "serve": serve_cmd}


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, (CLIError, ValueError, TypeError, OSError, KeyError)):
        return text
    return f"{type(err).__name__}: {text}"


def main(argv: list[str] | None = None) -> int:
    """Runs one command line; returns its exit status (2: the problem was printed as one line)."""
    args = parse_args(argv)
    try:
        COMMANDS[args.cmd](args)
    except KeyboardInterrupt:
        print(f"{PROG} {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except (Exception, SystemExit) as err:
        if args.debug or (isinstance(err, SystemExit) and (err.code is None or isinstance(err.code, int))):
            raise  # (an exit status a command chose, e.g. serve's 1 when its engine stopped, is kept)
        print(f"{PROG} {args.cmd}: error: {_one_line(err)} (--debug for the traceback)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
