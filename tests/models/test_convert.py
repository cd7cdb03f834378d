"""Checkpoint loading: conversion, sharded files, the Orbax cache, and errors a user can act on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxpaged.models.checkpoint import load_params
from jaxpaged.models.config import CheckpointError, QwenConfig, canonical_dtype
from jaxpaged.models.convert import load_hf_checkpoint, read_hf_tensors
from jaxpaged.models.safetensors_io import read_safetensors, write_safetensors
from jaxpaged.models.tiny import tiny_checkpoint_path, write_tiny_checkpoint


@pytest.fixture
def ckpt(tmp_path):
    dest = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint_path("qwen2"), dest)
    return dest


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def test_written_checkpoint_loads_and_tokenizes(tmp_path):
    import tokenizers

    path = write_tiny_checkpoint(tmp_path / "q3", "qwen3", seed=5)
    cfg, _, state = load_hf_checkpoint(path)
    assert cfg.model_type == "qwen3" and cfg.qk_norm and cfg.tie_word_embeddings
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state))
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "Prefix caching, 2026! ünïcode"
    assert tok.decode(tok.encode(text).ids) == text


def test_sharded_checkpoint_with_index(ckpt):
    tensors = {k: np.array(v) for k, v in read_safetensors(ckpt / "model.safetensors").items()}
    names = sorted(tensors)
    (ckpt / "model.safetensors").unlink()
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for fname, keys in shards.items():
        write_safetensors(ckpt / fname, {k: tensors[k] for k in keys})
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = read_hf_tensors(ckpt)
    assert set(loaded) == set(tensors)
    _, _, a = load_hf_checkpoint(ckpt)
    _, _, b = load_hf_checkpoint(tiny_checkpoint_path("qwen2"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_orbax_cache_round_trip(ckpt, tmp_path):
    first = load_params(ckpt, cache_dir=tmp_path / "cache")
    second = load_params(ckpt, cache_dir=tmp_path / "cache")
    assert not first.from_cache and second.from_cache
    for x, y in zip(jax.tree.leaves(first.state), jax.tree.leaves(second.state)):
        np.testing.assert_array_equal(x, y)
    bf16 = load_params(ckpt, "bf16", cache_dir=tmp_path / "cache")
    assert not bf16.from_cache and jax.tree.leaves(bf16.state)[0].dtype == "bfloat16"
    # A changed checkpoint is converted again, never served stale.
    edit_config(ckpt, rms_norm_eps=1e-5)
    assert not load_params(ckpt, cache_dir=tmp_path / "cache").from_cache


FIRST_LOAD = """
import pathlib, sys, time
from jaxpaged.models.checkpoint import load_params
ckpt, cache, me, other = sys.argv[1:]
pathlib.Path(me).touch()  # imports done: start together
while not pathlib.Path(other).exists():
    time.sleep(0.01)
