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
from jaxpaged.engine.readback import StreamReader, dlpack_data_pointer, jax_reader, make_token_reader


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
    assert make_token_reader(cpu, 8) == ("jax", jax_reader)
    assert make_token_reader(cpu, 8, stream=False) == ("jax", jax_reader)
    with pytest.raises(RuntimeError, match="CUDA"):
        StreamReader(cpu, 8)
    np.testing.assert_array_equal(jax_reader(jnp.arange(4, dtype=jnp.int32)), [0, 1, 2, 3])


def test_engine_reports_its_readback_and_releases_it_on_close():
    params = load_params(tiny_checkpoint_path("qwen3"), "float32", use_cache=False)
    engine = LLMEngine(params, EngineConfig(block_size=8, num_blocks=64, max_model_len=64, compilation_cache=False))
    want = "stream" if jax.default_backend() == "gpu" else "jax"
    assert engine.stats()["token_readback"] == engine.token_readback == want
    out = run_to_completion(engine, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    engine.close()
    engine.close()  # idempotent
    if want == "stream":
        assert engine._read_tokens._cuda is None  # stream, pinned buffer and context reference released
