"""quantization="gguf" (a GGUF file's default): the layer methods on GGUF blocks, the refusals, the default model."""

import numpy as np
import paddle
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from fastdeploy import _custom_ops as ops
from fastdeploy.model_executor.layers import quantization
from fastdeploy.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from fastdeploy.model_executor.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod
from fastdeploy.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from fastdeploy.transformers_utils.gguf_utils import GGUFBlocks
from tests.csrc.test_csrc_gguf_gemm import as_kernel_sees, random_blocks

rng = np.random.default_rng(0)
Q4_K, Q6_K, Q8_0 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K, GGMLQuantizationType.Q8_0


def blocks(name, qtype, rows, k):
    return GGUFBlocks(name, int(qtype), (rows, k), random_blocks(qtype, rows, k))


def test_gguf_is_registered():
    assert "gguf" in quantization.get_quantization_methods()
    assert quantization.get_quantization_config("gguf") is GGUFConfig


def test_a_fused_layer_of_mixed_type_shards_multiplies_from_its_blocks():
    """Q4_K q/k with a Q6_K v (a Q4_K_M file's attention) in one QKV layer, with a bias."""
    k = 256
    layer = QKVParallelLinear(k, 32, 4, 2, bias=True, quant_config=GGUFConfig(), prefix="model.layers.0.qkv_proj")
    assert isinstance(layer.quant_method, GGUFLinearMethod)
    shards = {"q": blocks("blk.0.attn_q.weight", Q4_K, 128, k), "k": blocks("blk.0.attn_k.weight", Q4_K, 64, k),
              "v": blocks("blk.0.attn_v.weight", Q6_K, 64, k)}
    bias = rng.standard_normal(256).astype(np.float32)
    for shard in ("v", "q", "k"):  # in any order
        layer.weight_loader(layer.weight, shards[shard], shard)
        layer.weight_loader(layer.bias, bias[layer.shard_offsets[shard][0]:][: shards[shard].shape[0]], shard)
    assert layer.process_weights_after_loading("bfloat16")
    assert layer.weight is None and layer.qweight.dtype == paddle.uint8 and layer.qweight_type == [12, 14]
    # The blocks packed per segment (Q4_K q and k one segment, Q6_K v the next), nothing dequantized.
    packed = [ops.gguf_pack(paddle.to_tensor(np.concatenate([shards[s].data.reshape(-1) for s in group])),
                            [int(qtype), rows], k).shape[0] for group, qtype, rows in (("qk", Q4_K, 192), ("v", Q6_K, 64))]
    assert layer.qweight.shape == [sum(packed)]
    dense = np.concatenate([dequantize(shards[s].data, GGMLQuantizationType(shards[s].ggml_type)) for s in "qkv"])
    np.testing.assert_array_equal(layer.dense_weight().numpy(), dense.T)
    x = rng.standard_normal((3, k)).astype(np.float32)
    want = as_kernel_sees(x).astype(np.float64) @ dense.T.astype(np.float64) + bias
    np.testing.assert_allclose(layer(paddle.to_tensor(x)).numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_the_embedding_looks_up_rows_and_a_tied_head_shares_its_blocks():
    embed = VocabParallelEmbedding(40, 64, quant_config=GGUFConfig(), prefix="model.embed_tokens")
    head = ParallelLMHead(40, 64, quant_config=GGUFConfig(), prefix="lm_head")
    table = blocks("token_embd.weight", Q8_0, 40, 64)
    embed.weight_loader(embed.weight, table)
    head.tie_weights(embed)
    assert head.process_weights_after_loading("float32")
    assert embed.weight is None and head.weight is None and head.qweight is embed.qweight  # one copy of the table
    dense = dequantize(table.data, Q8_0)
    ids = np.array([7, 0, 39], np.int64)
    np.testing.assert_array_equal(embed(paddle.to_tensor(ids)).numpy(), dense[ids])
    x = rng.standard_normal((2, 64)).astype(np.float32)
    want = as_kernel_sees(x).astype(np.float64) @ dense.T
    np.testing.assert_allclose(head(paddle.to_tensor(x)).numpy(), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_type_without_a_kernel_is_refused_by_tensor_and_type():
    layer = RowParallelLinear(64, 8, quant_config=GGUFConfig())
    f16 = GGUFBlocks("blk.3.ffn_down.weight", int(GGMLQuantizationType.F16), (8, 64), np.zeros((8, 128), np.uint8))
    with pytest.raises(ValueError, match=r"'blk.3.ffn_down.weight' has type F16.*supported: Q8_0, Q4_0, Q4_1.*Q6_K"):
        layer.weight_loader(layer.weight, f16)
    with pytest.raises(ValueError, match="got a dense ndarray"):
        layer.weight_loader(layer.weight, np.zeros((8, 64), np.float32))
    with pytest.raises(ValueError, match=r"checkpoint has \(8, 32\), model expects \(8, 64\)"):
        layer.weight_loader(layer.weight, blocks("w", Q8_0, 8, 32))


def test_a_model_that_is_no_gguf_file_is_refused_at_start_up(tmp_path):
    from fastdeploy.engine.arg_utils import EngineArgs
    from tests.model_executor.utils import build_tiny_checkpoint

    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path)
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF file"):
        EngineArgs(model=path, quantization="gguf").create_engine_config()


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "Water boils at"]


