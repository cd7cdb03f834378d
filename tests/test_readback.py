"""Token readback (``jaxpaged/readback.py``): the DLPack pointer arithmetic, the reader choice, and the
engine's outputs with each choice (on a CPU the stream reader is unavailable: ``"auto"`` reads through jax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged import EngineConfig, LLMEngine, SamplingParams, load_params
from jaxpaged.llm import run_to_completion
from jaxpaged.models.tiny import tiny_checkpoint_path
from jaxpaged.engine.readback import dlpack_data_pointer, jax_reader, make_token_reader


@pytest.mark.parametrize("max_version", [None, (1, 0)])
def test_dlpack_data_pointer_is_the_first_element(max_version):
    """Legacy and versioned capsules, an array with an offset view: the pointer jax reports."""
    base = jnp.arange(16, dtype=jnp.int32)
    for x in (base, base[5:]):
        capsule = x.__dlpack__(max_version=max_version)
        assert dlpack_data_pointer(capsule) == x.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="DLPack"):
        import ctypes

        ctypes.pythonapi.PyCapsule_New.restype = ctypes.py_object
        ctypes.pythonapi.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        dlpack_data_pointer(ctypes.pythonapi.PyCapsule_New(ctypes.c_void_p(8), b"used_dltensor", None))


def test_reader_choice_on_a_cpu():
    cpu = jax.devices("cpu")[0]
    assert make_token_reader("jax", cpu, 8) == ("jax", jax_reader)
    assert make_token_reader("auto", cpu, 8) == ("jax", jax_reader)
    with pytest.raises(RuntimeError, match="CUDA"):
        make_token_reader("stream", cpu, 8)
    with pytest.raises(ValueError, match="token_readback"):
        make_token_reader("fast", cpu, 8)
    with pytest.raises(ValueError, match="token_readback"):
        EngineConfig(token_readback="fast")
    np.testing.assert_array_equal(jax_reader(jnp.arange(4, dtype=jnp.int32)), [0, 1, 2, 3])


def test_engine_reports_its_readback_and_outputs_do_not_depend_on_it():
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for readback in ("jax", "auto"):
        engine = LLMEngine(params, EngineConfig(dtype="float32", block_size=8, num_blocks=64, max_model_len=64,
                                                token_readback=readback, compilation_cache=False))
        want = "jax" if jax.default_backend() != "gpu" or readback == "jax" else "stream"
        assert engine.stats()["token_readback"] == engine.token_readback == want
        outs.append([o.outputs[0].token_ids for o in run_to_completion(engine, prompts, sp)])
    assert outs[0] == outs[1] and all(len(t) == 6 for t in outs[0])
