"""Qwen3-MoE: the Qwen3 decoder with sparse blocks of routed experts (softmax top-k, ``norm_topk_prob``).

A layer is sparse when it is not in ``mlp_only_layers`` and ``(index + 1) % decoder_sparse_step
== 0`` (transformers' rule); the others keep the dense SwiGLU of ``intermediate_size``.
"""

from __future__ import annotations

from typing import Any

from paddle import nn

from fastdeploy.model_executor.layers.fused_moe import FusedMoE
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
from fastdeploy.model_executor.models.moe import COMMON_CHECKS, MoEModelMixin, SparseMoeBlock, refuse_unsupported
from fastdeploy.model_executor.models.qwen3 import Qwen3ForCausalLM


class QwenMoEMixin(MoEModelMixin):
    """The sparse-layer rule and routed experts of Qwen2-MoE and Qwen3-MoE."""

    def __init__(self, hf_config: Any, dtype: str = "float32", quant_config: QuantizationConfig | None = None) -> None:
        refuse_unsupported(hf_config, COMMON_CHECKS)
        super().__init__(hf_config, dtype, quant_config)

    def is_moe_layer(self, layer_idx: int) -> bool:
        c = self.config
        step = getattr(c, "decoder_sparse_step", 1) or 1
        return (layer_idx not in (getattr(c, "mlp_only_layers", None) or []) and c.num_experts > 0
                and (layer_idx + 1) % step == 0)

    def routed_experts(self, prefix: str, dtype: str, quant_config: QuantizationConfig | None) -> FusedMoE:
        c = self.config
        return FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
                        renormalize=bool(getattr(c, "norm_topk_prob", False)), dtype=dtype,
                        quant_config=quant_config, prefix=f"{prefix}.experts")


class Qwen3MoeForCausalLM(QwenMoEMixin, Qwen3ForCausalLM):
    """Qwen3-MoE models (Qwen3-30B-A3B, Qwen3-235B-A22B): routed experts, no shared expert."""

    def build_moe_block(self, prefix: str, dtype: str, quant_config: QuantizationConfig | None) -> nn.Layer:
        return SparseMoeBlock(self.config.hidden_size, self.routed_experts(prefix, dtype, quant_config), dtype, prefix)
