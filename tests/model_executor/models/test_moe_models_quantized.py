"""MoE models with quantized experts end to end: ``-q wint8`` / ``wint4`` on a tiny Qwen3-MoE against
transformers on the checkpoint's own weights after the same quantization (dequantized), and formats
without an MoE method refused at start-up."""

import shutil

import numpy as np
import pytest

from fastdeploy.model_executor.custom_op import get_op_backend
from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.quantization.int_kernels import quantize_int4, quantize_int8
from tests.model_executor.utils import build_tiny_checkpoint, greedy_generate, hf_greedy, load_hf_model

ARCH = "Qwen3MoeForCausalLM"
PROMPT = list(range(40, 77))


def _get_model(folder, quantization):
    from fastdeploy.config import LoadConfig, ModelConfig
    from fastdeploy.model_executor.model_loader import get_model

    return get_model(ModelConfig(model=folder, dtype="float32", quantization=quantization), LoadConfig())


def _dequantized_checkpoint(folder, dst, quantization):
    """A copy of ``folder`` whose quantized matrices (every ``*_proj``: attention, dense MLP, experts; not the
    router, the embedding or the LM head) hold their wint8 / wint4 integers dequantized. Both quantize each
    output column on its own, so quantizing q/k/v (gate/up) apart gives the fused layers' integers."""
    from safetensors.numpy import load_file, save_file

    from fastdeploy.model_executor.model_loader.weight_utils import safetensors_files

    shutil.copytree(folder, dst)
    for path in safetensors_files(dst):
        tensors = load_file(path)
        for name, w in tensors.items():
            if name.endswith("_proj.weight"):
                q = quantize_int8(w.T) if quantization == "wint8" else quantize_int4(w.T, 128)
                tensors[name] = np.ascontiguousarray(q.dequantize().T)
        save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


@pytest.mark.skipif(get_op_backend().int_gemm == "paddle", reason="the integer kernels are not built")
@pytest.mark.parametrize(("arch", "quantization"), [(ARCH, "wint8"), (ARCH, "wint4"),
                                                    ("Qwen2MoeForCausalLM", "wint4")])
def test_int_experts_give_transformers_tokens_on_the_dequantized_weights(arch, quantization, tmp_path):
    """Qwen2-MoE adds a shared expert behind a sigmoid gate, which the routed experts' op runs."""
    from fastdeploy.model_executor.layers.quantization.weight_only import IntFusedMoEMethod
    from fastdeploy.model_executor.models.moe import SparseMoeBlock

    folder = build_tiny_checkpoint(arch, tmp_path / "hf")
    model = _get_model(folder, quantization)
    experts = [m for m in model.sublayers() if isinstance(m, FusedMoE)]
    assert experts and all(isinstance(m.quant_method, IntFusedMoEMethod) for m in experts)
    blocks = [m for m in model.sublayers() if isinstance(m, SparseMoeBlock)]
    assert all((b._fused_shared is not None) == (arch != ARCH) for b in blocks)
    dequantized = _dequantized_checkpoint(folder, tmp_path / "dequantized", quantization)
    hf = load_hf_model(dequantized)
    # The experts hold the dequantized checkpoint's weights (gate rows, then up rows).
    w13, w2 = (t.numpy() for t in experts[0].dense_weights())
    hf_experts = next(layer.mlp.experts for layer in hf.model.layers if hasattr(layer.mlp, "experts"))
    np.testing.assert_allclose(w13, hf_experts.gate_up_proj.detach().numpy(), rtol=0, atol=1e-7)
    np.testing.assert_allclose(w2, hf_experts.down_proj.detach().numpy(), rtol=0, atol=1e-7)
    assert greedy_generate(model, PROMPT, 24)[0] == hf_greedy(hf, PROMPT, 24)


@pytest.mark.parametrize("quantization", ["w8a8", "fp8"])
def test_formats_without_an_moe_method_are_refused_at_start_up(quantization, tmp_path):
    folder = build_tiny_checkpoint(ARCH, tmp_path / "hf")
    with pytest.raises(ValueError, match=rf"quantization='{quantization}' has no method for the MoE experts "
                                         r"'model.layers.0.mlp.experts' \(FusedMoE\).*gguf, wint4, wint8"):
        _get_model(folder, quantization)


@pytest.mark.skipif(get_op_backend().int_gemm == "paddle", reason="the integer kernels are not built")
def test_engine_batched_and_alone_give_the_dequantized_tokens(tmp_path):
    """Through the engine (chunked prefills beside decodes, block size 4), -q wint4: batched == alone == transformers
    on the dequantized checkpoint."""
    from fastdeploy import LLM, SamplingParams

    folder = build_tiny_checkpoint(ARCH, tmp_path / "hf")
    hf = load_hf_model(_dequantized_checkpoint(folder, tmp_path / "dequantized", "wint4"))
    prompts = [[5, 17, 99, 3, 250, 7], [11] * 9, PROMPT]
    llm = LLM(folder, skip_tokenizer_init=True, quantization="wint4", dtype="float32", block_size=4,
              max_num_batched_tokens=16, kv_cache_memory_bytes=4 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)

    def generate(batch):
        return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in batch], greedy,
                                                                   use_tqdm=False)]

    want = [hf_greedy(hf, p, 16) for p in prompts]
    assert generate(prompts) == want
    assert [generate([p])[0] for p in prompts] == want


@pytest.mark.skipif(get_op_backend().int_gemm == "paddle", reason="the integer kernels are not built")
def test_ernie_vl_text_steps_run_the_shared_experts_in_the_text_pools_op(tmp_path):
    """ERNIE-4.5-VL -q wint4: in a step without image tokens the text pool's op runs the shared experts, which
    gives what the pool and the shared experts' own ops give, bit for bit; image steps keep them apart."""
    import paddle

    from fastdeploy.model_executor.models.ernie4_5_vl import ModalityMoeBlock
    from tests.multimodal.utils import build_tiny_ernie4_5_vl

    model = _get_model(build_tiny_ernie4_5_vl(tmp_path / "vl"), "wint4")
    blocks = [m for m in model.sublayers() if isinstance(m, ModalityMoeBlock)]
    assert blocks and all(b._fused_shared is not None for b in blocks)
    hidden = paddle.to_tensor(np.random.default_rng(0).standard_normal((6, model.config.hidden_size)), "float32")
    for block in blocks:
        fused = block(hidden).numpy()
        shared, block._fused_shared = block._fused_shared, None
        try:
            np.testing.assert_array_equal(fused, block(hidden).numpy())
        finally:
            block._fused_shared = shared