print(load_params(ckpt, cache_dir=cache).from_cache)
"""


@pytest.mark.slow  # (two processes: end-to-end)
def test_two_processes_loading_a_checkpoint_first_at_once_share_one_cache(ckpt, tmp_path):
    """Two servers (or test workers) converting the same checkpoint at the same moment each write the
    Orbax cache: both load, neither warns, and one whole copy is left, which the next load reads."""
    cache = tmp_path / "cache"
    flags = [tmp_path / "ready0", tmp_path / "ready1"]
    procs = [subprocess.Popen([sys.executable, "-c", FIRST_LOAD, str(ckpt), str(cache), str(flags[i]), str(flags[1 - i])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, JAX_PLATFORMS="cpu")) for i in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.strip() == "False", err[-3000:]
        assert "param cache" not in err, err[-3000:]
    assert len(list((cache / "params").iterdir())) == 1  # one copy, no temporary folder left
    again = load_params(ckpt, cache_dir=cache)
    assert again.from_cache
    fresh = load_params(ckpt, use_cache=False)
    for x, y in zip(jax.tree.leaves(again.state), jax.tree.leaves(fresh.state)):
        np.testing.assert_array_equal(x, y)


def test_a_damaged_cache_is_replaced(ckpt, tmp_path):
    """A cache entry that cannot be read is converted again and its folder replaced by a whole copy."""
    cache = tmp_path / "cache"
    load_params(ckpt, cache_dir=cache)
    (entry,) = (cache / "params").iterdir()
    for f in entry.rglob("*"):
        if f.is_file():
            f.write_bytes(b"damaged")
    assert not load_params(ckpt, cache_dir=cache).from_cache
    assert [p.name for p in (cache / "params").iterdir()] == [entry.name]
    assert load_params(ckpt, cache_dir=cache).from_cache


def test_dummy_load_format_needs_only_the_config(ckpt, tmp_path):
    """``load_format="dummy"``: random weights of the config's shapes, from a folder with no weight files."""
    real = load_params(ckpt, "float32", use_cache=False)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(ckpt / "config.json", bare / "config.json")
    dummy = load_params(bare, "float32", load_format="dummy")
    assert jax.tree.structure(dummy.state) == jax.tree.structure(real.state)
    for x, y in zip(jax.tree.leaves(dummy.state), jax.tree.leaves(real.state)):
        assert x.shape == y.shape and x.dtype == y.dtype and bool(np.all(np.isfinite(x)))
    assert not np.array_equal(jax.tree.leaves(dummy.state)[-1], jax.tree.leaves(real.state)[-1])
    with pytest.raises(ValueError, match="load_format must be 'auto' or 'dummy'"):
        load_params(bare, load_format="random")


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_params(tmp_path, use_cache=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_params(tmp_path / "nope", use_cache=False)


def test_not_qwen(ckpt):
    edit_config(ckpt, model_type="llama")
    with pytest.raises(CheckpointError, match="'llama' is not supported"):
        load_params(ckpt, use_cache=False)


def test_unsupported_rope_scaling(ckpt):
    edit_config(ckpt, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope scaling 'yarn'"):
        load_params(ckpt, use_cache=False)


def test_rope_parameters_theta_is_read():
    raw = json.loads((tiny_checkpoint_path("qwen3") / "config.json").read_text())
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert QwenConfig.from_dict(raw).rope_theta == 5e5


def test_missing_tensor(ckpt):
    tensors = {k: np.array(v) for k, v in read_safetensors(ckpt / "model.safetensors").items()}
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_safetensors(ckpt / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_params(ckpt, use_cache=False)


def test_misshapen_tensor_names_both_shapes(ckpt):
    tensors = {k: np.array(v) for k, v in read_safetensors(ckpt / "model.safetensors").items()}
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((63, 128), np.float32)
    write_safetensors(ckpt / "model.safetensors", tensors)
    with pytest.raises(CheckpointError, match=r"k_proj.weight' has shape \(63, 128\), expected \(64, 128\)"):
        load_params(ckpt, use_cache=False)


def test_kv_cache_scales_in_a_checkpoint_are_ignored(ckpt):
    """llm-compressor writes per-layer ``k_scale``/``v_scale`` for an fp8 KV cache: such a checkpoint loads, to
    the same weights (the fp8 pool's per-token scales make them redundant: docs/NUMERICS.md)."""
    plain = load_params(ckpt, use_cache=False)
    tensors = {k: np.array(v) for k, v in read_safetensors(ckpt / "model.safetensors").items()}
    for i in range(plain.config.num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(0.05, np.float32)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = np.array(0.02, np.float32)
    write_safetensors(ckpt / "model.safetensors", tensors)
    scaled = load_params(ckpt, use_cache=False)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), plain.state, scaled.state))


def test_bad_dtype(ckpt):
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_params(ckpt, "int8", use_cache=False)
    assert canonical_dtype("bf16") == "bfloat16" and canonical_dtype(np.float32) == "float32"


def test_safetensors_bf16_round_trip(tmp_path):
    import ml_dtypes

    x = np.random.default_rng(0).standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
    write_safetensors(tmp_path / "a.safetensors", {"x": x})
    np.testing.assert_array_equal(read_safetensors(tmp_path / "a.safetensors")["x"], x)
