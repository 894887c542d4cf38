"""fd_decoder_layer (csrc/cpu/decoder_layer.cc): one op per layer equals the layer's separate kernels."""

import numpy as np
import pytest

from tests.model_executor.utils import PagedRunner, build_tiny_checkpoint, load_our_model


def _logits(model, fused: bool) -> np.ndarray:
    """A prefill, a chunk over cached context beside a decode, then two decodes; logits of every step."""
    for layer in model.model.layers:
        if fused:
            layer.process_weights_after_loading()  # what loading did: the fused kernel's arguments
        else:
            object.__setattr__(layer, "_fused_args", None)
    runner = PagedRunner(model, num_blocks=32, block_size=4, seed=1)
    runner.add("a", list(range(5, 30)))
    runner.add("b", list(range(40, 52)))
    out = [runner.step([("a", 25), ("b", 7)]).numpy()]
    runner.append("a", 9)
    out.append(runner.step([("a", 1), ("b", 5)]).numpy())
    for token in (3, 4):
        runner.append("a", token)
        runner.append("b", token)
        out.append(runner.step([("a", 1), ("b", 1)]).numpy())
    assert all((layer._fused_args is not None) == fused for layer in model.model.layers)
    return np.concatenate(out)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layer_equals_separate_kernels(arch, dtype, tmp_path):
    model = load_our_model(build_tiny_checkpoint(arch, tmp_path), dtype=dtype)
    np.testing.assert_allclose(_logits(model, fused=True), _logits(model, fused=False), rtol=1e-5, atol=1e-5)


def test_fused_layer_equals_separate_kernels_on_gguf_blocks():
    """The default model served in its GGUF blocks (-q gguf) runs each layer as one op too."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import get_model

    model = get_model(ModelConfig(model="SmolLM2-135M-Instruct", quantization="gguf", dtype="float32"))
    assert model.model.layers[0]._fused_args[1][13] == "gguf"
    np.testing.assert_allclose(_logits(model, fused=True), _logits(model, fused=False), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["wint8", "wint4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layer_equals_separate_kernels_on_integer_weights(method, dtype, tmp_path):
    """wint8 / wint4 layers (int_gemm.cc, the platform's path for the dtype) run each layer as one op too."""
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import get_model

    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    model = get_model(ModelConfig(model=path, quantization=method, dtype=dtype))
    assert model.model.layers[0]._fused_args[1][13] == "int"
    np.testing.assert_allclose(_logits(model, fused=True), _logits(model, fused=False), rtol=1e-5, atol=1e-5)
