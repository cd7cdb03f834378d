"""The device sampler: greedy, temperature, top-k / top-p filtering and per-request seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.sampling import _filter_top_k_top_p, sample


def rows(n, logits):
    return jnp.tile(jnp.asarray(logits, jnp.float32)[None], (n, 1))


def test_greedy_and_filters_that_leave_one_token():
    logits = jax.random.normal(jax.random.key(0), (6, 50)) * 3
    best = np.asarray(jnp.argmax(logits, -1))
    temp = jnp.asarray([0.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    top_k = jnp.asarray([-1, 1, -1, 5, 1, -1])
    top_p = jnp.asarray([1.0, 1.0, 1e-6, 0.5, 0.3, 1e-6])
    toks = sample(logits, temp, top_k, top_p, jnp.arange(6, dtype=jnp.uint32), jnp.zeros(6, jnp.int32))
    np.testing.assert_array_equal(np.asarray(toks), best)


def test_filter_keeps_exactly_top_k_and_nucleus():
    logits = jnp.log(jnp.asarray([[0.5, 0.25, 0.15, 0.1]]))
    kept = lambda k, p: np.isfinite(np.asarray(_filter_top_k_top_p(logits, jnp.asarray([k]), jnp.asarray([p]))))[0]
    np.testing.assert_array_equal(kept(2, 1.0), [True, True, False, False])
    np.testing.assert_array_equal(kept(-1, 0.5), [True, False, False, False])  # 0.5 reached by the first
    np.testing.assert_array_equal(kept(-1, 0.7), [True, True, False, False])
    np.testing.assert_array_equal(kept(-1, 0.8), [True, True, True, False])
    np.testing.assert_array_equal(kept(3, 0.95), [True, True, True, False])


def test_sample_frequencies_follow_softmax_of_scaled_logits():
    n = 4000
    logits = jnp.asarray([1.0, 0.0, -1.0, 0.5])
    temperature = 0.7
    toks = sample(rows(n, logits), jnp.full(n, temperature), jnp.full(n, -1), jnp.ones(n),
                  jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.int32))
    freq = np.bincount(np.asarray(toks), minlength=4) / n
    expected = np.asarray(jax.nn.softmax(logits / temperature))
    assert np.abs(freq - expected).max() < 0.03


def test_same_seed_and_counter_same_token_different_counter_moves():
    logits = rows(2, jnp.zeros(1000))
    one = jnp.ones(2)
    a = sample(logits, one, jnp.full(2, -1), one, jnp.asarray([5, 5], jnp.uint32), jnp.asarray([3, 3]))
    assert a[0] == a[1]
    draws = {int(sample(logits[:1], one[:1], jnp.full(1, -1), one[:1], jnp.asarray([5], jnp.uint32),
                        jnp.asarray([c]))[0]) for c in range(20)}
    assert len(draws) > 10


def test_sampling_mode_is_chosen_on_the_host_and_variants_agree():
    from jaxpaged.sampling import sampling_mode

    assert sampling_mode([0.0, 0.0], [5, -1], [0.5, 1.0]) == "random"  # filters of greedy rows are moot
    assert sampling_mode([0.0, 0.7], [-1, -1], [1.0, 1.0]) == "random"
    assert sampling_mode([0.0, 0.7], [-1, 3], [1.0, 1.0]) == "filtered"
    assert sampling_mode([0.7], [-1], [0.9]) == "filtered"
    logits = jax.random.normal(jax.random.key(1), (6, 300)) * 2
    temp = jnp.asarray([0.0, 0.8, 1.0, 0.0, 0.5, 1.3])
    no_k, no_p = jnp.full(6, -1), jnp.ones(6)
    seeds, counters = jnp.arange(6, dtype=jnp.uint32), jnp.arange(6, dtype=jnp.int32)
    random = sample(logits, temp, no_k, no_p, seeds, counters, "random")
    filtered = sample(logits, temp, no_k, no_p, seeds, counters, "filtered")
    np.testing.assert_array_equal(np.asarray(random), np.asarray(filtered))  # nothing to filter: same draws
    greedy_rows = np.asarray(temp) == 0
    np.testing.assert_array_equal(np.asarray(random)[greedy_rows], np.asarray(jnp.argmax(logits, -1))[greedy_rows])
    np.testing.assert_array_equal(np.asarray(sample(logits, jnp.zeros(6), no_k, no_p, seeds, counters, "random")),
                                  np.asarray(jnp.argmax(logits, -1)))
