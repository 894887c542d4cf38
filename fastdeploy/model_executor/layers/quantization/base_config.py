"""vLLM's quantization interfaces: a ``QuantizationConfig`` per format hands each layer its method."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import paddle
from paddle import nn


class QuantizeMethodBase(ABC):
    """How one layer keeps and applies its weights (vLLM's ``QuantizeMethodBase``).

    ``create_weights`` registers the parameters the checkpoint is loaded into,
    ``process_weights_after_loading`` converts them once for the kernel that ``apply`` runs.
    """

    @abstractmethod
    def create_weights(self, layer: nn.Layer, *args: Any, **kwargs: Any) -> None:
        """Register the layer's parameters (as the checkpoint stores them)."""

    @abstractmethod
    def apply(self, layer: nn.Layer, *args: Any, **kwargs: Any) -> paddle.Tensor:
        """The layer's forward on its processed weights."""

    def process_weights_after_loading(self, layer: nn.Layer, dtype: str) -> bool:
        """Convert the loaded weights once for the compute ``dtype``; False when they stay as loaded."""
        return False


class QuantizationConfig(ABC):
    """One quantization format: what it reads from a checkpoint and which method each layer gets."""

    # Whether get_quant_method gives MoE experts (FusedMoE layers) a method of the format's own; a
    # FusedMoE layer refuses, at construction, a config that gives it none (never silently unquantized).
    supports_moe: bool = False

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The ``--quantization`` name of the format."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        """Build from a checkpoint's ``quantization_config``."""

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        """Files beside the weights that hold the format's settings where config.json has no
        ``quantization_config`` (vLLM's name; e.g. AutoGPTQ's ``quantize_config.json``); none by default."""
        return []

    @classmethod
    def check_tensor_parallel(cls, tensor_parallel_size: int) -> None:
        """Refuse, at start-up, a tensor-parallel size the format's weights cannot split into; any by default."""
        del tensor_parallel_size

    @classmethod
    def check_model(cls, model_config: Any) -> None:
        """Refuse, at start-up, a model this format cannot serve (a ValueError naming why); nothing by default."""
        del model_config

    @abstractmethod
    def get_quant_method(self, layer: nn.Layer, prefix: str) -> QuantizeMethodBase | None:
        """The method for ``layer`` (named ``prefix`` in the checkpoint); None keeps it unquantized."""
