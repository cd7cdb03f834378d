"""Structured outputs' cost: nano-vllm's workload with a fraction of its requests JSON-constrained, the
grammar compile time per schema, and the time to first token of a constrained request with a new schema.

Workload: nano-vllm's (``jaxpaged.workloads.nano_vllm_workload``: random weights at a model's shapes,
``--num-seqs`` requests, ``ignore_eos``); for each ``--fractions`` value ``f`` every request whose index
``i`` has ``floor((i + 1) * f) > floor(i * f)`` is constrained to a 10-field JSON schema
(``SCHEMA``). Its free strings let random weights run to ``max_tokens`` as the unconstrained requests do,
so every run generates about the same tokens. Each fraction runs on a fresh engine after its warm-up (the
constrained step variants included), the same engine for all fractions; output tok/s and the ratio to
fraction 0.

The grammar needs a tokenizer: ``--tokenizer`` (a ``tokenizer.json``, e.g. Qwen3's, for the real mask
cost), else a synthetic byte-level BPE tokenizer as large as the model's vocabulary (``synthetic_tokenizer``:
every token a string of letters, so its masks cost what a real vocabulary's do, within a factor), else,
for ``--model tiny``, the tiny checkpoint's.

    python benchmarks/bench_structured.py --out $OUT                      # GPU: qwen3-0.6b, 256 requests
    python benchmarks/bench_structured.py --model tiny --num-seqs 8 --out /tmp/s     # CPU, seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import string
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams, load_tokenizer  # noqa: E402
from jaxpaged.llm import run_to_completion  # noqa: E402
from jaxpaged.models.tiny import tiny_checkpoint_path  # noqa: E402
from jaxpaged.workloads import benchmark_params, nano_vllm_workload  # noqa: E402

FIELDS = {"id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
          "age": {"type": "integer", "minimum": 0, "maximum": 150}, "active": {"type": "boolean"},
          "role": {"enum": ["admin", "user", "guest"]}, "score": {"type": "number"},
          "tags": {"type": "array", "items": {"type": "string"}},
          "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                      "required": ["city"]},
          "notes": {"type": "string"}}
SCHEMA = {"type": "object", "properties": FIELDS, "required": list(FIELDS), "additionalProperties": False}


def synthetic_tokenizer(vocab_size: int, folder: Path) -> Path:
    """A byte-level BPE ``tokenizer.json`` of ``vocab_size`` tokens in ``folder``: the 256 byte tokens,
    then letter strings ("Ġ" + word, and words) built by merges, then EOS as its last id."""
    byte_chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(161, 173)] + [chr(c) for c in range(174, 256)]
    byte_chars += [chr(256 + i) for i in range(256 - len(byte_chars))]  # (GPT-2's byte -> unicode map's size)
    vocab = {c: i for i, c in enumerate(byte_chars)}
    merges = []
    letters = string.ascii_lowercase
    for length in itertools.count(2):
        for prefix in ("Ġ", ""):
            for word in itertools.product(letters, repeat=length - (prefix == "Ġ") or 1):
                token = prefix + "".join(word)
                if len(token) < 2 or token in vocab:
                    continue
                vocab[token] = len(vocab)
                merges.append(f"{token[:-1]} {token[-1]}")
                if len(vocab) == vocab_size - 1:
                    break
            if len(vocab) == vocab_size - 1:
                break
        if len(vocab) == vocab_size - 1:
            break
    eos = vocab_size - 1
    spec = {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [{"id": eos, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}],
            "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                                  "use_regex": True},
            "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                                "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                      "merges": merges}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return folder


def structured(f: float, n: int) -> list[bool]:
    """Which of ``n`` requests are constrained at fraction ``f`` (spread evenly)."""
    return [int((i + 1) * f) > int(i * f) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--model", default="qwen3-0.6b", choices=["qwen3-0.6b", "tiny"])
    ap.add_argument("--fractions", default="0,0.25,1", help="fractions of constrained requests")
    ap.add_argument("--num-seqs", type=int, default=None, help="default 256; 16 for tiny")
    ap.add_argument("--max-input-len", type=int, default=None, help="default 1024; 128 for tiny")
    ap.add_argument("--max-output-len", type=int, default=None, help="default 1024; 128 for tiny")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: see the module docstring)")
    args = ap.parse_args()
    tiny = args.model == "tiny"
    n = args.num_seqs or (16 if tiny else 256)
    params = benchmark_params(args.model)
    vocab = params.config.vocab_size
    tmp = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    if args.tokenizer:
        (tmp / "tokenizer.json").write_bytes(Path(args.tokenizer).read_bytes())
        folder = tmp
    else:
        folder = tiny_checkpoint_path("qwen3") if tiny else synthetic_tokenizer(vocab, tmp)
    tokenizer = load_tokenizer(folder)
    config = EngineConfig(max_model_len=256 if tiny else 2048, max_num_seqs=16 if tiny else 256,
                          max_num_batched_tokens=512 if tiny else 8192, memory_fraction=0.9)
    engine = LLMEngine(params, config, tokenizer=tokenizer)
    compile_s = engine.warmup(use_tqdm=False)
    result = {"model": args.model, "num_seqs": n, "vocab_size": vocab, "tokenizer_vocab": tokenizer.vocab_size,
              "warmup_seconds": compile_s, "runs": {}}

    # Grammar compile time per schema: the first compile of each, then the cache.
    grammars = engine.grammar_compiler()
    compile_times = {}
    for name, spec in (("json_10_fields", StructuredOutputsParams(json=SCHEMA)),
                       ("json_object", StructuredOutputsParams(json_object=True)),
                       ("regex", StructuredOutputsParams(regex=r"\d{3}-[a-z]{2,8}")),
                       ("choice_16", StructuredOutputsParams(choice=[f"option {i}" for i in range(16)]))):
        t = time.perf_counter()
        grammars.submit(spec).result()
        first = time.perf_counter() - t
        t = time.perf_counter()
        grammars.submit(spec).result()
        compile_times[name] = {"first_s": first, "cached_s": time.perf_counter() - t}
    result["compile"] = compile_times
    print("grammar compile:", json.dumps(compile_times), flush=True)

    # TTFT of a lone request: unconstrained, then constrained to a schema never seen (compiled on arrival).
    prompt = [int(t) % vocab for t in range(1, 65)]
    run_to_completion(engine, [prompt[:16]], SamplingParams(max_tokens=4))  # one tiny real request first
    ttft = {}
    for name, so in (("unconstrained", None),
                     ("new_schema", StructuredOutputsParams(json=dict(SCHEMA, title=f"fresh-{time.time()}"))),
                     ("cached_schema", StructuredOutputsParams(json=SCHEMA))):
        engine.add_request(prompt, SamplingParams(max_tokens=2, structured_outputs=so))
        t = time.perf_counter()
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            if first is None and any(len(s.token_ids) > len(prompt) and s.token_ids[-1] >= 0
                                     for s in engine.scheduler.running):
                first = time.perf_counter() - t
        ttft[name] = first if first is not None else time.perf_counter() - t
    result["ttft_s"] = ttft
    print("TTFT (lone request):", json.dumps(ttft), flush=True)

    prompts, sps = nano_vllm_workload(n, args.max_input_len or (128 if tiny else 1024),
                                      args.max_output_len or (128 if tiny else 1024))
    prompts = [[t % vocab for t in p] for p in prompts]
    base = None
    for f in [float(x) for x in args.fractions.split(",")]:
        mine = [SamplingParams(temperature=sp.temperature, ignore_eos=True, max_tokens=sp.max_tokens,
                               structured_outputs=StructuredOutputsParams(json=SCHEMA) if c else None)
                for sp, c in zip(sps, structured(f, n))]
        steps = engine.metrics.total_steps
        t = time.perf_counter()
        outs = run_to_completion(engine, prompts, mine)
        seconds = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        grammar = grammars.submit(StructuredOutputsParams(json=SCHEMA)).result()
        rejected = sum(not all(m.accept(t) for t in o.outputs[0].token_ids)
                       for o, c, m in ((o, c, grammar.matcher()) for o, c in zip(outs, structured(f, n))) if c)
        run = {"constrained": sum(structured(f, n)), "rejected_by_grammar": rejected, "output_tokens": tokens,
               "seconds": seconds,
               "tok_per_s": tokens / seconds, "steps": engine.metrics.total_steps - steps,
               "finish_reasons": {r: sum(o.outputs[0].finish_reason == r for o in outs) for r in ("stop", "length", "error")}}
        base = base or run["tok_per_s"]
        run["vs_unconstrained"] = run["tok_per_s"] / base
        result["runs"][str(f)] = run
        print(f"fraction {f}: {json.dumps(run)}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_structured.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    print(f"\n{'constrained':24s} {'requests':>8s} {'invalid':>8s} {'tok/s':>9s} {'vs 0%':>6s} {'steps':>6s}")
    for name, run in result["runs"].items():
        print(f"{name:24s} {run['constrained']:8d} {run['rejected_by_grammar']:8d} {run['tok_per_s']:9.0f} "
              f"{run['vs_unconstrained']:6.2f} {run['steps']:6d}")
    print(f"grammar compile (first, 10-field schema): {compile_times['json_10_fields']['first_s'] * 1e3:.1f} ms; "
          f"TTFT of a lone request: unconstrained {ttft['unconstrained'] * 1e3:.1f} ms, new schema "
          f"{ttft['new_schema'] * 1e3:.1f} ms, cached schema {ttft['cached_schema'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
