"""Kernel variants for A/B scripts without changing the kernels' code: the Mosaic kernel modules read
``plgpu`` as a module global, so a stand-in object that overrides one of its functions, put in place
while a variant traces, gives that variant's kernels (``patched_plgpu``).

The traces of the kernels' jitted wrappers, and of the model's jitted layer that holds them (engines
of one backend share it), are forgotten on the way in and out, so each variant traces its own kernels
and the variants after it never reuse its traces.
"""
import contextlib

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
