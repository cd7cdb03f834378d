"""Structured outputs end to end on the tiny checkpoint (random weights: the mask does all the work):
every output parses and validates against its JSON schema, matches its regex, is one of its choices,
through ``LLM.generate`` (n > 1, prefix caching, async scheduling) and ``jaxpaged.generate``; constrained
requests leave the unconstrained ones in their batch bitwise unchanged (``batch_invariant=True``); a
constraint that cannot be compiled is a ``ValueError`` naming its field; a matcher's failure ends its
request only."""

from __future__ import annotations

import json
import re

import pytest

import jaxpaged
from jaxpaged import LLM, EngineConfig, SamplingParams, StructuredOutputsParams
from jaxpaged.models.tiny import tiny_checkpoint_path

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

# Small schemas whose every value is bounded (random weights never choose to stop a free string or number):
# nested objects, enums, arrays, required fields, optional ones.
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}},
     "required": ["ok", "size"], "additionalProperties": False},
    {"type": "object", "properties": {
        "u": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "on": {"type": "boolean"}},
              "required": ["id"], "additionalProperties": False},
        "t": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
     "required": ["u", "t"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 3}, "n": {"type": "null"}},
     "required": ["name"], "additionalProperties": False},
]
REGEX = r"[a-c]{2}-\d{1,2}"
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def llm():
    with LLM(tiny_checkpoint_path("qwen3"), dtype="float32", max_model_len=128, num_blocks=64,
             max_num_seqs=16) as llm:
        yield llm


def so(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 48)
    return SamplingParams(**kwargs)


