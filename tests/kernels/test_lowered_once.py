"""kernels/lowered_once.py: a Mosaic GPU kernel exported once per process and embedded in every step that
launches it. Cross-lowered for ``cuda`` on the CPU (the lowering only; running it needs Hopper): a step
that takes the export carries the same kernel (its whole serialised module) and the same XLA code
around it as a step that lowers the kernel itself, and a second step of the same shapes exports
nothing new."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.kernels import lowered_once
from jaxpaged.kernels.mosaic.attention import paged_attention_mgpu

S = jax.ShapeDtypeStruct


def i32(*shape):
    return S(shape, jnp.int32)


# jax 0.11.2 (the GPU machines') writes an exported kernel's module with its GPU dimension attributes in
# another printed form and numbers kernel names by lowering (``paged_decode_0``, ``_1``): there the same
# kernel is compared by name, its run on the GPU being the check (run.sh beside the patch); from 0.12 by
# its whole serialised module.
BYTE_EQUAL = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 12)


def kernels(text: str) -> list[str]:
    """The Mosaic GPU kernels of a lowered jit: each one's whole serialised module (its name before jax
    0.12)."""
    modules = re.findall(r'custom_call @mosaic_gpu\w*\(.*?module = "((?:[^"\\]|\\.)*)"', text)
    if BYTE_EQUAL:
        return modules
    return [re.findall(r"(\w+)_\d+\\00", m)[:1] for m in modules]


def outside_kernels(text: str) -> str:
    """The module's text with each kernel's custom call, the export's call wrapper and locations cut out."""
    text = re.sub(r"loc\([^)]*\)", "", text)
    text = re.sub(r"(stablehlo\.custom_call @mosaic_gpu|call @call_exported)\w*\(", "KERNEL(", text)
    text = re.sub(r"\n  func\.func private @call_exported\w*\(.*?\n  }", "", text, flags=re.S)
    return "\n".join(re.sub(r"KERNEL\(.*", "KERNEL", line) for line in text.splitlines() if not line.startswith("#loc"))


def traced_step(tokens: int, extra=lambda q: q, **static):
    """A step's attention as the model calls it (two layers, fp8 pool), lowered for ``cuda``; ``extra``:
    something else the step computes (another sampler variant's work)."""
    avals = (S((tokens, 4, 128), jnp.bfloat16), S((2, 40, 65, 2, 2, 128), jnp.float8_e4m3fn), S((), jnp.int32),
             i32(tokens + 1), i32(tokens), i32(tokens, 20))
    attention = functools.partial(paged_attention_mgpu, interpret=False, **static)

    def step(q, pool, layer, cu, kv_lens, tables):
        for i in range(2):
            q = attention(q, pool, layer + i, cu, kv_lens, tables)
        return extra(q)

    return jax.jit(step).trace(*avals)


def lowered_step(tokens: int, extra=lambda q: q, **static) -> str:
    return traced_step(tokens, extra, **static).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture
def fresh(monkeypatch):
    """No export from another test, and no step traced before (jit caches its traces per process)."""
    monkeypatch.setattr(lowered_once, "_exports", {})
    monkeypatch.setattr(lowered_once, "_kernels", {})
    jax.clear_caches()
    yield
    jax.clear_caches()


@pytest.mark.parametrize("tokens, static", [(8, dict(uniform_decode=True)), (8, {}), (256, {})],
                         ids=["decode kernel", "query tiles, split", "prefill kernel"])
def test_a_step_embeds_the_kernel_it_would_lower_and_later_steps_export_nothing(fresh, monkeypatch, tokens, static):
    first = lowered_step(tokens, **static)
    assert lowered_once.exports() == 1 and "call @call_exported" in first
    second = lowered_step(tokens, extra=lambda q: q * 2, **static)  # another step, the same launch
    assert lowered_once.exports() == 1 and kernels(second) == kernels(first)
    jax.clear_caches()
    monkeypatch.setattr(lowered_once, "launch", lambda build, *args, interpret: build()(*args))
    plain = lowered_step(tokens, **static)
    assert kernels(plain) == kernels(first) and len(kernels(plain)) == 1
    assert outside_kernels(plain) == outside_kernels(first)


def test_other_shapes_or_another_kernel_export_again(fresh):
    def hashes(text):
        return re.findall(r'custom_call @mosaic_gpu\w*\(.*?kernel_hash = "((?:[^"\\]|\\.)*)"', text)

    decode = hashes(lowered_step(8, uniform_decode=True))
    tiles = hashes(lowered_step(8))
    wider = hashes(lowered_step(16, uniform_decode=True))
    assert lowered_once.exports() == 3 and len({*decode, *tiles, *wider}) == 3


def test_interpreted_kernels_are_not_exported(fresh):
    """An interpreted kernel calls back to the host, which an export cannot hold: it runs as it is."""
    q = jnp.zeros((1, 4, 128), jnp.bfloat16)
    pool = jnp.zeros((1, 4, 16, 2, 2, 128), jnp.bfloat16)
    paged_attention_mgpu(q, pool, 0, jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32),
                         jnp.zeros((1, 2), jnp.int32), interpret=True)
    assert lowered_once.exports() == 0


@pytest.mark.slow  # (worker processes: end-to-end)
def test_workers_export_what_the_steps_traced_and_the_steps_embed_the_same_kernels(fresh):
    """A warm-up's order: trace the steps, export their kernels in a worker process, then lower the
    steps; each embeds the kernel it would have lowered itself, and lowering exports nothing more."""
    shapes = [(8, dict(uniform_decode=True)), (8, {})]
    traced = [traced_step(tokens, **static) for tokens, static in shapes]
    assert lowered_once.exports() == 0
    assert lowered_once.export_traced(workers=1) == 2  # (one worker process: the suite's cores are few)
    from_workers = [kernels(t.lower(lowering_platforms=("cuda",)).as_text()) for t in traced]
    assert lowered_once.exports() == 2
    lowered_once._exports.clear()
    lowered_once._kernels.clear()
    jax.clear_caches()
    here = [kernels(lowered_step(tokens, **static)) for tokens, static in shapes]
    assert from_workers == here and all(len(k) == 1 for k in here)
