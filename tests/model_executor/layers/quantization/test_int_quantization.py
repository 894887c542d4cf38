"""--quantization wint8 / wint4 / w8a8 on a Hugging Face checkpoint: registry, load-time quantization, refusals."""

import numpy as np
import paddle
import pytest

from fastdeploy.model_executor.layers import quantization
from fastdeploy.model_executor.layers.linear import RowParallelLinear
from fastdeploy.model_executor.layers.quantization.int_kernels import BF16_DOT_PATHS, KERNEL_PATHS, path_for_dtype
from fastdeploy.model_executor.layers.quantization.w8a8 import W8A8Config, W8A8LinearMethod
from fastdeploy.model_executor.layers.quantization.weight_only import IntLinearMethod, WInt4Config, WInt8Config
from fastdeploy.model_executor.layers.vocab_embedding import ParallelLMHead
from fastdeploy.platforms.cpu import onednn_w8a8_weight_max

METHODS = ["wint8", "wint4", "w8a8"]
# Largest logit error relative to the logits' spread, per format, on the tiny random model.
TOLERANCE = {"wint8": 0.02, "wint4": 0.15, "w8a8": 0.03}


def test_the_methods_are_registered_and_the_platform_supports_the_registry():
    from fastdeploy.platforms import current_platform

    assert {"wint8": WInt8Config, "wint4": WInt4Config, "w8a8": W8A8Config}.items() <= {
        m: quantization.get_quantization_config(m) for m in quantization.get_quantization_methods()}.items()
    assert current_platform.supported_quantization == quantization.get_quantization_methods()


def test_the_projections_are_quantized_and_the_head_is_not():
    assert isinstance(RowParallelLinear(64, 8, quant_config=WInt4Config()).quant_method, IntLinearMethod)
    assert isinstance(RowParallelLinear(64, 8, quant_config=W8A8Config()).quant_method, W8A8LinearMethod)
    assert type(ParallelLMHead(40, 64, quant_config=WInt8Config()).quant_method).__name__ == "UnquantizedLinearMethod"


def test_bf16_dot_products_serve_bf16_models_only():
    for path in BF16_DOT_PATHS:
        assert path_for_dtype(path, "bfloat16") == path
        assert path_for_dtype(path, "float32") == "avx512"
    assert path_for_dtype("avx2", "bfloat16") == "avx2"
    # AMX tiles take 32 rows of K at a time: other groups of a multi-group layer go to the registers.
    assert path_for_dtype("amx-bf16", "bfloat16", 576, 128) == "amx-bf16"
    assert path_for_dtype("amx-bf16", "bfloat16", 576, 16) == "avx512-bf16"
    assert path_for_dtype("amx-bf16", "bfloat16", 16, 16) == "amx-bf16"  # one group


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.model_executor.utils import build_tiny_checkpoint

    return build_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("tiny_llama"))


@pytest.mark.parametrize("method", METHODS)
def test_a_checkpoint_quantized_at_load_is_close_to_fp32(tiny_llama, method):
    from fastdeploy.config import ModelConfig
    from fastdeploy.model_executor.model_loader import get_model
    from tests.model_executor.utils import load_our_model, prefill_logits

    prompt = [3, 17, 42, 5, 99, 64, 7, 1, 250, 33]
    ref = prefill_logits(load_our_model(tiny_llama), prompt)
    model = get_model(ModelConfig(model=tiny_llama, quantization=method, dtype="float32"))
    proj = model.model.layers[0].mlp.down_proj
    assert proj.weight is None and proj.qweight.dtype.name in ("UINT8", "INT8")
    if method != "w8a8":  # an fp32 model keeps fp32 activations: never the bf16 dot products
        assert proj._int_args[-1] not in [KERNEL_PATHS[p] for p in BF16_DOT_PATHS]
    got = prefill_logits(model, prompt)
    err = np.abs(got - ref).max() / (ref.max() - ref.min())
    assert 0 < err < TOLERANCE[method], err


