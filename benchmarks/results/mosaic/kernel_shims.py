"""Kernel variants for A/B scripts without changing the kernels' code: the Mosaic kernel modules read
``plgpu`` as a module global, so a stand-in object that overrides one of its functions, put in place
while a variant traces, gives that variant's kernels (``patched_plgpu``).

The traces of the kernels' jitted wrappers, and of the model's jitted layer that holds them (engines
of one backend share it), are forgotten on the way in and out, so each variant traces its own kernels
and the variants after it never reuse its traces.
"""
import contextlib
import importlib.util

from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxpaged.kernels import paged_attention_mgpu as mgpu
from jaxpaged.kernels import paged_attention_mgpu_decode as mgpu_decode
from jaxpaged.kernels import paged_attention_mgpu_prefill as mgpu_prefill
from jaxpaged.models import paged_forward, qwen

MODULES = (mgpu, mgpu_decode, mgpu_prefill)


class PlgpuShim:
    """``plgpu`` as it is; subclasses override what their variant changes."""

    def __getattr__(self, name):
        return getattr(plgpu, name)


def clear_traces():
    for f in (mgpu._paged_attention_mgpu, mgpu_decode.paged_decode_fp8_mgpu, mgpu_prefill.paged_prefill_mgpu,
              qwen.decoder_layer, paged_forward._forward):
        f.clear_cache()


@contextlib.contextmanager
def patched_plgpu(shim: PlgpuShim):
    """Everything traced inside sees ``shim`` as the kernel modules' ``plgpu``."""
    saved = [m.plgpu for m in MODULES]
    clear_traces()
    for m in MODULES:
        m.plgpu = shim
    try:
        yield
    finally:
        for m, p in zip(MODULES, saved):
            m.plgpu = p
        clear_traces()


def module_from(path: str, name: str = "mgpu_before"):
    """A kernel module imported from ``path``: a copy of ``kernels/paged_attention_mgpu.py`` as it was
    before a change (its patch reversed), to time beside the tree's."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_cases(variants: dict, cases, same: tuple[str, str], hq: int = 16, hkv: int = 8, d: int = 128,
               block_size: int = 16) -> list:
    """Each case ``(label, new tokens a sequence, cached before them, padded sequences)`` timed over
    ``variants`` (``bench_attention.time_variants``: chained, two rounds in alternating order), printed
    as it ends; returns ``(label, us by variant, whether the two variants of ``same`` agree bitwise)``
    rows."""
    import numpy as np
    from bench_attention import random_paged_batch, time_variants

    rows = []
    for label, q_lens, prefixes, s in cases:
        pad = s - len(q_lens)
        q, pool, cu, kl, table = random_paged_batch(q_lens + [0] * pad, prefixes + [0] * pad, hq, hkv, d, block_size,
                                                    sum(q_lens))
        each: dict = {}
        t, outs = time_variants(variants, q, pool, cu, kl, table, rounds=2, each_round=each, where=label)
        equal = bool(np.array_equal(outs[same[0]], outs[same[1]]))
        rows.append((label, t, equal))
        print(label, {k: f"{v:.1f} ({'/'.join(f'{x:.1f}' for x in each[k])})" for k, v in t.items()},
              "bitwise equal:", equal, flush=True)
        del pool
    return rows
