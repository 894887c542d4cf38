"""fd_fused_moe (csrc/cpu/moe.cc): against a per-token reference, and batch-invariant."""

import numpy as np
import paddle
import pytest

from fastdeploy import _custom_ops as ops
from tests.csrc.conftest import bf16_round

E, H, INTER = 6, 64, 48
rng = np.random.default_rng(0)
W13 = (rng.standard_normal((E, 2 * INTER, H)) * 0.1).astype(np.float32)
W2 = (rng.standard_normal((E, H, INTER)) * 0.1).astype(np.float32)


def _packed(dtype):
    w13 = paddle.stack([ops.linear_pack(paddle.to_tensor(np.ascontiguousarray(w.T)), dtype) for w in W13])
    w2 = paddle.stack([ops.linear_pack(paddle.to_tensor(np.ascontiguousarray(w.T)), dtype) for w in W2])
    return w13, w2


def _run(x, ids, weights, dtype):
    w13, w2 = _packed(dtype)
    return ops.fused_moe(paddle.to_tensor(x), paddle.to_tensor(ids, dtype="int64"), paddle.to_tensor(weights), w13, w2,
                         INTER, dtype).numpy()


def _reference(x, ids, weights, bf16):
    """Per token in float64; with bf16 the GEMM operands (x, weights, the activation) are rounded as the kernel does."""
    rnd = bf16_round if bf16 else (lambda a: a)
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            h = rnd(W13[e]).astype(np.float64) @ rnd(x[t]).astype(np.float64)
            act = (h[:INTER] / (1 + np.exp(-h[:INTER])) * h[INTER:]).astype(np.float32)
            out[t] += weights[t, k] * (rnd(W2[e]).astype(np.float64) @ rnd(act).astype(np.float64))
    return out


# Expert 0 gets three tokens, 4 and 5 two, 2 one; experts 1 and 3 get none.
IDS = np.array([[0, 2], [5, 0], [0, 4], [4, 5]], dtype=np.int64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_per_token_reference(dtype):
    x = rng.standard_normal((len(IDS), H)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, IDS.shape).astype(np.float32)
    got = _run(x, IDS, weights, dtype)
    tol = 1e-5 if dtype == "float32" else 2e-3
    np.testing.assert_allclose(got, _reference(x, IDS, weights, dtype == "bfloat16"), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_token_gets_the_same_bits_whoever_shares_its_experts(dtype):
    """Token 0 alone (every GEMM M = 1), then among 40 tokens of which many share its experts (M up to ~30)."""
    x0 = rng.standard_normal((1, H)).astype(np.float32)
    ids0 = np.array([[3, 1]], dtype=np.int64)
    w0 = np.array([[0.7, 0.3]], dtype=np.float32)
    alone = _run(x0, ids0, w0, dtype)
    others = rng.standard_normal((39, H)).astype(np.float32)
    other_ids = np.stack([rng.permutation([1, 3, 0, 2, 4, 5])[:2] for _ in range(39)]).astype(np.int64)
    other_w = rng.uniform(0.1, 1.0, other_ids.shape).astype(np.float32)
    for pos in (0, 17, 39):  # first, middle, last row of the step
        x = np.insert(others, pos, x0[0], axis=0)
        ids = np.insert(other_ids, pos, ids0[0], axis=0)
        weights = np.insert(other_w, pos, w0[0], axis=0)
        batched = _run(x, ids, weights, dtype)
        np.testing.assert_array_equal(batched[pos], alone[0])


def test_refuses_bad_expert_ids_and_shapes():
    x = rng.standard_normal((2, H)).astype(np.float32)
    weights = np.ones((2, 2), np.float32)
    with pytest.raises(Exception, match="out of range"):
        _run(x, np.array([[0, E], [1, 2]]), weights, "float32")
    w13, w2 = _packed("float32")
    with pytest.raises(Exception, match="do not match"):
        ops.fused_moe(paddle.to_tensor(x), paddle.to_tensor(IDS[:2]), paddle.to_tensor(weights), w13, w2, INTER + 1,
                      "float32")
