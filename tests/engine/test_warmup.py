"""Start-up: ``LLM`` compiles every step a request can select before the first request, so none waits
for a compilation; ``warmup=False`` skips it."""

from __future__ import annotations

import dataclasses

import jax

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.sampling import grammar

# Block tables of 4 blocks (64 / 16), the reference backend's narrowest width: every step has the
# warmed-up width (that backend pads tables per step).
SMALL = dict(dtype="float32", block_size=16, num_blocks=32, max_model_len=64, max_num_seqs=8,
             max_num_batched_tokens=32, compilation_cache=False)


class CompileCounter:
    """Counts XLA backend compilations (JAX's own monitoring event) while active."""

    def __init__(self):
        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event: str, duration: float, **_kw) -> None:
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def test_llm_warms_up_and_no_request_compiles_afterwards():
    counter = CompileCounter()
    llm = LLM(tiny_checkpoint_path("qwen3"), warmup=True, **SMALL)
    runner = llm.engine.runner
    # Both sampler variants of both token buckets (16, 32), each with and without structured outputs' token
    # masks on a GPU where llguidance is installed: compiled at construction.
    structured = llm.engine.warms_up_structured_outputs
    assert structured == (jax.default_backend() == "gpu" and grammar.available())
    expected = 4 * (2 if structured else 1)
    assert runner.num_compiled_executables == expected
    counter.active = True
    sps = [SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=5),
           SamplingParams(temperature=0.7, top_k=5, seed=2, max_tokens=5), SamplingParams(temperature=1.0, seed=3)]
    if structured:
        sps[3].structured_outputs = StructuredOutputsParams(choice=["yes", "no"])
    outs = llm.generate([[1, 2, 3], [4, 5, 6, 7], list(range(1, 30)), [9]], sps, use_tqdm=False)
    counter.active = False
    assert [len(o.outputs[0].token_ids) for o in outs[:3]] == [5, 5, 5]
    assert runner.num_compiled_executables == expected
    assert counter.count == 0, f"{counter.count} XLA compilations after warm-up"
    llm.close()


def test_warmup_can_be_skipped_and_is_skipped_by_default_on_the_reference_backend():
    assert LLM(tiny_checkpoint_path("qwen3"), **SMALL).engine.runner.num_compiled_executables == 0
    llm = LLM(tiny_checkpoint_path("qwen3"), warmup=False, **SMALL)
    assert llm.engine.runner.num_compiled_executables == 0
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert llm.engine.runner.num_compiled_executables == 1  # compiled on first use instead


def test_settle_leaves_no_trace_a_user_can_see():
    """The throwaway requests that end a GPU warm-up: afterwards the stats, the step records, the KV
    event log and the prefix cache are as before, and the next request's output is unchanged."""
    from jaxpaged import EngineConfig, LLMEngine, load_params
    from jaxpaged.llm import run_to_completion

    config = EngineConfig(**{k: v for k, v in SMALL.items() if k != "dtype"}, kv_cache_dtype="float32", event_log=True,
                          seed=0)
    params = load_params(tiny_checkpoint_path("qwen3"), dtype="float32")
    sp = SamplingParams(temperature=0, max_tokens=4)
    plain, settled = LLMEngine(params, config), LLMEngine(params, config)
    compiles = ("compile_seconds", "compiled_shapes")  # (no warm-up here: settle compiles its step)
    before = {k: v for k, v in settled.stats().items() if k not in compiles}
    settled.settle()
    assert {k: v for k, v in settled.stats().items() if k not in compiles} == before
    assert settled.stats()["compiled_shapes"] == 1  # (the throwaway requests did run a step)
    assert len(settled.kv.events) == 0 and settled.metrics.records == []
    assert settled.kv.num_cached_blocks == 0
    # The next requests' outputs are unchanged, a sampled one without a seed included (its seed comes
    # from the engine's generator, which the throwaway requests drew from too).
    sampled = SamplingParams(temperature=1.0, max_tokens=6)
    outs = [[o.outputs[0].token_ids for o in run_to_completion(e, [list(range(1, 40)), [7, 8, 9]], [sp, sampled])]
            for e in (plain, settled)]
    assert outs[0] == outs[1]
    # An engine whose max_model_len is shorter than half a block still settles (shorter prompts).
    short = LLMEngine(params, dataclasses.replace(config, max_model_len=4))
    steps, step = [], short.step
    short.step = lambda: steps.append(1) or step()
    short.settle()
    assert len(steps) >= 3 and short.stats()["steps"] == 0
    # Requests already queued: settle does nothing (their outputs belong to the caller).
    rid = settled.add_request([5, 6, 7], sp)
    settled.settle()
    assert rid in settled._requests and settled.stats()["steps"] == plain.stats()["steps"]


