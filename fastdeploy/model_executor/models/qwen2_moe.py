"""Qwen2-MoE: the Qwen2 decoder with sparse blocks of routed experts plus a gated shared expert.

The shared expert (``shared_expert``, a SwiGLU of ``shared_expert_intermediate_size``) runs on
every token and is scaled by ``sigmoid(shared_expert_gate(x))`` before it joins the routed sum.
"""

from __future__ import annotations

from paddle import nn

from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
from fastdeploy.model_executor.models.moe import SparseMoeBlock
from fastdeploy.model_executor.models.qwen2 import Qwen2ForCausalLM
from fastdeploy.model_executor.models.qwen3_moe import QwenMoEMixin


class Qwen2MoeForCausalLM(QwenMoEMixin, Qwen2ForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE models (Qwen2-57B-A14B)."""

    def build_moe_block(self, prefix: str, dtype: str, quant_config: QuantizationConfig | None) -> nn.Layer:
        c = self.config
        shared_size = getattr(c, "shared_expert_intermediate_size", 0) or 0
        shared = (self.shared_mlp(shared_size, False, dtype, quant_config, f"{prefix}.shared_expert")
                  if shared_size > 0 else None)
        return SparseMoeBlock(c.hidden_size, self.routed_experts(prefix, dtype, quant_config), dtype, prefix,
                              shared=shared, shared_name="shared_expert", shared_gate=shared is not None)
