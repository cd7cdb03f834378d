"""Bad input at the boundary: a clear TypeError / ValueError naming the request and the field, nothing
queued, and the engine still serves the next request. Broken checkpoints: a CheckpointError naming
the file and the field."""

from __future__ import annotations

import json
import shutil
import struct
import warnings

import numpy as np
import pytest

from jaxpaged import LLM, CheckpointError, SamplingParams, load_params
from jaxpaged.models.tiny import tiny_checkpoint_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(tiny_checkpoint_path("qwen3"), dtype="float32", block_size=8, num_blocks=64, max_model_len=64,
               warmup=False)


BAD_GENERATE = [  # (prompts, sampling_params, error, message)
    (None, GREEDY, TypeError, "got None"),
    (3.7, GREEDY, TypeError, "must be a str, a list of token ids or a dict"),
    ([3.7], GREEDY, TypeError, "prompt 0: must be a str"),
    (b"hi", GREEDY, TypeError, "got bytes"),
    (["ok", b"hi"], GREEDY, TypeError, "prompt 1: got bytes"),
    ([[1, True]], GREEDY, TypeError, "prompt 0: token id at position 1 is bool True"),
    ([[1, 2.5]], GREEDY, TypeError, "position 1 is float"),
    ([1, "a"], GREEDY, TypeError, "mixing token ids"),
    ([{"text": "hi"}], GREEDY, ValueError, "prompt 0: a dict prompt must have exactly one key"),
    ([{"prompt": 5}], GREEDY, TypeError, "'prompt' must be a string"),
    ([{"prompt_token_ids": [1, "a"]}], GREEDY, TypeError, "position 1 is str"),
    ([[1, -2]], GREEDY, ValueError, "position 1 is negative"),
    ([[1, 2, 999_999]], GREEDY, ValueError, r"prompt 0: .*token id 999999 at position 2 is outside the vocabulary"),
    (["ok", ""], GREEDY, ValueError, "prompt 1: .*prompt is empty"),
    ([[1] * 60], SamplingParams(max_tokens=10), ValueError, r"exceeds max_model_len \(64\)"),
    ([[1] * 60], SamplingParams(min_tokens=10, max_tokens=None), ValueError,  # None: what is left of max_model_len
     r"prompt 0: .*min_tokens \(10\) must be <= max_tokens \(4\)"),
    (["a", "b"], {"temperature": 0}, TypeError, "got a dict: write SamplingParams"),
    (["a", "b"], [GREEDY], ValueError, "got 1 sampling params for 2 prompts"),
    (["a"], "greedy", TypeError, "must be a SamplingParams or None"),
    (["a"], SamplingParams(stop_token_ids=[1 << 20]), ValueError, "stop_token_ids holds 1048576, outside"),
    (np.zeros((2, 2, 2), np.int32), GREEDY, TypeError, "must be 1-D .* or 2-D"),
]


@pytest.mark.parametrize("prompts, sp, error, message", BAD_GENERATE)
def test_bad_generate_inputs_are_named_and_queue_nothing(llm, prompts, sp, error, message):
    with pytest.raises(error, match=message):
        llm.generate(prompts, sp, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)  # still serving
    assert len(out[0].outputs[0].token_ids) == 4