def _served_model(llm):
    return llm.llm_engine.engine_core.worker.model_runner.model


def _held_bytes(model) -> int:
    """Bytes of every parameter and buffer the model holds (each tensor once: a tied head shares its table)."""
    tensors = {id(t): t for _, t in [*model.named_parameters(), *model.named_buffers()] if t is not None}
    return sum(t.numel().item() * t.element_size() for t in tensors.values())


@pytest.mark.slow
def test_the_default_model_is_served_in_its_blocks_and_agrees_with_the_dequantized_fp32_path(smol_llm):
    """Without -q the default GGUF runs on the block methods, in a sixth of the memory of -q none's fp32.

    Greedy tokens against the file dequantized in fp32 (``-q none``): quantized activations move
    the logits a little, so where two tokens are nearly tied the paths may part (measured: after
    5, 16+, 3 and 16+ of 16 tokens for these prompts). Up to that point both pick the same tokens
    with close logprobs, and where they part -q gguf's token is the fp32 path's runner-up, nearly
    as likely.
    """
    from fastdeploy import LLM, SamplingParams
    from fastdeploy.model_executor.layers.linear import LinearBase
    from fastdeploy.model_executor.layers.quantization.gguf import GGUFEmbeddingMethod

    model = _served_model(smol_llm)
    assert smol_llm.llm_engine.engine_core.fd_config.model_config.quantization == "gguf"
    linears = [layer for layer in model.sublayers() if isinstance(layer, LinearBase)]
    assert linears and all(isinstance(layer.quant_method, GGUFLinearMethod) for layer in linears)
    assert all(layer.weight is None and layer.qweight.dtype == paddle.uint8 for layer in linears)
    assert isinstance(model.model.embed_tokens.quant_method, GGUFEmbeddingMethod)

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True)
    dequantized = LLM(quantization="none", dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20,
                      max_num_seqs=8)
    # 103 MB of blocks (the file is 95 MB) against 658 MB of fp32 weights.
    assert _held_bytes(model) * 5 < _held_bytes(_served_model(dequantized))
    ours = [o.outputs[0] for o in smol_llm.generate(PROMPTS, params)]
    ref = [o.outputs[0] for o in dequantized.generate(PROMPTS, params)]
    agreed = []
    for a, b in zip(ours, ref, strict=True):
        same = np.asarray(a.token_ids) == np.asarray(b.token_ids)
        n = len(same) if same.all() else int(np.argmin(same))
        agreed.append(n)
        for i in range(n):
            tok = a.token_ids[i]
            assert abs(a.logprobs[i][tok].logprob - b.logprobs[i][tok].logprob) < 0.5
        if n < len(same):
            ours_tok, ref_tok = a.token_ids[n], b.token_ids[n]
            assert ours_tok in b.logprobs[n], (n, ours_tok, b.logprobs[n])
            assert b.logprobs[n][ref_tok].logprob - b.logprobs[n][ours_tok].logprob < 0.5
    assert sum(agreed) >= 32, agreed


def test_without_the_block_kernels_or_a_model_class_for_it_gguf_is_refused():
    from types import SimpleNamespace

    from fastdeploy.model_executor.custom_op import set_op_backend
    from fastdeploy.model_executor.model_loader.loader import quantization_kwargs
    from fastdeploy.model_executor.models.llama import LlamaForCausalLM
    from fastdeploy.platforms.interface import OpBackend

    with set_op_backend(OpBackend()), pytest.raises(RuntimeError, match="needs the C\\+\\+ block kernels"):
        GGUFConfig()

    class DenseOnly:  # a model class without quant_config, as the PaddleFormers backend
        def __init__(self, hf_config, dtype="float32"):
            pass

    gguf = SimpleNamespace(quantization="gguf")
    with pytest.raises(ValueError, match="quantization='gguf' is not built for DenseOnly"):
        quantization_kwargs(gguf, DenseOnly, "auto")
    with pytest.raises(ValueError, match="load_format='dummy' has none to keep"):
        quantization_kwargs(gguf, LlamaForCausalLM, "dummy")
    assert quantization_kwargs(SimpleNamespace(quantization=None), DenseOnly, "dummy") == {}
