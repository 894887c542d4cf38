"""fd_exp_scaled / fd_inverse_cdf_sample (csrc/cpu/sampling.cc) against the numpy sampler's passes."""

import numpy as np
import pytest

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers.sampler import inverse_cdf_sample

pytestmark = pytest.mark.skipif(not ops.has("fd_inverse_cdf_sample"), reason="the C++ kernels are not built")


@pytest.mark.parametrize("vocab", [7, 256, 1000, 49152])
def test_exp_scaled_equals_numpy(vocab):
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((5, vocab)) * 4).astype(np.float32)
    x[1, ::3] = -np.inf  # masked tokens
    inv_t = np.array([1.0, 0.5, 2.0, 1 / 0.7, 10.0], np.float32)
    want = np.exp((x - x.max(axis=-1, keepdims=True)) * inv_t[:, None])
    got = x.copy()
    ops.exp_scaled(got, inv_t)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30)
    assert (got[1, ::3] == 0).all() and (got.max(axis=-1) == 1).all()


def test_exp_scaled_zeroes_a_row_without_a_finite_logit():
    x = np.full((2, 300), -np.inf, np.float32)
    x[1, 5] = 3.0
    ops.exp_scaled(x, np.ones(2, np.float32))
    assert (x[0] == 0).all() and x[1, 5] == 1 and np.count_nonzero(x[1]) == 1


@pytest.mark.parametrize("vocab", [3, 256, 3000, 49152])
def test_inverse_cdf_sample_equals_numpy_and_lands_on_positive_weights(vocab):
    rng = np.random.default_rng(vocab)
    weights = rng.random((64, vocab)).astype(np.float32) * (rng.random((64, vocab)) < 0.3)
    weights[:, 0] += 1e-3  # every row has some weight
    uniform = rng.random(64)
    got = ops.inverse_cdf_sample(weights, uniform)
    assert got.dtype == np.int64 and got.tolist() == inverse_cdf_sample(weights, uniform).tolist()
    cum = np.cumsum(weights, axis=-1, dtype=np.float64)
    expected = [int(np.searchsorted(cum[r], uniform[r] * cum[r, -1], side="right")) for r in range(64)]
    assert got.tolist() == expected
    for u in (0.0, np.nextafter(1.0, 0.0)):
        picked = ops.inverse_cdf_sample(weights, np.full(64, u))
        assert (weights[np.arange(64), picked] > 0).all()
        assert picked.tolist() == inverse_cdf_sample(weights, np.full(64, u)).tolist()


def test_a_row_draws_the_same_alone_and_in_a_batch():
    rng = np.random.default_rng(1)
    weights = rng.random((16, 5000)).astype(np.float32)
    uniform = rng.random(16)
    batch = ops.inverse_cdf_sample(weights, uniform)
    assert [int(ops.inverse_cdf_sample(weights[r : r + 1].copy(), uniform[r : r + 1])[0]) for r in range(16)] == (
        batch.tolist())


def test_draws_follow_the_weights():
    weights = np.tile(np.array([[0.5, 0.0, 0.3, 0.15, 0.05]], np.float32), (20000, 1))
    draws = ops.inverse_cdf_sample(weights, np.random.default_rng(2).random(20000))
    freq = np.bincount(draws, minlength=5) / len(draws)
    np.testing.assert_allclose(freq, [0.5, 0.0, 0.3, 0.15, 0.05], atol=0.01)


def test_bad_inputs_are_refused_by_name():
    w = np.ones((2, 8), np.float32)
    with pytest.raises(Exception, match="uniform"):
        ops.inverse_cdf_sample(w, np.zeros(3))
    with pytest.raises(Exception, match="uniform"):
        ops.inverse_cdf_sample(w, np.zeros(2, np.float32))
    with pytest.raises(Exception, match="weights"):
        ops.inverse_cdf_sample(np.ones(8, np.float32), np.zeros(1))
    with pytest.raises(Exception, match="inv_temperature"):
        ops.exp_scaled(w, np.ones(3, np.float32))


@pytest.mark.parametrize("vocab", [5, 300, 49152])
def test_sample_random_is_exp_scaled_then_inverse_cdf_sample(vocab):
    rng = np.random.default_rng(vocab + 1)
    x = (rng.standard_normal((8, vocab)) * 3).astype(np.float32)
    x[2] = -np.inf
    inv_t = rng.uniform(0.5, 2.0, 8).astype(np.float32)
    uniform = rng.random(8)
    fused = x.copy()
    ids = ops.sample_random(fused, inv_t, uniform)
    weights = x.copy()
    ops.exp_scaled(weights, inv_t)
    np.testing.assert_array_equal(fused, weights)  # left holding the weights
    assert ids.tolist() == ops.inverse_cdf_sample(weights, uniform).tolist()
