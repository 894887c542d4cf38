"""Build the model for a config and fill its weights: ``get_model(model_config, load_config)``."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import paddle
from paddle import nn

from fastdeploy.logger import init_logger
from fastdeploy.model_executor.custom_op import get_op_backend, set_op_backend
from fastdeploy.model_executor.model_loader.weight_utils import (
    gguf_dense_modules,
    gguf_weights_iterator,
    pt_files,
    pt_weights_iterator,
    safetensors_files,
    safetensors_weights_iterator,
)
from fastdeploy.model_executor.models.registry import ModelRegistry
from fastdeploy.model_executor.utils import deferred_parameters, load_into
from fastdeploy.platforms import current_platform

logger = init_logger(__name__)

DUMMY_SEED = 0
DUMMY_STD = 0.02


def _detect_format(model_config: Any, load_format: str) -> str:
    if load_format != "auto":
        return load_format
    if model_config.gguf_file:
        return "gguf"
    if safetensors_files(model_config.model_path):
        return "safetensors"
    if pt_files(model_config.model_path):
        return "pt"
    raise ValueError(f"No weights found in {model_config.model_path} (no *.safetensors, *.bin or GGUF file).")


def get_weights_iterator(model_config: Any, load_format: str = "auto") -> Iterator[tuple[str, np.ndarray]]:
    """``(HF name, array)`` for every tensor of the configured checkpoint."""
    fmt = _detect_format(model_config, load_format)
    folder = model_config.model_path
    if fmt == "gguf":
        if not model_config.gguf_file:
            raise ValueError(f"load_format='gguf' but the model {folder} is not a GGUF file.")
        keep_blocks = getattr(model_config, "quantization", None) == "gguf"
        return gguf_weights_iterator(os.path.join(folder, model_config.gguf_file), model_config.hf_config, keep_blocks)
    if fmt == "safetensors":
        files = safetensors_files(folder)
        if not files:
            raise ValueError(f"load_format='safetensors' but {folder} has no *.safetensors files.")
        from fastdeploy.distributed.parallel_state import get_tensor_model_parallel_world_size

        # Under tensor parallelism each rank widens only its slice of a bf16 tensor.
        return safetensors_weights_iterator(files, lazy_bf16=get_tensor_model_parallel_world_size() > 1)
    if fmt == "pt":
        files = pt_files(folder)
        if not files:
            raise ValueError(f"load_format='pt' but {folder} has no *.bin / *.pt files.")
        return pt_weights_iterator(files)
    raise ValueError(f"Unknown load_format {fmt!r}.")


def initialize_dummy_weights(model: nn.Layer, seed: int = DUMMY_SEED, std: float = DUMMY_STD,
                             pack_dtype: str | None = None) -> None:
    """Deterministic random weights: N(0, std) matrices, ones for norms, zeros for biases.

    Layer by layer, in ``named_parameters`` order (so the values do not depend on ``pack_dtype``).
    With ``pack_dtype`` each linear layer is packed for that compute dtype as soon as its
    weights are set, which frees its fp32 weight before the next layer's is made: with
    parameters made under :func:`deferred_parameters`, only one layer's fp32 weights exist at a time.

    Raises:
        ValueError: a parameter was left without a value (made without storage, never set).
    """
    from fastdeploy.model_executor.layers.linear import LinearBase

    rng = np.random.default_rng(seed)
    tie = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    tied_head = getattr(model, "lm_head", None) if tie else None
    seen: set[int] = set()
    for prefix, layer in model.named_sublayers(include_self=True):
        for leaf, param in layer.named_parameters(include_sublayers=False):
            name = f"{prefix}.{leaf}" if prefix else leaf
            if id(param) in seen or (tie and name == "lm_head.weight"):
                continue
            seen.add(id(param))
            shape = list(param.shape)
            if "norm" in name:
                value = np.ones(shape, dtype=np.float32)
            elif name.endswith(".bias"):
                value = np.zeros(shape, dtype=np.float32)
            else:
                value = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
            load_into(param, value, name)
            del value
        if pack_dtype is not None and isinstance(layer, LinearBase) and layer is not tied_head:
            layer.process_weights_after_loading(pack_dtype)
    if tie and hasattr(model, "lm_head"):
        model.lm_head.tie_weights(model.model.embed_tokens)
    unset = [name for name, param in model.named_parameters() if not param._is_initialized()]
    if unset:
        raise ValueError(f"Dummy weights left {len(unset)} parameters without a value, e.g. {unset[:5]}.")


def quantization_kwargs(model_config: Any, model_cls: type, load_format: str) -> dict[str, Any]:
    """``{"quant_config": ...}`` for ``--quantization``, or nothing without it.

    Raises:
        ValueError: the model class or the load format cannot take the quantization.
    """
    from fastdeploy.model_executor.layers.quantization import (
        NO_QUANTIZATION,
        get_quantization_config,
        quantization_config_for,
    )

    name = getattr(model_config, "quantization", None)
    if name in (None, NO_QUANTIZATION):
        return {}

    if "quant_config" not in inspect.signature(model_cls.__init__).parameters:
        raise ValueError(f"quantization={name!r} is not built for {model_cls.__name__}; "
                         "use model_impl='fastdeploy' (the native model classes).")
    if load_format == "dummy":
        raise ValueError(f"quantization={name!r} loads its weights from the checkpoint; load_format='dummy' "
                         "has none to keep.")
    # The checkpoint's own settings (bits, group size...) where it has them; -q alone gives {}.
    quant_config = get_quantization_config(name).from_config(quantization_config_for(name, model_config))
    if name == "gguf" and model_config.gguf_file:
        quant_config.unquantized_modules = gguf_dense_modules(os.path.join(model_config.model_path,
                                                                           model_config.gguf_file))
    logger.info("Quantization: %s.", quant_config)
    return {"quant_config": quant_config}


def get_model(model_config: Any, load_config: Any = None) -> nn.Layer:
    """Instantiate the model class of ``model_config.architectures`` and load its weights.

    Args:
        model_config: a :class:`fastdeploy.config.ModelConfig` (uses ``hf_config``, ``model_path``,
            ``gguf_file``, ``dtype``, ``model_impl``).
        load_config: a :class:`fastdeploy.config.LoadConfig`; ``load_format`` is one of "auto",
            "safetensors", "gguf", "pt", "dummy".

    The class follows ``model_config.model_impl`` (:meth:`ModelRegistry.resolve`): a native
    class, or :class:`~fastdeploy.model_executor.models.paddleformers.PaddleFormersForCausalLM`,
    which takes the same constructor arguments and the same weight iterators.

    Raises:
        ValueError: unsupported architecture (the message lists the supported ones), no weights,
            or weights that do not fit the model.
    """
    hf_config = model_config.hf_config
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_cls = ModelRegistry.resolve(architectures, getattr(model_config, "model_impl", "auto"))
    dtype = model_config.dtype if model_config.dtype not in (None, "auto") else "float32"
    load_format = getattr(load_config, "load_format", "auto") if load_config is not None else "auto"
    start = time.perf_counter()
    backend = get_op_backend()
    logger.info("Kernel paths: %s.", backend.describe(dtype))
    with paddle.no_grad(), set_op_backend(backend):
        quant_kwargs = quantization_kwargs(model_config, model_cls, load_format)
        # Parameters live in the platform's storage dtype (fp32 on CPU); models that can,
        # convert their weights for the compute dtype once loaded (packed bf16 matmul weights).
        if load_format == "dummy":
            # No storage until each layer's values are set, then packed one layer at a time where the
            # model allows it: peak memory is the packed model plus one layer's fp32 weights.
            with deferred_parameters():
                model = model_cls(hf_config, dtype=current_platform.param_dtype(dtype), **quant_kwargs)
            model.eval()
            pack = dtype if getattr(model, "packs_dummy_weights_per_layer", False) else None
            initialize_dummy_weights(model, pack_dtype=pack)
        else:
            model = model_cls(hf_config, dtype=current_platform.param_dtype(dtype), **quant_kwargs)
            model.eval()
            model.load_weights(get_weights_iterator(model_config, load_format))
        if hasattr(model, "process_weights_after_loading"):
            model.process_weights_after_loading(dtype)
    logger.info(
        "Loaded %s (%s, %s weights) in %.1f s.", model_cls.__name__, dtype, load_format, time.perf_counter() - start
    )
    return model
