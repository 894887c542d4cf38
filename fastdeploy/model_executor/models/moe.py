"""What the mixture-of-experts decoders share: the sparse MoE block and the MoE side of a Llama-style model.

A model class mixes :class:`MoEModelMixin` into its dense base (Qwen2, Qwen3, ERNIE 4.5)
and says which layers are sparse (:meth:`MoEModelMixin.is_moe_layer`) and how their block
is built (:meth:`MoEModelMixin.build_moe_block`); the other layers keep the dense SwiGLU
(and with it the fused decoder-layer kernel). Expert tensors load through
:func:`~fastdeploy.model_executor.layers.fused_moe.expert_params_mapping`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import paddle
import paddle.nn.functional as F
from paddle import nn

from fastdeploy import _custom_ops as ops
from fastdeploy.logger import init_logger
from fastdeploy.model_executor.layers.fused_moe import FusedMoE, GateLinear, expert_params_mapping
from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig
from fastdeploy.model_executor.models.llama import LlamaMLP
from fastdeploy.model_executor.utils import new_parameter

logger = init_logger(__name__)


class MoEStatics(nn.Layer):
    """ERNIE 4.5's ``moe_statics``: the per-expert ``e_score_correction_bias [1, E]`` of its router."""

    def __init__(self, num_experts: int, dtype: str = "float32") -> None:
        super().__init__()
        self.e_score_correction_bias = new_parameter([1, num_experts], dtype)


class SparseMoeBlock(nn.Layer):
    """Router + routed experts (+ shared experts, optionally behind a sigmoid gate); ``[T, H] -> [T, H]``.

    Args:
        experts: the routed experts (its router options already set).
        shared: the shared experts' dense SwiGLU, or None.
        shared_name: the checkpoint name of ``shared`` ("shared_expert" in Qwen2-MoE,
            "shared_experts" in ERNIE 4.5 and DeepSeek).
        shared_gate: Qwen2-MoE's ``shared_expert_gate`` (``[H] -> 1``, through a sigmoid), or None.
        statics: ERNIE's ``moe_statics`` (its bias is ``experts``' correction bias), or None.
    """

    def __init__(self, hidden_size: int, experts: FusedMoE, dtype: str, prefix: str, *,
                 shared: nn.Layer | None = None, shared_name: str = "shared_experts",
                 shared_gate: bool = False, statics: MoEStatics | None = None) -> None:
        super().__init__()
        self.gate = GateLinear(hidden_size, experts.num_experts, dtype, f"{prefix}.gate")
        self.experts = experts
        if statics is not None:
            self.moe_statics = statics
        object.__setattr__(self, "_shared_name", shared_name if shared is not None else None)
        if shared is not None:
            setattr(self, shared_name, shared)
        self.shared_expert_gate = GateLinear(hidden_size, 1, dtype, f"{prefix}.shared_expert_gate") if shared_gate \
            else None

    # The shared experts as the routed experts' op takes them (fuse_shared_experts, once the weights are
    # packed); None: they run as ops of their own after the routed experts.
    _fused_shared: ops.SharedExperts | None = None

    @property
    def has_shared_experts(self) -> bool:
        return self._shared_name is not None

    def fuse_shared_experts(self) -> bool:
        """Let the routed experts' op run the shared experts too where it can (:func:`shared_experts_for`);
        True where it does."""
        fused = shared_experts_for(getattr(self, self._shared_name) if self.has_shared_experts else None, self.experts)
        object.__setattr__(self, "_fused_shared", fused)
        return fused is not None

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        if self._fused_shared is not None:
            gate = self.shared_expert_gate
            weights = F.sigmoid(gate(hidden_states)) if gate is not None else None
            return self.experts(hidden_states, self.gate(hidden_states), self._fused_shared, weights)
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self._shared_name is None:
            return out
        shared = getattr(self, self._shared_name)(hidden_states)
        if self.shared_expert_gate is not None:
            shared = F.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return out + shared


def refuse_unsupported(hf_config: Any, checks: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """Raise a ValueError naming the first config field that is set to something not implemented.

    ``checks``: field -> (predicate on its value, True when it is fine; what is supported).
    Fields the config does not have pass.
    """
    for field, (ok, supported) in checks.items():
        if hasattr(hf_config, field) and not ok(getattr(hf_config, field)):
            arch = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
            raise ValueError(f"{arch}: {field}={getattr(hf_config, field)!r} is not supported; {supported}.")


def _silu_only(value: Any) -> bool:
    return value == "silu"


# Fields every MoE config here is checked for (the experts are SwiGLU MLPs).
COMMON_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "hidden_act": (_silu_only, "the experts compute SiLU-and-mul only ('silu')"),
}


