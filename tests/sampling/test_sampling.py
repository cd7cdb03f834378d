"""The device sampler: greedy, temperature, top-k / top-p filtering and per-request seeds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.sampling import sampler
from jaxpaged.sampling.sampler import _filter_top_k_top_p

# The sampler as the engine's step runs it, jitted (one executable per shape and mode instead of one per op).
sample = jax.jit(sampler.sample, static_argnames=("mode", "batch_invariant", "argmax_kernel"))


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
    from jaxpaged.sampling.sampler import sampling_mode

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


@pytest.mark.slow
def test_gumbel_argmax_kernel_matches_the_xla_sampler_in_every_mode():
    """The sampler kernel (interpret mode) picks exactly the XLA path's tokens: sampled and greedy rows,
    a vocabulary that is not a multiple of the chunk, ties (lowest id wins, also across chunks), a row
    of -inf but one token, bf16 logits read as float32; the filtered and min-p modes through the kernel
    too, and with nothing to filter they give the random mode's tokens."""
    import pytest

    from jaxpaged.kernels.gumbel_argmax import SamplerConfig, gumbel_argmax

    rng = np.random.default_rng(3)
    n, vocab = 7, 1000
    logits = rng.normal(size=(n, vocab)).astype(np.float32) * 3
    logits[2, [5, 700]] = 50.0  # a tie across chunks, greedy row: 5 wins
    logits[3, [130, 131]] = 50.0  # a tie inside a chunk
    logits[4] = -np.inf
    logits[4, 999] = 1.0  # the last (partial) chunk
    temperature = jnp.asarray([0.6, 1.0, 0.0, 0.0, 0.7, 2.0, 0.3], jnp.float32)
    inv = jnp.where(temperature > 0, 1.0 / jnp.where(temperature > 0, temperature, 1.0), 0.0)
    seeds = jnp.asarray(rng.integers(0, 2**31, n), jnp.uint32)
    counters = jnp.asarray(rng.integers(0, 500, n), jnp.int32)
    no_k, no_p = jnp.full(n, -1, jnp.int32), jnp.ones(n)
    for dtype in (jnp.float32, jnp.bfloat16):
        lg = jnp.asarray(logits, dtype)
        want = sample(lg, temperature, no_k, no_p, seeds, counters, mode="random", argmax_kernel=False)
        for block in (128, 1024, None):
            got = gumbel_argmax(lg, inv, seeds, counters, block=block, interpret=True)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        for config in (SamplerConfig(128, steps=3), SamplerConfig(64, steps=16), SamplerConfig(256, steps=4)):
            got = gumbel_argmax(lg, inv, seeds, counters, config=config, interpret=True)  # looped programs
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(config))
        for mode in ("random", "filtered"):
            via_sample = sample(lg, temperature, no_k, no_p, seeds, counters, mode=mode, argmax_kernel=True)
            np.testing.assert_array_equal(np.asarray(via_sample), np.asarray(want))
        zero_min_p = sample(lg, temperature, no_k, no_p, seeds, counters, mode="random", argmax_kernel=True,
                            min_p=jnp.zeros(n))
        np.testing.assert_array_equal(np.asarray(zero_min_p), np.asarray(want))
    assert int(want[2]) == 5 and int(want[3]) == 130 and int(want[4]) == 999
    # Filters through the kernel: the same tokens as XLA's filtered path.
    top_k = jnp.asarray([2, -1, 3, -1, 1, 5, -1], jnp.int32)
    top_p = jnp.asarray([1.0, 0.5, 1.0, 1.0, 1.0, 0.9, 0.2])
    lg = jnp.asarray(logits)
    for min_p in (None, jnp.full(n, 0.05)):
        a = sample(lg, temperature, top_k, top_p, seeds, counters, mode="filtered", min_p=min_p, argmax_kernel=True)
        b = sample(lg, temperature, top_k, top_p, seeds, counters, mode="filtered", min_p=min_p, argmax_kernel=False)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="block"):
        gumbel_argmax(lg, inv, seeds, counters, block=100, interpret=True)


