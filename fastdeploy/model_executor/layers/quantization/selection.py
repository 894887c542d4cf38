"""Which quantization method a model is served with, decided once at start-up.

Called by :meth:`fastdeploy.platforms.interface.Platform.check_and_update_config`, before any
weight is read, so that every refusal happens at start-up and names what is wrong:

- ``--quantization/-q NAME``: NAME must be registered (:func:`get_quantization_methods`) and
  listed by the platform (``Platform.supported_quantization``); a format the platform has no
  instructions for (``Platform.unsupported_quantization``) is refused by name with the reason.
- ``--quantization none``: no method; a GGUF file is dequantized at load.
- a checkpoint whose config.json carries a ``quantization_config``: its method is taken (as
  vLLM does); an unknown one, or one that differs from ``-q``, is refused.
- a GGUF file without ``-q``: ``gguf``, its own blocks (vLLM sets ``quantization="gguf"`` for
  every GGUF file). Where the blocks cannot be served here (no block kernels built, a tensor
  type without a kernel, dummy weights, a model class without quantized layers) the file is
  dequantized at load instead, and a warning says why; with an explicit ``-q gguf`` each of
  those is an error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastdeploy.logger import init_logger
from fastdeploy.model_executor.layers.quantization import (
    NO_QUANTIZATION,
    checkpoint_quant_method,
    get_quantization_config,
    get_quantization_methods,
)

if TYPE_CHECKING:
    from fastdeploy.config import FDConfig
    from fastdeploy.platforms.interface import Platform

logger = init_logger(__name__)

GGUF = "gguf"


def supported_methods(platform: Platform) -> list[str]:
    """The ``--quantization`` names that serve on ``platform``: registered and listed by it."""
    registered = set(get_quantization_methods())
    return [name for name in platform.supported_quantization if name in registered]


def _supported_text(platform: Platform) -> str:
    names = supported_methods(platform)
    return f"{', '.join(names) or 'none yet'} (or '{NO_QUANTIZATION}' for no quantization)"


def check_method(name: str, platform: Platform) -> None:
    """Refuse a method ``platform`` cannot serve: unknown, without instructions here, or not built."""
    unsupported = platform.unsupported_quantization.get(name)
    if unsupported is not None:
        raise ValueError(f"quantization={name!r} is not supported on {platform.device_name}: {unsupported}. "
                         f"Supported: {_supported_text(platform)}.")
    if name not in get_quantization_methods():
        raise ValueError(f"Unknown quantization method: {name!r}. Supported on {platform.device_name}: "
                         f"{_supported_text(platform)}.")
    if name not in platform.supported_quantization:
        raise ValueError(f"quantization={name!r} is not supported on {platform.device_name}; "
                         f"supported: {_supported_text(platform)}.")


def _check_servable(name: str, fd_config: FDConfig, platform: Platform) -> None:
    """ValueError naming why ``name`` cannot serve this model here (the checks that need no weights)."""
    from fastdeploy.model_executor.models.registry import ModelRegistry

    model_config = fd_config.model_config
    load_format = fd_config.load_config.load_format
    if load_format == "dummy":
        raise ValueError(f"quantization={name!r} loads its weights from the checkpoint; load_format='dummy' "
                         "has none to keep.")
    native = set(ModelRegistry.get_supported_archs())
    if model_config.model_impl == "paddleformers" or not native & set(model_config.architectures):
        raise ValueError(f"quantization={name!r} is built for FastDeploy's own model classes "
                         f"({', '.join(sorted(native))}), not for {model_config.architectures} with "
                         f"model_impl={model_config.model_impl!r}.")
    reason = platform.quantization_unavailable_reason(name)
    if reason is not None:
        raise ValueError(f"quantization={name!r} cannot run here: {reason}.")
    config_cls = get_quantization_config(name)
    config_cls.check_tensor_parallel(fd_config.parallel_config.tensor_parallel_size)
    config_cls.check_model(model_config)


def select_quantization(fd_config: FDConfig, platform: Platform) -> None:
    """Set ``fd_config.model_config.quantization`` to the method the model is served with (None: none).

    Raises:
        ValueError: the method is unknown, has no instructions on this platform, differs from the
            checkpoint's, or cannot serve this model (the message names the method / tensor).
    """
    model_config = fd_config.model_config
    # A name the platform refuses is refused before any other check, with its reason (ModelConfig lowercased it).
    requested = model_config.quantization
    if requested in platform.unsupported_quantization:
        check_method(requested, platform)
    checkpoint = checkpoint_quant_method(model_config.hf_config) if not model_config.gguf_file else None
    if checkpoint is not None:
        if checkpoint not in get_quantization_methods() and checkpoint not in platform.unsupported_quantization:
            raise ValueError(f"The checkpoint's quantization_config (config.json of {model_config.model}) names "
                             f"the method {checkpoint!r}, which FastDeploy does not know. Supported on "
                             f"{platform.device_name}: {_supported_text(platform)}.")
        if requested is None:
            requested = checkpoint
        elif requested != checkpoint:
            raise ValueError(f"The checkpoint's quantization_config names the method {checkpoint!r}, which does not "
                             f"match --quantization {requested!r}; drop --quantization to use the checkpoint's.")
    if requested == NO_QUANTIZATION:
        model_config.quantization = None
        if model_config.gguf_file:
            logger.info("--quantization %s: the GGUF file %s is dequantized at load.", NO_QUANTIZATION,
                        model_config.gguf_file)
        return
    if requested is None and model_config.gguf_file and fd_config.load_config.load_format in ("auto", GGUF):
        _infer_gguf(fd_config, platform)
        return
    model_config.quantization = requested
    if requested is None:
        return
    check_method(requested, platform)
    _check_servable(requested, fd_config, platform)


def _infer_gguf(fd_config: FDConfig, platform: Platform) -> None:
    """A GGUF file without ``-q``: its own blocks where they can be served here, else dequantized, with a warning."""
    model_config = fd_config.model_config
    try:
        check_method(GGUF, platform)
        _check_servable(GGUF, fd_config, platform)
    except ValueError as e:
        model_config.quantization = None
        logger.warning("The GGUF file %s is dequantized at load (more memory than its blocks) instead of served "
                       "in its blocks: %s", model_config.gguf_file, e)
        return
    model_config.quantization = GGUF
    logger.info("The GGUF file %s is served in its own blocks (quantization='gguf', as vLLM does); "
                "--quantization %s dequantizes it at load instead.", model_config.gguf_file, NO_QUANTIZATION)
