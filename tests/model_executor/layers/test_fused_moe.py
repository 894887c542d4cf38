"""FusedMoE: routing variants, expert weight loading, and the forward against a per-token numpy reference."""

from functools import partial

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.custom_op import set_op_backend
from fastdeploy.model_executor.layers.fused_moe import (
    FusedMoE,
    FusedMoEMethodBase,
    UnquantizedFusedMoEMethod,
    expert_params_mapping,
    select_experts,
)
from fastdeploy.model_executor.layers.quantization import QuantizationConfig
from fastdeploy.platforms import current_platform
from fastdeploy.platforms.interface import OpBackend

E, K, H, INTER = 8, 2, 24, 16
rng = np.random.default_rng(0)


# select_experts' two implementations: the Paddle ops, and fd_select_experts where the kernels are built.
ROUTING = [False] + ([True] if current_platform.get_op_backend().uses_kernel("moe_routing") else [])


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _silu(x):
    return x / (1 + np.exp(-x))


def _reference(x, ids, weights, w13, w2):
    """Each token on its own: the weighted sum of its experts' SwiGLU outputs."""
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            h = w13[ids[t, k]].astype(np.float64) @ x[t]
            act = _silu(h[:INTER]) * h[INTER:]
            out[t] += weights[t, k] * (w2[ids[t, k]].astype(np.float64) @ act)
    return out


def _layer(backend=None, **kwargs):
    """A FusedMoE with random experts loaded one shard at a time (as from a checkpoint); (layer, w13, w2)."""
    w13 = (rng.standard_normal((E, 2 * INTER, H)) * 0.2).astype(np.float32)
    w2 = (rng.standard_normal((E, H, INTER)) * 0.2).astype(np.float32)
    with set_op_backend(backend or current_platform.get_op_backend()):
        layer = FusedMoE(E, K, H, INTER, **kwargs)
    for e in range(E):
        layer.weight_loader(layer.w13_weight, w13[e, :INTER], (e, "w1"))
        layer.weight_loader(layer.w13_weight, w13[e, INTER:], (e, "w3"))
        layer.weight_loader(layer.w2_weight, w2[e], (e, "w2"))
    return layer, w13, w2


def test_checkpoint_names_map_to_stacked_shards():
    assert expert_params_mapping("model.layers.3.mlp.experts.7.up_proj.weight") == (
        "model.layers.3.mlp.experts.w13_weight", (7, "w3"))
    assert expert_params_mapping("model.layers.3.mlp.experts.0.down_proj.weight") == (
        "model.layers.3.mlp.experts.w2_weight", (0, "w2"))
    assert expert_params_mapping("model.layers.0.mlp.experts.gate_up_proj") == ("model.layers.0.mlp.experts.w13_weight",
                                                                                None)
    assert expert_params_mapping("model.layers.0.mlp.shared_experts.gate_proj.weight") is None
    assert expert_params_mapping("model.layers.0.mlp.gate.weight") is None