@pytest.mark.parametrize("path", ["onednn", "scalar"])
def test_a_w8a8_layer_scales_each_group_of_its_input_features(path):
    """K = 200 in groups of at most 64 (4 x 64, the last one part-filled): a weight column whose first group is 100x the rest
    keeps the rest's precision (per-group weight scales), and the output is x @ dense_weight up to the
    activations' rounding, also for a row with an outlier."""
    from fastdeploy.model_executor.layers.quantization.w8a8 import w8a8_group

    rng = np.random.default_rng(1)
    k, n = 200, 24
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[:64] *= 100
    weight_max = onednn_w8a8_weight_max() if path == "onednn" else 127  # the platform's choice on each path
    layer = RowParallelLinear(k, n, bias=True, quant_config=W8A8Config())
    object.__setattr__(layer, "quant_method", W8A8LinearMethod(path, weight_max, max_group=64))
    layer.weight.set_value(w)
    layer.bias.set_value(rng.standard_normal(n).astype(np.float32))
    layer.process_weights_after_loading("float32")
    assert w8a8_group(k, 64) == 64 and layer.weight_scale.shape == [4, n] and layer.weight_sum.shape == [4, n]
    dense = layer.dense_weight().numpy()
    # Rounding to half a step of each group's own scale: the small groups are not coarsened by the big one.
    assert np.all(np.abs(dense[64:] - w[64:]) <= np.abs(w[64:]).max(0) / weight_max / 2 * 1.0001)
    x = rng.standard_normal((5, k)).astype(np.float32)
    x[3, 150] = 50.0
    got = layer(paddle.to_tensor(x)).numpy()
    want = x @ dense + layer.bias.numpy()
    # Each activation rounds by at most half its group's step (hi - lo) / 255: the bound per output (row 3's
    # outlier at column 150 widens only the step of columns 128..191; one scale per row would break it).
    bound = sum((np.maximum(x[:, i : i + 64].max(1), 0) - np.minimum(x[:, i : i + 64].min(1), 0))[:, None] / 510
                * np.abs(dense[i : i + 64]).sum(0) for i in range(0, k, 64))
    assert np.all(np.abs(got - want) <= bound * 1.001 + 1e-4)


def test_w8a8_splits_k_evenly_into_groups_of_at_most_768():
    from fastdeploy.model_executor.layers.quantization.w8a8 import w8a8_group

    # SmolLM2-135M's 576 and 1536, a K under one group, Qwen2.5-0.5B's 896 and 4864, Llama's 4096 / 11008.
    assert [w8a8_group(k) for k in (576, 1536, 200, 896, 4864, 4096, 11008)] == [576, 768, 200, 448, 704, 704, 736]
    assert w8a8_group(769) == 416 and w8a8_group(12288) * 16 == 12288


@pytest.mark.parametrize("method", METHODS)
def test_a_gguf_file_is_refused(method):
    from types import SimpleNamespace

    cfg = SimpleNamespace(gguf_file="model.gguf", model="model.gguf")
    with pytest.raises(ValueError, match=f"quantization='{method}' quantizes a bf16/fp32 checkpoint"):
        quantization.get_quantization_config(method).check_model(cfg)


def test_without_the_kernels_the_methods_are_refused():
    from fastdeploy.model_executor.custom_op import set_op_backend
    from fastdeploy.platforms.interface import OpBackend

    with set_op_backend(OpBackend()):
        for config in (WInt8Config, WInt4Config):
            with pytest.raises(RuntimeError, match=r"needs the C\+\+ integer kernels"):
                config()
        with pytest.raises(RuntimeError, match=r"quantization='w8a8' needs the C\+\+ kernels"):
            W8A8Config()


@pytest.fixture(scope="module")
def hf_folder():
    """The default model as a Hugging Face folder (benchmarks/compare_vllm.py converts it once, cached)."""
    import importlib.util
    import os
    import sys

    from fastdeploy import envs

    path = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "benchmarks", "compare_vllm.py")
    spec = importlib.util.spec_from_file_location("compare_vllm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compare_vllm", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.ensure_hf_model(envs.cache_root())


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_the_default_model_quantized_at_load_is_batch_invariant(hf_folder, method):
    """Each prompt's greedy tokens are the same alone and batched with the others (LLM end to end)."""
    from fastdeploy import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at",
               "1, 2, 3, 4,", "The quick brown fox"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=hf_folder, quantization=method, max_model_len=512, kv_cache_memory_bytes=64 << 20)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