def test_settle_under_tight_limits_and_a_bounded_event_log():
    """settle never raises for a valid engine, leaves a bounded event log exactly as it was, and does
    nothing where no throwaway prompt can stay under one block."""
    from jaxpaged import EngineConfig, LLMEngine, load_params
    from jaxpaged.llm import run_to_completion

    params = load_params(tiny_checkpoint_path("qwen3"), dtype="float32")
    base = dict(kv_cache_dtype="float32", num_blocks=32, max_model_len=64, max_num_seqs=8, compilation_cache=False)
    # Chunked prefill off and a token budget of 8: the prompt must fit the budget with its token.
    tight = LLMEngine(params, EngineConfig(**{**base, "max_model_len": None}, block_size=16,
                                           max_num_batched_tokens=8, enable_chunked_prefill=False))
    before = {k: v for k, v in tight.stats().items() if k not in ("compile_seconds", "compiled_shapes")}
    steps, step = [], tight.step
    tight.step = lambda: steps.append(1) or step()
    tight.settle()
    assert len(steps) >= 3  # (it ran, with 7-token prompts)
    assert {k: v for k, v in tight.stats().items() if k not in ("compile_seconds", "compiled_shapes")} == before
    # A log of 5 events, full of a real request's: settle's events (more than 5) leave it as it was.
    logged = LLMEngine(params, EngineConfig(**base, block_size=16, max_num_batched_tokens=32, event_log=5))
    run_to_completion(logged, [[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=2))
    events = list(logged.kv.events)
    assert events and all(e.request_id != "jaxpaged-settle-0" for e in events)
    logged.settle()
    assert list(logged.kv.events) == events
    # Block size 1: any prompt fills a block (it would be cached), so settle does nothing.
    one = LLMEngine(params, EngineConfig(**{**base, "max_model_len": 16}, block_size=1, max_num_batched_tokens=32,
                                         attention_backend="triton"))
    steps, step = [], one.step
    one.step = lambda: steps.append(1) or step()
    one.settle()
    assert steps == [] and one.kv.num_cached_blocks == 0


def test_preload_skips_shapes_already_compiled():
    """The warm-up's executables are read ahead only for shapes not compiled yet (the runner is shared
    by every engine over the same weights)."""
    from jaxpaged import EngineConfig, LLMEngine, load_params

    class Reads:  # an executable cache that records what is asked of it and has nothing
        def __init__(self):
            self.names = []

        def load(self, name):
            self.names.append(name)

        def store(self, name, compiled):
            pass

    params = load_params(tiny_checkpoint_path("qwen3"), dtype="float32")
    config = EngineConfig(**{k: v for k, v in SMALL.items() if k != "dtype"}, kv_cache_dtype="float32",
                          attention_backend="triton")
    engine = LLMEngine(params, config)
    engine.runner.executable_cache = reads = Reads()
    engine._preload_warmup()
    for future in list(engine.runner._preloads.values()):
        future.result()
    assert len(reads.names) == 4  # 2 token buckets x 2 sampler variants
    engine.warmup(use_tqdm=False)
    assert engine.runner._preloads == {}  # taken by the warm-up (misses: compiled there)
    reads.names.clear()
    LLMEngine(params, config)._preload_warmup()  # a second engine over the same weights
    assert reads.names == [] and engine.runner._preloads == {}
