"""Streaming (DELTA / CUMULATIVE outputs, incremental detokenization), chat templates with prefix-cache
hits across turns, and sampling defaults from generation_config.json."""

from __future__ import annotations

import json
import shutil

import pytest

from jaxpaged import LLM, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams, load_tokenizer
from jaxpaged.io.detokenizer import IncrementalDetokenizer
from jaxpaged.llm import run_to_completion, stream
from jaxpaged.models.tiny import tiny_checkpoint_path

CFG = dict(block_size=8, num_blocks=128, max_model_len=128)
TEXT = "héllo wörld: naïve café 🙂 日本語 ünïcödé"


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_checkpoint_path("qwen3"), dtype="float32", warmup=False, **CFG)


def test_incremental_detokenizer_never_splits_a_character():
    tok = load_tokenizer(tiny_checkpoint_path("qwen3"))
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some characters span several tokens
    d = IncrementalDetokenizer(tok)
    pieces = []
    for n in range(1, len(ids) + 1):
        before = len(d.text)
        d.add_token(ids[:n])
        pieces.append(d.text[before:])
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == TEXT
    assert any(p == "" for p in pieces)  # a token that completed no character emitted nothing


def collect(engine, prompts, sps):
    finals = {}
    streamed: dict[str, list] = {}
    for out in stream(engine, prompts, sps, RequestOutputKind.DELTA):
        streamed.setdefault(out.request_id, []).append(out)
        if out.finished:
            finals[out.request_id] = out
    return streamed, finals


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_deltas_concatenate_to_the_final_text(llm, async_scheduling):
    engine = LLMEngine(llm.params, EngineConfig(kv_cache_dtype="float32", **CFG, async_scheduling=async_scheduling), llm.tokenizer)
    prompts = ["Hello, world!", TEXT, "The quick brown fox"]
    sps = [SamplingParams(temperature=0.9, seed=1, max_tokens=20, ignore_eos=True),
           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1),
           SamplingParams(temperature=1.0, seed=4, max_tokens=16, n=2, stop=["e ", "zz"])]
    final = run_to_completion(LLMEngine(llm.params, EngineConfig(kv_cache_dtype="float32", **CFG), llm.tokenizer), prompts, sps)
    streamed, _ = collect(engine, prompts, sps)
    for rid, want in zip(sorted(streamed, key=int), final):
        outs = streamed[rid]
        assert len(outs) > 1 and outs[-1].finished and not any(o.finished for o in outs[:-1])
        for c in want.outputs:
            deltas = [d for o in outs for d in o.outputs if d.index == c.index]
            assert "".join(d.text for d in deltas) == c.text
            assert [t for d in deltas for t in d.token_ids] == c.token_ids
            assert deltas[-1].finish_reason == c.finish_reason
            if c.logprobs is not None:
                assert [lp for d in deltas for lp in d.logprobs] == c.logprobs


def test_cumulative_outputs_grow_and_generate_stream_closes_cleanly(llm):
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = list(llm.generate_stream(["Hello"], sp, output_kind=RequestOutputKind.CUMULATIVE))
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert outs[-1].outputs[0].text == llm.generate(["Hello"], sp, use_tqdm=False)[0].outputs[0].text
    it = llm.generate_stream(["Hello", "world"], SamplingParams(max_tokens=30, ignore_eos=True))
    next(it)
    it.close()  # leaving early aborts what is left
    rest = []
    while llm.engine.has_unfinished_requests():
        rest += llm.engine.step()
    assert len(rest) == 2 and {o.outputs[0].finish_reason for o in rest} == {"abort"}
    assert llm.stats()["blocks_used"] == 0


def test_chat_multi_turn_hits_the_prefix_cache_for_every_earlier_full_block(llm):
    bs = CFG["block_size"]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    conv = [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
            {"role": "user", "content": "What does a block table map?"}]
    first = llm.chat(conv, sp, use_tqdm=False)[0]
    assert first.prompt == llm.chat_prompts(conv)[0] and first.prompt.startswith("<|im_start|>system\n")
    turn1 = first.prompt_token_ids + first.outputs[0].token_ids
    conv2 = conv + [{"role": "assistant", "content": first.outputs[0].text},
                    {"role": "user", "content": "And prefix caching?"}]
    second = llm.chat(conv2, sp, use_tqdm=False)[0]
    ids2 = second.prompt_token_ids
    assert ids2[: len(first.prompt_token_ids)] == first.prompt_token_ids
    common = next((i for i, (a, b) in enumerate(zip(turn1, ids2)) if a != b), min(len(turn1), len(ids2)))
    expected_blocks = min(common, len(turn1), len(ids2) - 1) // bs
    assert second.num_cached_tokens == expected_blocks * bs
    assert second.num_cached_tokens >= (len(first.prompt_token_ids) // bs) * bs > 0
    two = llm.chat([conv, conv2], sp, use_tqdm=False)  # a list of conversations
    assert [o.outputs[0].token_ids for o in two] == [first.outputs[0].token_ids, second.outputs[0].token_ids]


def test_chat_input_errors(llm):
    with pytest.raises(TypeError, match="messages must be a non-empty list"):
        llm.chat("hi")
    with pytest.raises(TypeError, match="conversation 0: must be a list of dicts with 'role' and 'content'"):
        llm.chat([[{"role": "user"}]])


def test_sampling_defaults_come_from_generation_config(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_path("qwen3"), path)
    (path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1,
         "max_new_tokens": 99, "eos_token_id": 0}))
    llm = LLM(path, dtype="float32", cache_dir=str(tmp_path / "cache"), warmup=False, **CFG)
    d = llm.default_sampling_params
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.6, 0.95, 20, 1.1, 16)
    out = llm.generate("Hello", use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 16
