"""Sliding-window attention in a config, which the native model classes do not implement.

Qwen2 / Qwen3(-MoE) configs can give some or all layers a window (transformers' ``layer_types``,
or ``use_sliding_window``). The native classes attend to the whole context, which is the same
computation while ``max_model_len`` fits in the window; past it they would silently differ, so such
a config is refused at start-up (PaddleFormers' layers window their attention and pass).
"""

from __future__ import annotations

from typing import Any


def sliding_window_layers(hf_config: Any) -> list[int]:
    """The layers a config gives sliding-window attention: its ``layer_types`` (transformers 5), else every layer
    where ``use_sliding_window`` is set."""
    if not getattr(hf_config, "sliding_window", None):
        return []
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types[:n]) if t == "sliding_attention"]
    # Qwen3-MoE has no layer_types and windows every layer (transformers does not read its max_window_layers).
    return list(range(n)) if getattr(hf_config, "use_sliding_window", False) else []


def check_sliding_window(model_config: Any) -> None:
    """Refuse, by name, sliding-window layers whose window a request could outgrow on a native model class.

    Raises:
        ValueError: naming ``sliding_window``, the layers and the ``--max-model-len`` that would fit.
    """
    from fastdeploy.model_executor.models.registry import serves_natively

    layers = sliding_window_layers(model_config.hf_config)
    window = getattr(model_config.hf_config, "sliding_window", None)
    if not layers or model_config.max_model_len <= window or not serves_natively(model_config):
        return
    raise ValueError(
        f"{model_config.architectures[0]} has sliding-window attention (sliding_window={window} on {len(layers)} "
        f"of {model_config.hf_config.num_hidden_layers} layers), which FastDeploy's native model classes do not "
        f"implement; max_model_len={model_config.max_model_len} would let a request outgrow the window. Supported: "
        f"--max-model-len {window} or less (every key inside the window), or --model-impl paddleformers.")
