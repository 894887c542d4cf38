"""Quantization formats, by ``--quantization`` name (vLLM's ``QUANTIZATION_METHODS`` registry).

Without ``--quantization`` every layer runs :class:`~fastdeploy.model_executor.layers.linear.UnquantizedLinearMethod`;
the platform refuses a ``--quantization`` it does not list (``Platform.supported_quantization``).
A format registers its :class:`QuantizationConfig` with :func:`register_quantization_config`.
Built: ``gguf`` (:mod:`.gguf`, GGUF files served in their own blocks), ``wint8`` / ``wint4``
(:mod:`.weight_only`, W8A16 / W4A16 quantized at load), ``w8a8`` (:mod:`.w8a8`), ``awq`` /
``gptq`` (:mod:`.awq_gptq`, 4-bit checkpoints, chosen by their ``quantization_config``).
The registry is the one list of methods: the CPU platform supports what is registered here.
"""

from __future__ import annotations

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
)
_builtins_loaded = False


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


def checkpoint_quant_config(hf_config: Any) -> dict[str, Any]:
    """The checkpoint's ``quantization_config`` as a dict (empty without one)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return {}
    return dict(qc) if isinstance(qc, dict) else dict(getattr(qc, "to_dict", lambda: vars(qc))())


def resolve_quantization(hf_config: Any, requested: str | None) -> str | None:
    """vLLM's rule: a checkpoint's ``quantization_config.quant_method`` is its method unless ``--quantization`` says it.

    GGUF files are left to their own default (their config's method is not a checkpoint format here).

    Raises:
        ValueError: the checkpoint names a method that is not registered (listing those that are), or
            ``requested`` disagrees with it.
    """
    method = checkpoint_quant_config(hf_config).get("quant_method")
    if not method or str(method).lower() == "gguf":
        return requested
    method = str(method).lower()
    if method not in get_quantization_methods():
        raise ValueError(f"The checkpoint's quantization_config names quant_method={method!r}, which is not "
                         f"supported; supported: {get_quantization_methods()}.")
    if requested is not None and requested != method:
        raise ValueError(f"Quantization method specified in the model config ({method}) does not match the "
                         f"quantization method specified in the `quantization` argument ({requested}).")
    return method


__all__ = [
    "checkpoint_quant_config",
    "resolve_quantization",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "get_quantization_config",
    "get_quantization_methods",
    "register_quantization_config",
]
