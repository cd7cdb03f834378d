"""Fixtures of the model tests."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest


@pytest.fixture
def random_moe_layer():
    """``make(seed, t, h, i, e, dtype, router_scale) -> (x [t, h], router [h, e], gate_up [e, h, 2i], down
    [e, i, h])``: a MoE layer's random inputs and weights (experts' weights scaled by 0.3)."""
    def make(seed: int, t: int, h: int, i: int, e: int, dtype, router_scale: float):
        rng = np.random.default_rng(seed)
        x = jnp.asarray(rng.standard_normal((t, h)), dtype)
        router = jnp.asarray(rng.standard_normal((h, e)) * router_scale, dtype)
        gate_up = jnp.asarray(rng.standard_normal((e, h, 2 * i)) * 0.3, dtype)
        down = jnp.asarray(rng.standard_normal((e, i, h)) * 0.3, dtype)
        return x, router, gate_up, down

    return make
