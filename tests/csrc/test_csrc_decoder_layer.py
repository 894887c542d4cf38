"""fd_decoder_layers (csrc/cpu/decoder_layer.cc): consecutive layers in one op equal the layers' separate kernels."""

import numpy as np
import pytest

from fastdeploy import _custom_ops
from fastdeploy.model_executor.models.fused_layers import FusedLayerRun
from tests.model_executor.utils import PagedRunner, build_tiny_checkpoint, load_our_model

pytestmark = pytest.mark.skipif(not _custom_ops.has("fd_decoder_layers"), reason="the C++ kernels are not built")


def _logits(model, fused: set[int] | None) -> np.ndarray:
    """A prefill, a chunk over cached context beside a decode, then two decodes; logits of every step.

    ``fused``: the layers that keep the fused kernel (None: all of them); the others run op by op.
    The first step's 191 tokens are more than one of the kernel's MLP row chunks (128) and a part-filled one.
    """
    for i, layer in enumerate(model.model.layers):
        layer.process_weights_after_loading()  # what loading did: the fused kernel's arguments
        if fused is not None and i not in fused:
            object.__setattr__(layer, "_fused_args", None)
    model.model.plan_fused_runs()
    runner = PagedRunner(model, num_blocks=64, block_size=4, seed=1)
    runner.add("a", list(range(5, 155)))
    runner.add("b", list(range(200, 250)))
    out = [runner.step([("a", 150), ("b", 41)]).numpy()]
    runner.append("a", 9)
    out.append(runner.step([("a", 1), ("b", 9)]).numpy())
    for token in (3, 4):
        runner.append("a", token)
        runner.append("b", token)
        out.append(runner.step([("a", 1), ("b", 1)]).numpy())
    return np.concatenate(out)


def _runs(model) -> list[tuple[int, int, bool]]:
    return [(start, stop, run is not None) for start, stop, run in model.model._plan]


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layers_equal_separate_kernels(arch, dtype, tmp_path):
    model = load_our_model(build_tiny_checkpoint(arch, tmp_path), dtype=dtype)
    fused = _logits(model, fused=None)
    assert _runs(model) == [(0, 2, True)]  # both layers in one call
    np.testing.assert_allclose(fused, _logits(model, fused=set()), rtol=1e-5, atol=1e-5)
    assert _runs(model) == [(0, 1, False), (1, 2, False)]


def test_runs_split_around_a_layer_op_by_op(tmp_path):
    """Fused runs before and after a layer that runs op by op carry hidden and residual across it."""
    model = load_our_model(build_tiny_checkpoint("Qwen3ForCausalLM", tmp_path, num_hidden_layers=5))
    mixed = _logits(model, fused={0, 1, 3, 4})
    assert _runs(model) == [(0, 2, True), (2, 3, False), (3, 5, True)]
    np.testing.assert_allclose(mixed, _logits(model, fused=set()), rtol=1e-5, atol=1e-5)
    # The first layer op by op: the fused run after it gets the residual it made.
    np.testing.assert_allclose(_logits(model, fused={1, 2, 3, 4}), mixed, rtol=1e-5, atol=1e-5)


def test_fused_layers_equal_separate_kernels_on_gguf_blocks():
    """The default model served in its GGUF blocks (-q gguf) runs its layers in one op too."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import get_model

    model = get_model(ModelConfig(model="SmolLM2-135M-Instruct", quantization="gguf", dtype="float32"))
    assert model.model.layers[0]._fused_args.settings[-1] == "gguf"
    fused = _logits(model, fused=None)
    assert _runs(model) == [(0, model.num_layers, True)]
    np.testing.assert_allclose(fused, _logits(model, fused=set()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layers_equal_separate_kernels_on_integer_weights(method, dtype, tmp_path):
    """wint8 / wint4 layers (int_gemm.cc, the platform's path for the dtype) run in one op too."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import get_model

    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    model = get_model(ModelConfig(model=path, quantization=method, dtype=dtype))
    assert model.model.layers[0]._fused_args.settings[-1] == "int"
    np.testing.assert_allclose(_logits(model, fused=None), _logits(model, fused=set()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["w8a8", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layers_equal_separate_kernels_on_one_buffer_weights(method, dtype, tmp_path):
    """w8a8 (oneDNN's u8 x s8 matmul) and fp8 (fp8_gemm.cc) layers, each weight one buffer with its scales, run in
    one op too."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.custom_op import get_op_backend
    from fastdeploy.model_executor.model_loader import get_model

    if method == "w8a8" and get_op_backend().w8a8 != "onednn":
        pytest.skip("w8a8 runs on its portable kernel here, op by op")
    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    model = get_model(ModelConfig(model=path, quantization=method, dtype=dtype))
    assert model.model.layers[0]._fused_args.settings[-1] == method
    fused = _logits(model, fused=None)
    assert _runs(model) == [(0, 2, True)]
    np.testing.assert_allclose(fused, _logits(model, fused=set()), rtol=1e-5, atol=1e-5)


def test_a_run_refuses_lists_and_segments_that_do_not_match_its_layers(tmp_path):
    model = load_our_model(build_tiny_checkpoint("LlamaForCausalLM", tmp_path))
    args = [layer._fused_args for layer in model.model.layers]
    runner = PagedRunner(model, num_blocks=8, block_size=4)
    runner.add("a", [1, 2, 3])
    # A run of two layers called with one layer's caches.
    with pytest.raises(Exception, match="one tensor per layer"):
        _logits_of_run(model, FusedLayerRun(0, args), runner.kv_caches[:1])
    # The second layer's weights described by the first layer's segments only.
    run = FusedLayerRun(0, args)
    after = list(run._after)
    after[-3] = after[-3][: len(after[-3]) // 2]
    run._after = tuple(after)
    with pytest.raises(Exception, match="segments hold fewer weights"):
        _logits_of_run(model, run, runner.kv_caches)


def _logits_of_run(model, run, kv_caches):
    import paddle

    from fastdeploy.model_executor.layers.attention.metadata import build_attention_metadata

    md, positions = build_attention_metadata(np.array([[0]], dtype=np.int64), np.array([3]), np.array([3]), 4)
    hidden = paddle.zeros([3, model.config.hidden_size])
    return run(hidden, None, paddle.to_tensor(positions), kv_caches, md)