def check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_outputs_follow_their_constraints(llm):
    prompts, sps, checks = [], [], []
    for i, schema in enumerate(SCHEMAS):
        prompts.append(f"JSON {i}:")
        sps.append(so(temperature=1.0, seed=i, n=2,
                      structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
        checks.append(lambda t, s=schema: check_json(t, s))
    prompts += ["Code:", "Answer:", "Anything:"]
    sps += [so(temperature=0.9, seed=7, n=3, structured_outputs=StructuredOutputsParams(regex=REGEX)),
            so(temperature=0.0, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
            so(temperature=1.0, seed=3, top_k=20, top_p=0.9, structured_outputs=StructuredOutputsParams(
                grammar='start: "(" num ("," num)? ")"\nnum: /[0-9]/'))]
    checks += [lambda t: re.fullmatch(REGEX, t) or pytest.fail(t), lambda t: t in CHOICES or pytest.fail(t),
               lambda t: re.fullmatch(r"\(\d(,\d)?\)", t) or pytest.fail(t)]
    prompts.append("Free text")
    sps.append(so(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True))
    outs = llm.generate(prompts, sps, use_tqdm=False)
    for out, check in zip(outs[:-1], checks):
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            check(c.text)
    assert len(outs[-1].outputs[0].token_ids) == 12 and outs[-1].outputs[0].finish_reason == "length"
    # The same schema again: its grammar comes from the cache, its prompt from the prefix cache.
    again = llm.generate(prompts[0], sps[0], use_tqdm=False)[0]
    assert [c.text for c in again.outputs] == [c.text for c in outs[0].outputs]
    # json_object: any JSON object; max_tokens still ends a request its grammar has not finished
    obj = llm.generate("Object:", so(temperature=1.0, seed=5, max_tokens=4, structured_outputs=StructuredOutputsParams(
        json_object=True)), use_tqdm=False)[0].outputs[0]
    assert obj.finish_reason == "length" and obj.text.startswith("{") and len(obj.token_ids) == 4


def test_uncompilable_constraint_is_a_value_error_naming_the_field(llm):
    for kwargs, field in ((dict(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "json"),
                          (dict(regex="(unclosed"), "regex"), (dict(grammar="start: missing"), "grammar")):
        with pytest.raises(ValueError, match=f"StructuredOutputsParams.{field}"):
            llm.generate(["fine", "bad"], [so(), so(structured_outputs=StructuredOutputsParams(**kwargs))],
                         use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing of the refused batch was queued


def test_a_failing_matcher_ends_its_request_only(llm, monkeypatch):
    from jaxpaged.sampling.grammar import GrammarMatcher

    def refuse(self, token):  # a matcher that refuses every token (as a broken grammar backend would)
        return False

    monkeypatch.setattr(GrammarMatcher, "accept", refuse)
    outs = llm.generate(["a", "b"], [so(structured_outputs=StructuredOutputsParams(choice=CHOICES)),
                                     so(max_tokens=6, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6


def test_a_matcher_failing_at_its_mask_ends_its_request_only(llm, monkeypatch):
    from jaxpaged.sampling.grammar import GrammarMatcher

    def broken(self, bitmask, row):  # the mask is computed after the step is launched: it fails there
        raise RuntimeError("matcher broke")

    monkeypatch.setattr(GrammarMatcher, "fill_bitmask", broken)
    outs = llm.generate(["a", "b"], [so(structured_outputs=StructuredOutputsParams(choice=CHOICES)),
                                     so(max_tokens=6, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 6


def test_logprobs_are_those_of_the_masked_samples(llm):
    """A constrained row's token and its logprobs come from the second program: the logprobs name the
    token the output has, at every position, beside an unconstrained request's."""
    outs = llm.generate(["Pick:", "Free:"], [
        so(temperature=1.0, seed=2, logprobs=2, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        so(temperature=1.0, seed=2, logprobs=4, max_tokens=8, ignore_eos=True)], use_tqdm=False)
    for out, k in zip(outs, (2, 4)):  # (the step's top-k is the wider one)
        c = out.outputs[0]
        assert len(c.logprobs) == len(c.token_ids) and all(len(lps) in (k, k + 1) for lps in c.logprobs)
        for token, lps in zip(c.token_ids, c.logprobs):
            # the sampled token's own (logprob, rank) agree with the top ones': distinct ranks in logprob order
            ranked = sorted(lps.values(), key=lambda lp: lp.rank)
            assert token in lps and len({lp.rank for lp in ranked}) == len(ranked), (token, lps)
            assert all(a.logprob > b.logprob for a, b in zip(ranked, ranked[1:])), (token, lps)
    assert re.fullmatch(REGEX, outs[0].outputs[0].text)


def test_a_failing_second_program_loses_no_finished_output(llm, monkeypatch):
    """The masked rows' program fails in the step that read back the token a request stops on: the step
    fails (the requests it held end with an error), and the request that stopped still gets its output."""
    engine = llm.engine
    # "short" stops on its second greedy token, found when that token is read back (not when it is booked)
    first, second = llm.generate([[5, 6]], so(temperature=0.0, max_tokens=2, ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids
    assert first != second
    real = engine.runner.resample_rows

    def failing(*args, **kwargs):
        if "short" not in engine._requests:  # its output was made this step, before this launch
            raise RuntimeError("second program failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "resample_rows", failing)
    engine.add_request([7, 8], so(temperature=1.0, seed=1, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{40}")), request_id="constrained")
    engine._requests["constrained"].seqs[0].structured.grammar.result()  # compiled: both requests run together
    engine.add_request([5, 6], so(temperature=0.0, stop_token_ids=[second]), request_id="short")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o.outputs[0].finish_reason) for o in engine.step() if o.finished)
    assert finished == {"short": "stop", "constrained": "error"}, finished


def test_the_warm_up_compiles_the_second_program_a_request_uses(monkeypatch):
    from jaxpaged import LLMEngine
    from jaxpaged.llm import run_to_completion

    monkeypatch.setattr(LLMEngine, "warms_up_structured_outputs", property(lambda self: True))  # (a GPU's)
    path = tiny_checkpoint_path("qwen3")
    eng = LLMEngine(jaxpaged.load_params(path, "float32"), EngineConfig(
        max_model_len=64, num_blocks=16, max_num_seqs=8, max_num_batched_tokens=32), tokenizer=jaxpaged.load_tokenizer(path))
    eng._warmup_resample()  # (a GPU's warm-up runs it after the steps; here alone)
    compiled = eng.runner._resample._cache_size()
    assert compiled > 0
    out = run_to_completion(eng, [[5, 6, 7]], so(temperature=1.0, seed=1, structured_outputs=StructuredOutputsParams(
        choice=CHOICES)))[0].outputs[0]
    assert out.text in CHOICES and eng.runner._resample._cache_size() == compiled


def test_functional_generate():
    path = tiny_checkpoint_path("qwen3")
    outs = jaxpaged.generate(jaxpaged.load_params(path, "float32"), ["Hi", "Yo"],
                             config=EngineConfig(max_model_len=64, num_blocks=16),
                             sampling_params=so(temperature=1.0, seed=4, structured_outputs=StructuredOutputsParams(
                                 json=SCHEMAS[0], disable_any_whitespace=True)),
                             tokenizer=jaxpaged.load_tokenizer(path))
    for out in outs:
        check_json(out.outputs[0].text, SCHEMAS[0])


@pytest.mark.parametrize("backend", ["triton"])
def test_unconstrained_requests_keep_their_tokens(backend):
    """Unconstrained requests batched with constrained ones get bitwise the tokens they get alone
    (``batch_invariant=True``; the constrained rows' masks and their steps sat out change nothing else)."""
    from jaxpaged import LLMEngine
    from jaxpaged.llm import run_to_completion

    path = tiny_checkpoint_path("qwen3")
    eng = LLMEngine(jaxpaged.load_params(path, "float32"), EngineConfig(
        max_model_len=64, num_blocks=16, block_size=16, max_num_batched_tokens=16, batch_invariant=True,
        attention_backend=backend, enable_prefix_caching=False), tokenizer=jaxpaged.load_tokenizer(path))
    free = [[5, 6, 7], [9, 10]]
    # (no top-k / top-p here: each sampler variant is one more interpret-mode compilation on a CPU)
    free_sps = [so(temperature=0.0, max_tokens=5, ignore_eos=True), so(temperature=1.0, seed=3, max_tokens=6,
                                                                       ignore_eos=True)]
    alone = [run_to_completion(eng, [p], sp)[0].outputs[0].token_ids for p, sp in zip(free, free_sps)]
    constrained = [so(temperature=1.0, seed=1, structured_outputs=StructuredOutputsParams(choice=CHOICES)),
                   so(temperature=0.0, structured_outputs=StructuredOutputsParams(regex=REGEX))]
    outs = run_to_completion(eng, [[11, 12], free[0], [13], free[1]],
                             [constrained[0], free_sps[0], constrained[1], free_sps[1]])
    assert [outs[1].outputs[0].token_ids, outs[3].outputs[0].token_ids] == alone
    assert outs[0].outputs[0].text in CHOICES and re.fullmatch(REGEX, outs[2].outputs[0].text)


def test_constrained_rows_decode_every_step(llm):
    """Async scheduling: a constrained row's mask needs the token still in flight when its step is
    launched, so it samples in a second program behind the step; no row sits a step out and nothing
    waits: constrained rows alone, or among unconstrained ones, take a token every step."""
    engine = llm.engine
    assert engine.config.async_scheduling
    letters = StructuredOutputsParams(regex="[a-z]{400}")  # longer than 24 tokens can write

    def steps_for(sps) -> tuple[int, list[int]]:
        before = engine.metrics.total_steps
        outs = llm.generate(["Go:"] * len(sps), sps, use_tqdm=False)
        assert all(re.fullmatch("[a-z]*", o.outputs[0].text) for o, sp in zip(outs, sps) if sp.structured_outputs)
        return engine.metrics.total_steps - before, [len(o.outputs[0].token_ids) for o in outs]

    steps, lengths = steps_for([so(temperature=1.0, seed=s, max_tokens=24, structured_outputs=letters)
                                for s in range(4)])
    assert lengths == [24] * 4 and 24 <= steps <= 24 + 2, steps
    free = [so(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True) for s in range(3)]
    steps, lengths = steps_for([so(temperature=1.0, seed=9, max_tokens=24, structured_outputs=letters)] + free)
    assert lengths == [24] * 4 and 24 <= steps <= 24 + 2, steps
