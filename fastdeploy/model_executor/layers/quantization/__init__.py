"""Quantization formats, by ``--quantization`` name (vLLM's ``QUANTIZATION_METHODS`` registry).

Without ``--quantization`` every layer runs :class:`~fastdeploy.model_executor.layers.linear.UnquantizedLinearMethod`;
the platform refuses a ``--quantization`` it does not list (``Platform.supported_quantization``).
A format registers its :class:`QuantizationConfig` with :func:`register_quantization_config`.
Built: ``gguf`` (:mod:`.gguf`, GGUF files served in their own blocks; a GGUF file's default, as in vLLM),
``wint8`` / ``wint4`` (:mod:`.weight_only`, W8A16 / W4A16 quantized at load), ``w8a8`` (:mod:`.w8a8`),
``awq`` / ``gptq`` (:mod:`.awq_gptq`, 4-bit checkpoints, chosen by their ``quantization_config``),
``fp8`` (:mod:`.fp8`, e4m3 weights: an fp8 checkpoint, or quantized at load).
MoE experts (``FusedMoE``) get a method of their own from the formats with ``supports_moe`` (``gguf``,
``wint8``, ``wint4``); a FusedMoE layer refuses any other format by name at start-up.
``none`` (:data:`NO_QUANTIZATION`) asks for no method at all: a GGUF file is then dequantized at load.
Which method a model gets is decided once at start-up (:mod:`.selection`). The registry is the one
list of methods: the CPU platform supports what is registered here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from fastdeploy.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

_QUANTIZATION_CONFIGS: dict[str, type[QuantizationConfig]] = {}
# The formats of this package, imported on first use: they import the layers, which import this package.
_BUILTIN_MODULES = (
    "fastdeploy.model_executor.layers.quantization.gguf",
    "fastdeploy.model_executor.layers.quantization.weight_only",
    "fastdeploy.model_executor.layers.quantization.w8a8",
    "fastdeploy.model_executor.layers.quantization.awq_gptq",
    "fastdeploy.model_executor.layers.quantization.fp8",
)
_builtins_loaded = False
# --quantization none: no method, whatever the checkpoint would default to (a GGUF file is dequantized at load).
NO_QUANTIZATION = "none"


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        import importlib

        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def register_quantization_config(name: str) -> Callable[[type[QuantizationConfig]], type[QuantizationConfig]]:
    """Class decorator: make ``cls`` the config of ``--quantization name``."""

    def register(cls: type[QuantizationConfig]) -> type[QuantizationConfig]:
        if name in _QUANTIZATION_CONFIGS:
            raise ValueError(f"Quantization method {name!r} is already registered.")
        _QUANTIZATION_CONFIGS[name] = cls
        return cls

    return register


def get_quantization_methods() -> list[str]:
    """The registered ``--quantization`` names."""
    _load_builtins()
    return sorted(_QUANTIZATION_CONFIGS)


def get_quantization_config(name: str) -> type[QuantizationConfig]:
    """The config class of ``name``; a ValueError naming the known ones otherwise."""
    _load_builtins()
    if name not in _QUANTIZATION_CONFIGS:
        raise ValueError(f"Invalid quantization method: {name!r}. Available: {get_quantization_methods() or 'none yet'}.")
    return _QUANTIZATION_CONFIGS[name]


def checkpoint_quantization_config(hf_config: Any) -> dict[str, Any] | None:
    """The ``quantization_config`` of a checkpoint's config.json as a dict, or None when it has none."""
    value = getattr(hf_config, "quantization_config", None)
    if value is None:
        return None
    return dict(value) if isinstance(value, dict) else dict(value.to_dict())


def quantization_config_for(name: str, model_config: Any) -> dict[str, Any]:
    """The settings ``--quantization name`` is built from: config.json's ``quantization_config``, else the first
    of the format's own files beside the weights (``get_config_filenames``, as vLLM reads older AutoGPTQ /
    AutoAWQ checkpoints), else ``{}`` (a format quantized at load)."""
    config = checkpoint_quantization_config(model_config.hf_config)
    if config:
        return config
    folder = getattr(model_config, "model_path", None)
    for filename in get_quantization_config(name).get_config_filenames():
        path = os.path.join(folder, filename) if folder else None
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return dict(json.load(f))
    return {}


def checkpoint_quant_method(hf_config: Any) -> str | None:
    """The method a checkpoint says it is quantized with: ``quant_method`` (Hugging Face / vLLM) or
    ``quantization`` (FastDeploy's own checkpoints); None for an unquantized checkpoint."""
    config = checkpoint_quantization_config(hf_config)
    if not config:
        return None
    method = config.get("quant_method") or config.get("quantization")
    # vLLM's name for llm-compressor checkpoints is "compressed-tensors"; their config.json spells it with "_".
    return str(method).lower().replace("compressed_tensors", "compressed-tensors") if method else None


__all__ = [
    "NO_QUANTIZATION",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "checkpoint_quant_method",
    "checkpoint_quantization_config",
    "get_quantization_config",
    "get_quantization_methods",
    "quantization_config_for",
    "register_quantization_config",
]
