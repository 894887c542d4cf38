"""Architecture name (``config.architectures``) -> model class, imported lazily."""

from __future__ import annotations

import importlib

from paddle import nn

# architecture -> (module under fastdeploy.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    # The name Baidu's own ERNIE 4.5 checkpoints put in config.json.
    "Ernie4_5_ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
}


class ModelRegistry:
    """Which model class serves which architecture; plugins may register more."""

    _models: dict[str, tuple[str, str] | type[nn.Layer]] = dict(_MODELS)

    @classmethod
    def register_model(cls, architecture: str, model_cls: type[nn.Layer] | str) -> None:
        """Register a class, or a ``"package.module:ClassName"`` path imported on first use."""
        if isinstance(model_cls, str):
            module, _, name = model_cls.partition(":")
            if not name:
                raise ValueError(f"Expected 'package.module:ClassName', got {model_cls!r}.")
            cls._models[architecture] = (module, name)
        else:
            cls._models[architecture] = model_cls

    @classmethod
    def get_supported_archs(cls) -> list[str]:
        """Every registered architecture name."""
        return sorted(cls._models)

    @classmethod
    def _load(cls, architecture: str) -> type[nn.Layer]:
        entry = cls._models[architecture]
        if not isinstance(entry, tuple):
            return entry
        module, name = entry
        if "." not in module:
            module = f"fastdeploy.model_executor.models.{module}"
        return getattr(importlib.import_module(module), name)

    @classmethod
    def resolve_model_cls(cls, architectures: list[str] | str | None) -> type[nn.Layer]:
        """The class of the first supported architecture in ``architectures``.

        Raises:
            ValueError: none is supported (the message lists the supported ones).
        """
        if isinstance(architectures, str):
            architectures = [architectures]
        for arch in architectures or []:
            if arch in cls._models:
                return cls._load(arch)
        raise ValueError(
            f"Model architectures {list(architectures or [])} are not supported for now. "
            f"Supported architectures: {cls.get_supported_archs()}"
        )


def get_supported_archs() -> list[str]:
    """Every registered architecture name."""
    return ModelRegistry.get_supported_archs()
