"""A step's inputs as one buffer, so they reach the device in one host-to-device copy.

``StepInputs`` has 13 arrays, all 32-bit. Passed to ``jit`` as they are, each becomes its own transfer
(13 copies a step, measured on the H200, each with its own host-side cost). ``pack`` lays them end to
end in one ``i32[N]`` numpy buffer (floats and unsigned ints by bit pattern); ``unpack`` slices them
back out inside the jitted step, where the slices are free. The ``StepLayout`` (the padded sizes and
the sampler variant) is static: it is part of the compiled step's key, exactly as the shapes were.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .step_inputs import PACKED_ATTR, StepInputs, input_fields
from ..kernels.metadata import AttentionMetadata
from ..sampling.features import NO_FEATURES, FeatureInputs, SamplerFeatures


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Static description of a packed step: ``T`` tokens, ``S`` sequences, block-table width ``W``."""

    num_tokens: int
    num_seqs: int
    width: int
    sampling_mode: str
    features: SamplerFeatures = NO_FEATURES  # penalties / min_p / logprobs variant (sampling_features)

    def fields(self) -> tuple[tuple[str, tuple[int, ...], np.dtype], ...]:
        """``(name, shape, dtype)`` in buffer order: ``batch.input_fields``, then the features' arrays."""
        s = self.num_seqs
        return input_fields(self.num_tokens, s, self.width) + (self.features.fields(s) if self.features else ())


def _flat_fields(inputs: StepInputs) -> dict[str, np.ndarray]:
    m = inputs.meta
    x = inputs.extras
    extras = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)} if x is not None else {}
    return extras | dict(token_ids=inputs.token_ids, positions=inputs.positions, slot_mapping=m.slot_mapping,
                prev_index=inputs.prev_index, cu_q_lens=m.cu_q_lens, kv_lens=m.kv_lens,
                logits_indices=inputs.logits_indices, temperature=inputs.temperature, top_k=inputs.top_k,
                top_p=inputs.top_p, seeds=inputs.seeds, counters=inputs.counters, block_tables=m.block_tables)


def pack(inputs: StepInputs) -> tuple[np.ndarray, StepLayout]:
    """Host side: the step's numpy arrays as one ``i32[N]`` buffer, and its static layout. Inputs from
    ``batch.build_step_inputs`` (no sampler features) already are views of such a buffer: it is
    returned as it is (their arrays' current values, since they are views of it). So a caller must
    not write to a step's input arrays once it has handed them to ``runner.step`` (none does; jax
    copies a numpy argument today, but need not)."""
    t, (s, w) = inputs.token_ids.shape[0], inputs.meta.block_tables.shape
    layout = StepLayout(t, s, w, inputs.sampling_mode, inputs.features)
    packed = inputs.__dict__.get(PACKED_ATTR)
    if packed is not None:
        return packed, layout
    arrays = _flat_fields(inputs)
    parts = []
    for name, shape, dtype in layout.fields():
        a = np.asarray(arrays[name])
        if a.shape != shape or a.dtype != dtype:
            raise ValueError(f"step input {name}: expected {dtype}{list(shape)}, got {a.dtype}{list(a.shape)}")
        parts.append(a.reshape(-1).view(np.int32))
    return np.concatenate(parts), layout


def unpack(buffer: jax.Array, layout: StepLayout) -> StepInputs:
    """Device side (inside ``jit``): the ``StepInputs`` a packed buffer holds."""
    out, start = {}, 0
    for name, shape, dtype in layout.fields():
        size = int(np.prod(shape))
        a = lax.slice(buffer, (start,), (start + size,)).reshape(shape)
        out[name] = a if dtype == np.int32 else lax.bitcast_convert_type(a, jnp.dtype(dtype))
        start += size
    meta = AttentionMetadata(slot_mapping=out.pop("slot_mapping"), cu_q_lens=out.pop("cu_q_lens"),
                             kv_lens=out.pop("kv_lens"), block_tables=out.pop("block_tables"))
    extras = None
    if layout.features:
        extras = FeatureInputs(**{f.name: out.pop(f.name) for f in dataclasses.fields(FeatureInputs)})
    return StepInputs(meta=meta, sampling_mode=layout.sampling_mode, extras=extras, features=layout.features, **out)


def to_step_memory(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Inside ``jit``: ``arrays`` copied into the step's own (temporary) memory, one small kernel each.

    Why: XLA runs the step as a CUDA graph and, before every launch, patches each graph node whose
    buffers moved since the last launch. A step's inputs arrive in a fresh buffer every step; read
    in place, the packed inputs make every kernel that reads a slot mapping, a block table or a
    length (the attention and the qkv epilogue of every layer) a node to patch: 295 of a batch-1
    step's nodes, 0.1-0.18 ms of host time per launch on the H200 (``TF_CPP_VMODULE=
    command_buffer_thunk=3``; benchmarks/RESULTS.md, session 5). Copied first, only the copy reads the
    new buffer; the step's temporary memory keeps its address from step to step. The zero is hidden
    from XLA's simplifier behind an optimisation barrier, and the barrier on the result keeps the copy
    from being fused back into its readers.
    """
    zero = lax.optimization_barrier(jnp.zeros((), jnp.int32))
    return lax.optimization_barrier(tuple(a + zero.astype(a.dtype) for a in arrays))
