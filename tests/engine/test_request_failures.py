"""A failure belongs to the requests it came from: a request whose step cannot be built, or a step that
fails as a whole, ends those requests with ``finish_reason == "error"``; the engine goes on, other
requests finish with the tokens they would have had, and no KV block stays held."""

from __future__ import annotations

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.llm_engine import EngineDeadError
from jaxpaged.models.tiny import tiny_checkpoint_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_checkpoint_path("qwen3"), dtype="float32", max_model_len=64, num_blocks=32, block_size=8,
               max_num_seqs=4, max_num_batched_tokens=32, warmup=False)


def run(engine, limit=200):
    outs = {}
    for _ in range(limit):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


def test_a_request_that_cannot_be_stepped_fails_alone(llm):
    engine = llm.engine
    want = llm.generate([[1, 2, 3], [4, 5, 6, 7]], GREEDY, use_tqdm=False)
    good_a = engine.add_request([1, 2, 3], GREEDY)
    bad = engine.add_request([9, 9, 9], GREEDY)
    good_b = engine.add_request([4, 5, 6, 7], GREEDY)
    # What an out-of-range field past validation did: overflow the step's int32 arrays when they are built.
    engine._requests[bad].seqs[0].sampling_params.top_k = 2**40
    outs = run(engine)
    assert [c.finish_reason for c in outs[bad].outputs] == ["error"]
    assert outs[good_a].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert outs[good_b].outputs[0].token_ids == want[1].outputs[0].token_ids
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_a_failing_step_ends_its_requests_and_the_engine_goes_on(llm, monkeypatch):
    engine = llm.engine
    want = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    real_step, calls = engine.runner.step, []

    def failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device failure")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "step", failing_once)
    a = engine.add_request([1, 2, 3], GREEDY)
    b = engine.add_request([5, 6, 7], GREEDY)
    outs = run(engine)
    assert {c.finish_reason for o in (outs[a], outs[b]) for c in o.outputs} == {"error"}
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
    after = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert after == want


def test_a_failure_with_nothing_to_blame_stops_the_engine(llm, monkeypatch):
    engine = llm.engine

    def broken():
        raise RuntimeError("injected scheduler failure")

    engine.add_request([1, 2, 3], GREEDY)
    monkeypatch.setattr(engine.scheduler, "schedule", broken)
    with pytest.raises(EngineDeadError, match="injected scheduler failure"):
        engine.step()


def test_a_request_failing_mid_decode_drops_its_token_in_flight(llm):
    """Async scheduling: the failing request has a token in flight when it fails; that token is dropped
    when its step resolves, and the others keep decoding."""
    engine = llm.engine
    want = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    good = engine.add_request([1, 2, 3], GREEDY)
    bad = engine.add_request([7, 8, 9, 10], GREEDY)
    outs = {}
    for _ in range(3):  # prefill, then decodes: a token of each is in flight now
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    engine._requests[bad].seqs[0].sampling_params.top_k = 2**40
    outs.update(run(engine))
    assert outs[bad].outputs[0].finish_reason == "error" and len(outs[bad].outputs[0].token_ids) < 6
    assert outs[good].outputs[0].token_ids == want
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()
