"""vLLM's layer-method interface: layers get their linear method from the quantization config, or the unquantized one."""

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.custom_op import set_op_backend
from fastdeploy.model_executor.layers import quantization
from fastdeploy.model_executor.layers.linear import LinearMethodBase, RowParallelLinear, UnquantizedLinearMethod
from fastdeploy.model_executor.layers.quantization import QuantizationConfig
from fastdeploy.platforms.interface import OpBackend

rng = np.random.default_rng(0)


class _Doubling(LinearMethodBase):
    """A method of the test's own: ``2 * x @ W``, to see that layers really run the method they are given."""

    def create_weights(self, layer, input_size, output_size, bias, dtype):
        UnquantizedLinearMethod(OpBackend()).create_weights(layer, input_size, output_size, bias, dtype)

    def apply(self, layer, x):
        return 2 * paddle.matmul(x, layer.weight)


class _Config(QuantizationConfig):
    @classmethod
    def get_name(cls):
        return "test-doubling"

    @classmethod
    def from_config(cls, config):
        return cls()

    def get_quant_method(self, layer, prefix):
        return None if prefix.endswith("skip") else _Doubling()


def test_the_registry_names_what_it_knows(monkeypatch):
    assert quantization.get_quantization_methods() == ["awq", "fp8", "gguf", "gptq", "w8a8", "wint4", "wint8"]
    with pytest.raises(ValueError, match="Invalid quantization method: 'bitsandbytes'. Available: .*'awq'"):
        quantization.get_quantization_config("bitsandbytes")
    monkeypatch.setattr(quantization, "_QUANTIZATION_CONFIGS", {})
    quantization.register_quantization_config("test-doubling")(_Config)
    assert quantization.get_quantization_config("test-doubling") is _Config
    with pytest.raises(ValueError, match="already registered"):
        quantization.register_quantization_config("test-doubling")(_Config)


def test_a_layer_runs_the_method_its_config_gives():
    w = rng.standard_normal((8, 4)).astype(np.float32)
    x = paddle.to_tensor(rng.standard_normal((3, 8)).astype(np.float32))
    quantized = RowParallelLinear(8, 4, quant_config=_Config(), prefix="model.layers.0.down_proj")
    skipped = RowParallelLinear(8, 4, quant_config=_Config(), prefix="model.layers.0.skip")
    assert isinstance(quantized.quant_method, _Doubling) and isinstance(skipped.quant_method, UnquantizedLinearMethod)
    for layer in (quantized, skipped):
        layer.weight_loader(layer.weight, w.T)
    np.testing.assert_allclose(quantized(x).numpy(), 2 * x.numpy() @ w, rtol=1e-5)
    np.testing.assert_allclose(skipped(x).numpy(), x.numpy() @ w, rtol=1e-5)


def test_unquantized_method_packs_only_on_a_kernel_backend():
    with set_op_backend(OpBackend()):
        plain = RowParallelLinear(8, 4, bias=True)
    assert not plain.process_weights_after_loading("float32")
    assert plain.weight is not None and not plain.is_packed