@pytest.mark.parametrize("use_kernel", ROUTING)
def test_softmax_top_k_with_and_without_renormalizing(use_kernel):
    route = partial(select_experts, use_kernel=use_kernel)
    logits = rng.standard_normal((5, E)).astype(np.float32)
    probs = _softmax(logits.astype(np.float64))
    want_ids = np.argsort(-probs, axis=-1)[:, :K]
    want = np.take_along_axis(probs, want_ids, -1)
    for renorm in (False, True):
        w, ids = route(paddle.to_tensor(logits), K, renorm)
        assert ids.dtype == paddle.int64
        np.testing.assert_array_equal(ids.numpy(), want_ids)
        expected = want / want.sum(-1, keepdims=True) if renorm else want
        np.testing.assert_allclose(w.numpy(), expected, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", ROUTING)
def test_correction_bias_chooses_but_does_not_weigh(use_kernel):
    """ERNIE 4.5: top-k of (probs + bias), weights = the unbiased probs renormalized (floored at norm_min)."""
    route = partial(select_experts, use_kernel=use_kernel)
    logits = rng.standard_normal((6, E)).astype(np.float32)
    bias = np.zeros(E, np.float32)
    bias[[5, 6]] = 1.0  # larger than any probability gap: experts 5 and 6 always win
    w, ids = route(paddle.to_tensor(logits), K, True, e_score_correction_bias=paddle.to_tensor(bias[None]),
                   renormalize_min=1e-12)
    assert (np.sort(ids.numpy(), -1) == [5, 6]).all()
    probs = _softmax(logits.astype(np.float64))
    chosen = np.take_along_axis(probs, ids.numpy(), -1)
    np.testing.assert_allclose(w.numpy(), chosen / chosen.sum(-1, keepdims=True), rtol=1e-5)


@pytest.mark.parametrize("use_kernel", ROUTING)
def test_grouped_sigmoid_routing_keeps_to_the_best_groups(use_kernel):
    """DeepSeek-V3's variant: sigmoid scores, groups scored by their two best biased experts, scaling factor."""
    route = partial(select_experts, use_kernel=use_kernel)
    logits = rng.standard_normal((7, E)).astype(np.float32)
    bias = (rng.standard_normal(E) * 0.1).astype(np.float32)
    w, ids = route(paddle.to_tensor(logits), K, True, scoring_func="sigmoid",
                            e_score_correction_bias=paddle.to_tensor(bias), num_expert_group=4, topk_group=2,
                            routed_scaling_factor=2.5)
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    biased = scores + bias
    for t in range(7):
        groups = biased[t].reshape(4, 2).sum(-1)  # two experts per group: their sum
        allowed = np.concatenate([np.arange(2 * g, 2 * g + 2) for g in np.argsort(-groups)[:2]])
        masked = np.full(E, -np.inf)
        masked[allowed] = biased[t, allowed]
        want_ids = np.argsort(-masked)[:K]
        np.testing.assert_array_equal(ids.numpy()[t], want_ids)
        chosen = scores[t, want_ids]
        np.testing.assert_allclose(w.numpy()[t], 2.5 * chosen / chosen.sum(), rtol=1e-5)


@pytest.mark.parametrize("use_kernel", ROUTING)
def test_routing_refuses_bad_arguments(use_kernel):
    route = partial(select_experts, use_kernel=use_kernel)
    logits = paddle.zeros([2, E])
    with pytest.raises(ValueError, match="top_k"):
        route(logits, E + 1, True)
    with pytest.raises(ValueError, match="scoring_func"):
        route(logits, K, True, scoring_func="relu")
    with pytest.raises(ValueError, match="num_expert_group"):
        route(logits, K, True, num_expert_group=3, topk_group=1)
    with pytest.raises(ValueError, match="both"):
        route(logits, K, True, num_expert_group=2)
    with pytest.raises(ValueError, match="kept groups"):  # 1 group of 2 experts cannot give 3
        route(paddle.zeros([2, E]), 3, True, num_expert_group=4, topk_group=1)


@pytest.mark.skipif(True not in ROUTING, reason="fd_select_experts is not built here")
@pytest.mark.parametrize("variant", [
    dict(),
    dict(renormalize=False),
    dict(e_score_correction_bias=True, renormalize_min=1e-12),
    dict(scoring_func="sigmoid", e_score_correction_bias=True, num_expert_group=8, topk_group=4,
         routed_scaling_factor=2.5),
    dict(scoring_func="softmax", num_expert_group=4, topk_group=2, renormalize=False, routed_scaling_factor=16.0),
])
def test_the_kernel_routes_as_the_paddle_ops(variant):
    """fd_select_experts against router.py's Paddle ops: 64 experts, top-6, 0 / 1 / 33 tokens, fp32 and bf16
    logits (distinct multiples of 1/32, exact in bf16: paddle.topk orders equal values in no fixed way)."""
    e, k = 64, 6
    logits = np.stack([rng.permutation(e) / 32 - 1 for _ in range(33)]).astype(np.float32)
    kwargs = {"renormalize": True} | variant
    if kwargs.pop("e_score_correction_bias", False):
        kwargs["e_score_correction_bias"] = paddle.to_tensor((rng.standard_normal((1, e)) * 0.05).astype(np.float32))
    for rows in (0, 1, 33):
        for dtype in ("float32", "bfloat16"):
            x = paddle.to_tensor(logits[:rows]).astype(dtype)
            want_w, want_ids = select_experts(x, k, **kwargs)
            got_w, got_ids = select_experts(x, k, use_kernel=True, **kwargs)
            assert got_ids.dtype == paddle.int64 and got_w.dtype == paddle.float32
            np.testing.assert_array_equal(got_ids.numpy(), want_ids.numpy(), err_msg=f"{rows} rows {dtype}")
            np.testing.assert_allclose(got_w.numpy(), want_w.numpy(), rtol=2e-6, atol=1e-7)


def test_the_kernel_breaks_ties_by_the_lower_expert_id():
    if True not in ROUTING:
        pytest.skip("fd_select_experts is not built here")
    logits = np.zeros((2, E), np.float32)
    logits[1, [2, 5, 6]] = 1.0  # 2, 5, 6 tie above the rest
    weights, ids = select_experts(paddle.to_tensor(logits), 3, False, use_kernel=True)
    np.testing.assert_array_equal(ids.numpy(), [[0, 1, 2], [2, 5, 6]])
    np.testing.assert_allclose(weights.numpy()[0], 1 / E, rtol=1e-6)
    # A NaN router output ranks first, as paddle.topk ranks it: it shows in the weights, never routed around.
    logits[1, 7] = np.nan
    for use_kernel in ROUTING:
        weights, ids = select_experts(paddle.to_tensor(logits), 3, False, scoring_func="sigmoid", use_kernel=use_kernel)
        assert ids.numpy()[1, 0] == 7 and np.isnan(weights.numpy()[1, 0]), use_kernel


def _routing_logits(choices):
    """Router logits that make token t pick exactly ``choices[t]`` (first the larger)."""
    logits = np.full((len(choices), E), -4.0, np.float32)
    for t, experts in enumerate(choices):
        for rank, e in enumerate(experts):
            logits[t, e] = 2.0 - rank * 0.5 + 0.1 * t
    return logits


# Five tokens: three share experts (1, 4), two share 4 with another; experts 0, 2, 5, 7 get none.
_CHOICES = [(1, 4), (4, 1), (1, 4), (6, 4), (3, 6)]


@pytest.mark.parametrize("path", ["paddle", "kernel"])
def test_forward_matches_each_token_alone(path):
    if path == "kernel" and not current_platform.get_op_backend().uses_kernel("fused_moe"):
        pytest.skip("the fused MoE kernel is not built here")
    layer, w13, w2 = _layer(OpBackend() if path == "paddle" else None, renormalize=True)
    assert layer.process_weights_after_loading("float32") == (path == "kernel")
    x = rng.standard_normal((len(_CHOICES), H)).astype(np.float32)
    logits = _routing_logits(_CHOICES)
    weights, ids = layer.select_experts(paddle.to_tensor(logits))
    assert [tuple(r) for r in ids.numpy()] == _CHOICES
    used = set(np.unique(ids.numpy()))
    assert used == {1, 3, 4, 6}  # some experts get several tokens, some none
    got = layer(paddle.to_tensor(x), paddle.to_tensor(logits)).numpy()
    np.testing.assert_allclose(got, _reference(x, ids.numpy(), weights.numpy(), w13, w2), rtol=1e-4, atol=1e-5)
    dense13, dense2 = layer.dense_weights()
    np.testing.assert_array_equal(dense13.numpy(), w13)
    np.testing.assert_array_equal(dense2.numpy(), w2)


def test_loader_checks_shards_and_shapes():
    layer, _, _ = _layer(OpBackend())
    assert layer.expected_shards("w2_weight") == {(e, "w2") for e in range(E)}
    assert len(layer.expected_shards("w13_weight")) == 2 * E
    with pytest.raises(ValueError, match="Shape mismatch"):
        layer.weight_loader(layer.w13_weight, np.zeros((INTER, H + 1), np.float32), (0, "w1"))
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight_loader(layer.w2_weight, np.zeros((H, INTER), np.float32), (0, "w1"))
    with pytest.raises(ValueError, match="does not fit"):
        layer.weight_loader(layer.w13_weight, np.zeros((INTER, H), np.float32), (E, "w1"))
    stacked = rng.standard_normal((E, 2 * INTER, H)).astype(np.float32)
    layer.weight_loader(layer.w13_weight, stacked, None)
    np.testing.assert_array_equal(layer.w13_weight.numpy(), stacked)


class _Tripling(FusedMoEMethodBase):
    """A method of the test's own, to see that the layer runs what the quantization config gives."""

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size, dtype):
        UnquantizedFusedMoEMethod(OpBackend()).create_weights(layer, num_experts, hidden_size, intermediate_size, dtype)

    def apply(self, layer, x, topk_weights, topk_ids):
        return 3 * UnquantizedFusedMoEMethod(OpBackend()).apply(layer, x, topk_weights, topk_ids)


class _Config(QuantizationConfig):
    @classmethod
    def get_name(cls):
        return "test-tripling"

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_quant_method(self, layer, prefix):
        return _Tripling() if isinstance(layer, FusedMoE) else None


def test_the_quantization_config_gives_the_experts_their_method():
    plain, w13, w2 = _layer(OpBackend())
    tripled = FusedMoE(E, K, H, INTER, quant_config=_Config(), prefix="model.layers.0.mlp.experts")
    assert isinstance(tripled.quant_method, _Tripling)
    tripled.weight_loader(tripled.w13_weight, w13, None)
    tripled.weight_loader(tripled.w2_weight, w2, None)
    x, logits = paddle.to_tensor(rng.standard_normal((3, H)).astype(np.float32)), paddle.randn([3, E])
    np.testing.assert_allclose(tripled(x, logits).numpy(), 3 * plain(x, logits).numpy(), rtol=1e-5, atol=1e-6)
