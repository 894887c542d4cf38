"""The vision towers' segment attention and their dummy weights packed layer by layer."""

from types import SimpleNamespace

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers.linear import process_linear_weights
from fastdeploy.model_executor.model_loader.loader import initialize_dummy_weights
from fastdeploy.model_executor.models.qwen2_5_vl_vision import Qwen2_5_VisionTransformer, SegmentAttention
from fastdeploy.model_executor.utils import deferred_parameters


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, cu: list[int]) -> np.ndarray:
    out = np.zeros((q.shape[0], q.shape[1] * q.shape[2]), np.float32)
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        qq, kk, vv = (t[a:b].transpose(1, 0, 2) for t in (q, k, v))
        s = qq @ kk.transpose(0, 2, 1) / np.sqrt(q.shape[2])
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[a:b] = (p @ vv).transpose(1, 0, 2).reshape(b - a, -1)
    return out


@pytest.mark.parametrize("cu", [[0, 4, 8, 12], [0, 3, 7, 12, 13], [0, 9]])
def test_segment_attention_matches_per_segment_softmax(cu):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((cu[-1], 2, 8)).astype(np.float32) for _ in range(3))
    got = SegmentAttention(np.array(cu))(*(paddle.to_tensor(t) for t in (q, k, v))).numpy()
    np.testing.assert_allclose(got, _reference(q, k, v, cu), rtol=1e-5, atol=1e-5)


def _tower_config() -> SimpleNamespace:
    # window_size 56: two merged groups per window side, so a 3x2-group image has unequal windows.
    return SimpleNamespace(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=24,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1], hidden_act="silu", in_channels=3)


def test_dummy_weights_packed_layer_by_layer_equal_packing_after_loading():
    plain = Qwen2_5_VisionTransformer(_tower_config())
    with paddle.no_grad():
        initialize_dummy_weights(plain)
        process_linear_weights(plain, "float32")
    with deferred_parameters():
        lazy = Qwen2_5_VisionTransformer(_tower_config())
    assert not lazy.blocks[0].attn.qkv.weight._is_initialized()  # no storage until the loader sets it
    with paddle.no_grad():
        initialize_dummy_weights(lazy, pack_dtype="float32")
        assert lazy.blocks[0].attn.qkv.is_packed == plain.blocks[0].attn.qkv.is_packed
        process_linear_weights(lazy, "float32")
    grid = np.array([[1, 6, 4]])
    pixels = paddle.to_tensor(np.random.default_rng(1).standard_normal((24, 3 * 2 * 14 * 14)).astype(np.float32))
    with paddle.no_grad():
        np.testing.assert_array_equal(lazy(pixels, grid).numpy(), plain(pixels, grid).numpy())
