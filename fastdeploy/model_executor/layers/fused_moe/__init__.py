"""Mixture-of-experts layers: the :class:`FusedMoE` layer, its methods and the routing functions."""

from fastdeploy.model_executor.layers.fused_moe.layer import (
    FusedMoE,
    FusedMoEMethodBase,
    GateLinear,
    UnquantizedFusedMoEMethod,
    expert_params_mapping,
    moe_forward_native,
)
from fastdeploy.model_executor.layers.fused_moe.router import select_experts

__all__ = [
    "FusedMoE",
    "FusedMoEMethodBase",
    "GateLinear",
    "UnquantizedFusedMoEMethod",
    "expert_params_mapping",
    "moe_forward_native",
    "select_experts",
]
