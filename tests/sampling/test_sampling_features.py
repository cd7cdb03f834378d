"""vLLM's sampling parameters against numpy references: logprobs / prompt_logprobs (HF reference
logits), penalties, min_p, min_tokens, stop strings, n; async and sync scheduling agree."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, generate, load_params, load_tokenizer
from jaxpaged.llm import run_to_completion
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.sampling.penalties import apply_penalties, mask_stop_tokens
from jaxpaged.sampling.sampler import apply_min_p

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CFG = dict(kv_cache_dtype="float32", block_size=8, num_blocks=96, max_model_len=96)


@pytest.fixture(scope="module")
def qwen3():
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    return params, np.load(FIXTURES / "hf_reference_qwen3.npz"), load_tokenizer(tiny_checkpoint_path("qwen3"))


def prompts(ref):
    return [list(map(int, ref[f"prompt_{i}"])) for i in range(4)]


def log_softmax(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def both_modes(params, ps, sps, tokenizer=None, **cfg):
    """Outputs under async and sync scheduling; asserts they are equal and returns one list."""
    results = []
    for mode in (True, False):
        outs = generate(params, ps, EngineConfig(**{**CFG, **cfg}, async_scheduling=mode), sps, tokenizer)
        results.append(outs)
    a, b = ([(c.token_ids, c.text, c.finish_reason, c.stop_reason) for o in r for c in o.outputs] for r in results)
    assert a == b
    return results[0]


# ---- device functions against numpy ------------------------------------------------------------------

def test_penalties_match_numpy():
    rng = np.random.default_rng(0)
    s, v, h = 3, 40, 12
    logits = rng.normal(size=(s, v)).astype(np.float32) * 3
    history = rng.integers(0, v, size=(s, h)).astype(np.int32)
    history[2, 8:] = -1  # padding
    num_prompt = np.array([5, 0, 4], np.int32)
    pres, freq, rep = np.array([0.5, 0.0, -1.0], np.float32), np.array([0.3, 1.0, 0.0], np.float32), \
        np.array([1.3, 1.0, 0.7], np.float32)
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(history), jnp.asarray(num_prompt),
                                     jnp.asarray(pres), jnp.asarray(freq), jnp.asarray(rep)))
    want = logits.copy()
    for i in range(s):
        toks = [t for t in history[i] if t >= 0]
        out = toks[num_prompt[i]:]
        for t in set(toks):  # repetition: prompt or output
            want[i, t] = want[i, t] / rep[i] if want[i, t] > 0 else want[i, t] * rep[i]
        for t in set(out):
            want[i, t] -= freq[i] * out.count(t) + pres[i]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    neutral = apply_penalties(jnp.asarray(logits), jnp.asarray(history), jnp.asarray(num_prompt),
                              jnp.zeros(s), jnp.zeros(s), jnp.ones(s))
    np.testing.assert_array_equal(np.asarray(neutral), logits)  # neutral rows: bitwise unchanged


def test_min_p_and_stop_mask_match_numpy():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]], np.float32))
    kept = np.isfinite(np.asarray(apply_min_p(jnp.asarray(logits), jnp.asarray([0.5, 0.0]))))
    np.testing.assert_array_equal(kept, [[True, True, False, False], [True] * 4])  # p >= 0.5 * 0.5
    masked = np.asarray(mask_stop_tokens(jnp.asarray(logits), jnp.asarray([[1, 3], [0, -1]]),
                                         jnp.asarray([True, False])))
    assert np.isinf(masked[0, [1, 3]]).all() and np.isfinite(masked[0, [0, 2]]).all()
    np.testing.assert_array_equal(masked[1], logits[1])


# ---- logprobs against the Hugging Face reference logits ---------------------------------------------

def test_logprobs_and_prompt_logprobs_match_hf(qwen3):
    params, ref, _ = qwen3
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    outs = both_modes(params, prompts(ref), sp)
    for i, out in enumerate(outs):
        prompt, hf = list(map(int, ref[f"prompt_{i}"])), log_softmax(ref[f"logits_{i}"])
        comp = out.outputs[0]
        assert comp.token_ids == list(map(int, ref[f"greedy_{i}"]))[:5]
        first = comp.logprobs[0]
        tok = comp.token_ids[0]
        assert first[tok].rank == 1 and abs(first[tok].logprob - hf[-1, tok]) < 1e-4
        assert list(first)[:1] == [tok] and len(first) == 3  # greedy: sampled token is in the top 3
        np.testing.assert_array_equal(sorted(first), sorted(np.argsort(-hf[-1])[:3]))
        for lp in comp.logprobs:
            assert max(v.logprob for v in lp.values()) <= 0 and sorted(v.rank for v in lp.values()) == [1, 2, 3]
        assert abs(comp.cumulative_logprob - sum(lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs))) < 1e-5
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for p in range(1, len(prompt)):
            t = prompt[p]
            assert abs(plp[p][t].logprob - hf[p - 1, t]) < 1e-4
            assert plp[p][t].rank == int((hf[p - 1] >= hf[p - 1, t]).sum())
            assert {k for k, v in plp[p].items() if v.rank <= 2} >= set(np.argsort(-hf[p - 1])[:2].tolist())


def test_prompt_logprobs_complete_despite_prefix_cache(qwen3):
    params, ref, _ = qwen3
    engine = LLMEngine(params, EngineConfig(**CFG))
    p = prompts(ref)[2]
    sp = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    a = run_to_completion(engine, [p], sp)[0]
    b = run_to_completion(engine, [p], sp)[0]
    assert all(x is not None for x in b.prompt_logprobs[1:])
    assert [list(x) for x in a.prompt_logprobs[1:]] == [list(x) for x in b.prompt_logprobs[1:]]


# ---- penalties, min_p, min_tokens in the engine --------------------------------------------------------

def test_repetition_penalty_first_token_matches_numpy(qwen3):
    params, ref, _ = qwen3
    sp = SamplingParams(temperature=0.0, max_tokens=1, repetition_penalty=1.8, ignore_eos=True)
    outs = both_modes(params, prompts(ref), sp)
    for i, out in enumerate(outs):
        logits = ref[f"logits_{i}"][-1].copy()
        for t in set(map(int, ref[f"prompt_{i}"])):
            logits[t] = logits[t] / 1.8 if logits[t] > 0 else logits[t] * 1.8
        assert out.outputs[0].token_ids == [int(np.argmax(logits))]


def test_frequency_and_presence_penalties_stop_repeats_and_leave_other_rows_alone(qwen3):
    params, ref, _ = qwen3
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = both_modes(params, prompts(ref), [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0),
        plain,
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, presence_penalty=2.0),
        SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True, seed=3, frequency_penalty=1.0,
                       presence_penalty=0.5, repetition_penalty=1.2)])
    greedy = [list(map(int, ref[f"greedy_{i}"])) for i in range(4)]
    assert len(set(greedy[0])) < 24  # the plain greedy output repeats tokens ...
    for i in (0, 2):
        toks = outs[i].outputs[0].token_ids
        assert len(set(toks)) == len(toks), toks  # ... a penalty of 2 removes repeats in this model
    assert outs[1].outputs[0].token_ids == greedy[1]  # the row without penalties is unchanged


def test_min_p_one_is_greedy(qwen3):
    params, ref, _ = qwen3
    outs = both_modes(params, prompts(ref), SamplingParams(temperature=1.0, min_p=1.0, max_tokens=24,
                                                           ignore_eos=True, seed=7))
    assert [o.outputs[0].token_ids for o in outs] == [list(map(int, ref[f"greedy_{i}"])) for i in range(4)]


def test_min_tokens_masks_stop_tokens(qwen3):
    params, ref, _ = qwen3
    greedy0 = list(map(int, ref["greedy_0"]))
    stop = greedy0[2]
    assert stop not in greedy0[:2]
    p = prompts(ref)[0]
    short = both_modes(params, [p], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop]))
    assert short[0].outputs[0].token_ids == greedy0[:3] and short[0].outputs[0].stop_reason == stop
    outs = both_modes(params, [p], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop],
                                                  min_tokens=6))
    toks = outs[0].outputs[0].token_ids
    assert len(toks) >= 6 and stop not in toks[:6] and toks[:2] == greedy0[:2]
    assert outs[0].outputs[0].finish_reason == ("stop" if stop in toks else "length")


# ---- stop strings ----------------------------------------------------------------------------------

def test_stop_strings_across_token_boundaries(qwen3):
    params, ref, tok = qwen3
    p = prompts(ref)[1]
    base = generate(params, [p], EngineConfig(**CFG), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                    tok)[0].outputs[0]
    ids, text = base.token_ids, base.text
    pieces = [tok.decode(ids[:m]) for m in range(len(ids) + 1)]
    m = next(m for m in range(3, len(ids)) if len(pieces[m]) > len(pieces[m - 1]) + 1 and len(pieces[m - 1]) > 2)
    stop = pieces[m][len(pieces[m - 1]) - 2: len(pieces[m - 1]) + 1]  # 2 chars of one token, 1 of the next
    idx = text.find(stop)
    n_tokens = next(k for k in range(len(ids) + 1) if stop in pieces[k])
    for include in (False, True):
        sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=["never-there", stop],
                            include_stop_str_in_output=include)
        out = both_modes(params, [p], sp, tok)[0].outputs[0]
        assert out.text == text[: idx + (len(stop) if include else 0)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == ids[:n_tokens]


# ---- n ---------------------------------------------------------------------------------------------

def test_n_samples_share_the_prompt_blocks(qwen3):
    params, ref, _ = qwen3
    bs = CFG["block_size"]
    p = prompts(ref)[2]  # 30 tokens: 3 full blocks + 6
    engine = LLMEngine(params, EngineConfig(**CFG, max_num_seqs=8))
    sp = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=10, n=3)
    rid = engine.add_request(p, sp)
    engine.step()  # sample 0 computes the prompt; the others wait for its blocks
    engine.step()  # samples 1 and 2 admitted on prefix hits
    tables = [engine.kv.block_table(s) for s in engine._requests[rid].seqs]
    full = len(p) // bs
    assert tables[0][:full] == tables[1][:full] == tables[2][:full]
    assert all(engine.kv.allocator.ref_count(b) == 3 for b in tables[0][:full])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and [c.index for c in outs[0].outputs] == [0, 1, 2]
    stats = engine.stats()
    assert stats["prefix_hit_tokens"] == 2 * full * bs
    assert stats["prefill_tokens"] == len(p) + 2 * (len(p) - full * bs)  # the prompt computed once
    engine.kv.check_invariants()
    assert stats["blocks_used"] == 0
    seqs = [c.token_ids for c in outs[0].outputs]
    assert len({tuple(s) for s in seqs}) == 3  # distinct streams
    for i in range(3):  # sample i == a single request with seed + i
        alone = generate(params, [p], EngineConfig(**CFG), SamplingParams(temperature=1.0, max_tokens=6,
                                                                          ignore_eos=True, seed=10 + i))
        assert alone[0].outputs[0].token_ids == seqs[i]


def test_steps_without_new_params_are_the_default_step(qwen3, monkeypatch):
    """Only steps holding a request that uses a feature get a variant; the engine stops even looking
    once no such request is left."""
    import jaxpaged.engine.llm_engine as engine_mod

    params, ref, _ = qwen3
    seen = []
    real = engine_mod.build_step_inputs

    def spy(*args, **kwargs):
        inputs = real(*args, **kwargs)
        seen.append((kwargs["maybe_features"], inputs.features, inputs.extras is None))
        return inputs

    monkeypatch.setattr(engine_mod, "build_step_inputs", spy)
    engine = LLMEngine(params, EngineConfig(**CFG))
    ps = prompts(ref)
    run_to_completion(engine, ps[:2], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert seen and all(not f and no_extras and not maybe for maybe, f, no_extras in seen)
    seen.clear()
    run_to_completion(engine, ps[:2], [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2),
                                       SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)])
    assert any(f.logprobs == 2 for _, f, _ in seen) and not seen[-1][1]  # the last steps: plain request only
    assert engine._num_feature_requests == 0