def test_gumbel_noise_is_standard_gumbel_also_in_its_upper_tail():
    """The noise's moments are Gumbel's (mean = Euler's gamma, variance pi**2/6), and its upper tail,
    where the series replaces the logarithm (w < 1/16: noise > ~2.7) and the winners are, has the
    tail probabilities of a Gumbel at several levels."""
    from jaxpaged.sampling.sampler import gumbel_noise

    g = np.asarray(gumbel_noise(jnp.arange(16, dtype=jnp.uint32), jnp.zeros(16, jnp.int32), 100_000)).ravel()
    assert np.isfinite(g).all()
    assert abs(g.mean() - 0.5772) < 0.006 and abs(g.var() - np.pi**2 / 6) < 0.02
    for level in (2.0, 2.7, 4.0, 6.0):
        want = 1.0 - np.exp(-np.exp(-level))
        got = (g > level).mean()
        assert abs(got - want) < 4 * np.sqrt(want / g.size) + 1e-6, (level, got, want)
    assert g.max() < 17.0 and g.min() > -3.0  # 23 bits: -log(-log(u)) stays within [-2.8, 16.6]


def test_gumbel_argmax_kernel_edge_rows_match_the_xla_sampler():
    """NaN logits (a NaN wins, the first one, as with jnp.argmax; never an id past the vocabulary), an
    all-NaN row, a greedy row with a +inf logit under min-p (raw logits for greedy rows), a huge
    finite temperature (still sampled, never read as greedy) and a greedy row whose best is a -0 before
    a +0 (equal: the first wins): the kernel's tokens are XLA's path's, also with looped programs."""
    from jaxpaged.kernels.gumbel_argmax import SamplerConfig, gumbel_argmax

    n, vocab = 7, 700
    logits = np.array(jax.random.normal(jax.random.key(5), (n, vocab)), np.float32)
    logits[6] = -1.0
    logits[6, [40, 500]] = [-0.0, 0.0]  # greedy row: -0 == +0, the first one wins
    logits[0, [300, 650]] = np.nan  # greedy row: the first NaN
    logits[1, 650] = np.nan  # sampled row: the NaN in the last chunk
    logits[2] = np.nan
    logits[3, 7] = np.inf  # greedy row, min-p below
    temperature = jnp.asarray([0.0, 0.8, 0.5, 0.0, 1e38, 0.9, 0.0], jnp.float32)
    seeds, counters = jnp.arange(n, dtype=jnp.uint32), jnp.arange(n, dtype=jnp.int32)
    no_k, no_p, lg = jnp.full(n, -1, jnp.int32), jnp.ones(n), jnp.asarray(logits)
    for mode, min_p in (("random", None), ("filtered", None), ("random", jnp.full(n, 0.1))):
        got = sample(lg, temperature, no_k, no_p, seeds, counters, mode=mode, min_p=min_p, argmax_kernel=True)
        want = sample(lg, temperature, no_k, no_p, seeds, counters, mode=mode, min_p=min_p, argmax_kernel=False)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{mode} {min_p}")
        assert int(got[0]) == 300 and int(got[2]) == 0 and int(got[3]) == 7 and 0 <= int(got.max()) < vocab
        if min_p is None:  # (min-p's row maximum is NaN there: whatever it keeps, both paths agree above)
            assert int(got[1]) == 650 and int(got[6]) == 40
    want = sample(lg, temperature, no_k, no_p, seeds, counters, mode="random", argmax_kernel=False)
    inv = jnp.where(temperature > 0, jnp.maximum(1.0 / jnp.where(temperature > 0, temperature, 1.0),
                                                 np.finfo(np.float32).tiny), 0.0)  # as sample() has it
    for config in (SamplerConfig(64, steps=3), SamplerConfig(128, steps=8)):  # NaN and zero rules, looped
        got = gumbel_argmax(lg, inv, seeds, counters, config=config, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(config))