class MoEModelMixin:
    """The MoE side of a Llama-style causal LM: sparse blocks, expert weight names, packing the experts.

    Subclasses implement :meth:`is_moe_layer` and :meth:`build_moe_block`.
    """

    config: Any

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has the sparse block (else the dense SwiGLU)."""
        raise NotImplementedError

    def build_moe_block(self, prefix: str, dtype: str, quant_config: QuantizationConfig | None) -> nn.Layer:
        """The sparse block of a MoE layer, named ``prefix`` in the checkpoint."""
        raise NotImplementedError

    def build_mlp(self, layer_idx: int, prefix: str, dtype: str,
                  quant_config: QuantizationConfig | None) -> nn.Layer | None:
        return self.build_moe_block(prefix, dtype, quant_config) if self.is_moe_layer(layer_idx) else None

    def shared_mlp(self, intermediate_size: int, bias: bool, dtype: str, quant_config: QuantizationConfig | None,
                   prefix: str) -> LlamaMLP:
        """A shared expert: the dense SwiGLU of ``intermediate_size``."""
        return LlamaMLP(self.config.hidden_size, intermediate_size, bias, dtype, quant_config, prefix)

    def _resolve(self, name: str) -> tuple[str, object] | None:
        return expert_params_mapping(name) or super()._resolve(name)

    def process_weights_after_loading(self, dtype: str) -> None:
        """Pack the experts (when the platform runs the MoE kernel) and then every matmul weight.

        Raises:
            RuntimeError: ``dtype`` is bfloat16 but the experts cannot compute in it (no kernel).
        """
        pack_experts(self, dtype)
        super().process_weights_after_loading(dtype)
        fuse_shared_experts(self)


def shared_experts_for(shared: nn.Layer | None, experts: FusedMoE) -> ops.SharedExperts | None:
    """``shared`` (a dense SwiGLU, its matmuls packed) as ``experts``' op takes them, where its method runs their
    weights' format (the quantized MoE ops, int and GGUF: in a decode step one thread can compute them while
    the others stream routed experts); else None. Under tensor parallelism they stay apart (their all-reduce)."""
    if not isinstance(shared, LlamaMLP) or shared.down_proj.tp_size > 1:
        return None
    gate_up, down = (m.quant_method.kernel_weight(m) for m in (shared.gate_up_proj, shared.down_proj))
    if (gate_up is None or down is None or gate_up.bias is not None or down.bias is not None
            or (gate_up.dtype, gate_up.gguf_isa) != (down.dtype, down.gguf_isa)
            or not experts.quant_method.runs_shared_experts(gate_up.dtype)):
        return None
    return ops.SharedExperts(gate_up.weight, down.weight, shared.down_proj.input_size, gate_up.dtype,
                             list(gate_up.segments), list(down.segments), gate_up.gguf_isa)


def fuse_shared_experts(model: nn.Layer) -> None:
    """``fuse_shared_experts()`` on every MoE block of ``model`` that has shared experts (its matmuls packed);
    logs how many."""
    blocks = [m for m in model.sublayers() if getattr(m, "has_shared_experts", False)]
    fused = sum(block.fuse_shared_experts() for block in blocks)
    if blocks:
        logger.info("MoE shared experts: %d of %d blocks run inside the routed experts' op", fused, len(blocks))


def pack_experts(model: nn.Layer, dtype: str) -> None:
    """Pack every FusedMoE layer of ``model`` for the MoE kernel in ``dtype`` (where the platform runs it).

    Raises:
        RuntimeError: ``dtype`` is bfloat16 but the experts cannot compute in it (no kernel).
    """
    packed = [m.process_weights_after_loading(dtype) for m in model.sublayers() if isinstance(m, FusedMoE)]
    if dtype == "bfloat16" and not all(packed):
        raise RuntimeError("bfloat16 MoE experts need the C++ fused MoE kernel (csrc/cpu/moe.cc), which is not "
                           "available; use --dtype float32.")