BAD_PARAMS = [
    (dict(temperature=True), TypeError, "temperature must be a number, got bool"),
    (dict(temperature="0.5"), TypeError, "temperature must be a number"),
    (dict(stop_token_ids=5), TypeError, r"stop_token_ids must be a list of ints, got int 5 \(write \[5\]\)"),
    (dict(stop_token_ids=[1, "2"]), TypeError, "non-negative ints, got '2'"),
    (dict(n=0), ValueError, "n must be >= 1"),
    (dict(n=True), TypeError, "n must be an integer"),
    (dict(logprobs=50), ValueError, "logprobs must be <= 20"),
    (dict(prompt_logprobs=-1), ValueError, "prompt_logprobs must be >= 0"),
    (dict(min_tokens=5, max_tokens=2), ValueError, r"min_tokens \(5\) must be <= max_tokens \(2\)"),
    (dict(stop=[""]), ValueError, "empty string"),
    (dict(stop=3), TypeError, "stop must be a string or a list of strings"),
    (dict(presence_penalty=3.0), ValueError, r"presence_penalty must be in \[-2.0, 2.0\]"),
    (dict(frequency_penalty=float("nan")), ValueError, "frequency_penalty"),
    (dict(repetition_penalty=0.0), ValueError, r"repetition_penalty must be in \(0.0, 3.40"),
    (dict(repetition_penalty=float("inf")), ValueError, r"repetition_penalty must be in \(0.0, 3.40"),
    (dict(top_k=2**31), ValueError, r"top_k must be -1 \(off\) or a positive integer <= 2147483647"),
    (dict(seed=2**70), ValueError, r"seed must be an integer in \[0, 9223372036854775807\]"),
    (dict(temperature=1e39), ValueError, r"temperature must be finite \(in float32\)"),
    (dict(max_tokens=2**31), ValueError, r"max_tokens must be a positive integer <= 2147483647"),
    (dict(min_p=1.5), ValueError, r"min_p must be in \[0.0, 1.0\]"),
    (dict(ignore_eos=1), TypeError, "ignore_eos must be True or False"),
    (dict(output_kind="delta"), TypeError, "output_kind must be a RequestOutputKind"),
    (dict(stop="x", detokenize=False), ValueError, "stop strings need detokenize=True"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_PARAMS)
def test_bad_sampling_params(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_numpy_prompts_and_dict_prompts_are_accepted(llm):
    ids = np.asarray([5, 6, 7], np.int64)
    outs = llm.generate([ids, {"prompt_token_ids": [np.int32(5), 6, 7]}, {"prompt": "hello"}, "hello"],
                        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, seed=np.int64(3)),
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == outs[3].outputs[0].token_ids and outs[2].prompt == "hello"


def test_abort_unknown_id_is_a_clear_key_error(llm):
    with pytest.raises(KeyError, match="no unfinished request with id 'nope'"):
        llm.abort("nope")


# ---- checkpoints ------------------------------------------------------------------------------------

def _copy(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_path("qwen3"), dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _truncate(path):
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])


def _garble_header(path):
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[9:40] = b"\xff" * 31
    f.write_bytes(bytes(data))


def _huge_header(path):
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[:8] = struct.pack("<Q", 1 << 40)
    f.write_bytes(bytes(data))


BAD_CHECKPOINTS = [
    (lambda p: _edit_config(p, hidden_size=None), r"config.json: required field 'hidden_size' is missing"),
    (lambda p: _edit_config(p, num_hidden_layers="3"), r"config.json: field 'num_hidden_layers' must be an integer"),
    (lambda p: _edit_config(p, rms_norm_eps="small"), r"config.json: field 'rms_norm_eps' must be a number"),
    (lambda p: _edit_config(p, model_type="llama"), r"config.json: model_type 'llama' is not supported"),
    (lambda p: _edit_config(p, dtype="int8"), r"config.json: field 'torch_dtype' / 'dtype' is 'int8'"),
    (lambda p: (p / "config.json").write_text("{oops"), r"config.json is not valid JSON"),
    (lambda p: (p / "config.json").unlink(), "has no config.json"),
    (lambda p: (p / "model.safetensors").unlink(), r"has no \*.safetensors weight files"),
    (_truncate, r"model.safetensors: tensor '.*' ends at byte \d+ .* truncated"),
    (_garble_header, r"model.safetensors: corrupted safetensors header"),
    (_huge_header, r"model.safetensors: corrupted safetensors header \(header length"),
    (lambda p: (p / "model.safetensors.index.json").write_text("[]"), r"index.json: not a valid index"),
    (lambda p: _edit_config(p, vocab_size=600), r"tensor 'model.embed_tokens.weight' has shape \(512, 128\), expected"),
]


@pytest.mark.parametrize("case", range(len(BAD_CHECKPOINTS)))
def test_broken_checkpoints_name_the_file_and_field(tmp_path, case):
    breaker, message = BAD_CHECKPOINTS[case]
    path = _copy(tmp_path)
    breaker(path)
    with pytest.raises(CheckpointError, match=message):
        load_params(path, "float32", use_cache=False)


def test_missing_folder_and_uncached_hub_id(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_params(tmp_path / "nowhere", use_cache=False)
    with pytest.raises(CheckpointError, match="hf download no-such-org/no-such-model"):
        load_params("no-such-org/no-such-model", use_cache=False)


def test_corrupt_tokenizer_is_a_checkpoint_error(tmp_path):
    from jaxpaged import load_tokenizer

    path = _copy(tmp_path)
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="tokenizer.json: cannot be read as a tokenizer"):
        load_tokenizer(path)


def test_nan_weights_are_warned(tmp_path):
    from jaxpaged.models.safetensors_io import read_safetensors, write_safetensors

    path = _copy(tmp_path)
    tensors = {k: np.array(v) for k, v in read_safetensors(path / "model.safetensors").items()}
    tensors["model.norm.weight"][3] = np.nan
    write_safetensors(path / "model.safetensors", tensors)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_params(path, "float32", use_cache=False)
    assert any("model.norm.weight" in str(w.message) and "NaN" in str(w.message) for w in caught)


# ---- CPU defaults ------------------------------------------------------------------------------------

def test_cpu_pool_is_sized_from_host_memory_with_a_cap():
    import types

    from jaxpaged import EngineConfig, QwenConfig
    from jaxpaged.models.kv_pool import CPU_POOL_CAP_BYTES, CPU_POOL_FRACTION, available_host_memory, size_pool

    qwen3_06b = QwenConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                           max_position_embeddings=40960)
    params = types.SimpleNamespace(config=qwen3_06b, mesh=None)
    blocks = size_pool(params, EngineConfig(), 8192, "bfloat16")
    pool_bytes = blocks * 16 * qwen3_06b.kv_bytes_per_token(2)
    assert pool_bytes <= CPU_POOL_CAP_BYTES  # was 14 GiB (8192 blocks of a max_model_len 8192 pool)
    host = available_host_memory()
    if host is not None:
        assert pool_bytes <= host * CPU_POOL_FRACTION


def test_default_max_model_len_shrinks_to_a_small_pool():
    from jaxpaged import EngineConfig, LLMEngine

    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    engine = LLMEngine(params, EngineConfig(num_blocks=8, block_size=8))  # 64 tokens < 1024 positions
    assert engine.max_model_len == 64
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=128"):
        LLMEngine(params, EngineConfig(num_blocks=8, block_size=8, max_model_len=128))
