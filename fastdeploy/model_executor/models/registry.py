"""Architecture name (``config.architectures``) -> model class, imported lazily.

``model_impl`` chooses between the native classes and the PaddleFormers backend:

- ``"fastdeploy"``: native only; an architecture without a native class fails with
  "Model architectures [...] have no native FastDeploy implementation
  (model_impl='fastdeploy'). Natively supported architectures: [...]", naming
  the native architectures and whether PaddleFormers could run it instead;
- ``"paddleformers"``: always PaddleFormers' class, even where a native one exists;
- ``"auto"`` (default): native when registered, else PaddleFormers when it has the
  architecture, else "Model architectures [...] are not supported for now. Supported
  architectures: natively (model_impl='fastdeploy'): [...]; through PaddleFormers 1.2.0
  (model_impl='paddleformers'): [...]" (with the reason when PaddleFormers has the
  architecture but the backend refuses it).
"""

from __future__ import annotations

import importlib
from typing import Any

from paddle import nn

MODEL_IMPLS = ("auto", "fastdeploy", "paddleformers")

# architecture -> (module under fastdeploy.model_executor.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    # The name Baidu's own ERNIE 4.5 checkpoints put in config.json.
    "Ernie4_5_ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "PaddleOCRVLForConditionalGeneration": ("paddleocr_vl", "PaddleOCRVLForConditionalGeneration"),
    "Ernie4_5_VLMoeForConditionalGeneration": ("ernie4_5_vl", "Ernie4_5_VLMoeForConditionalGeneration"),
}


# Architectures refused by name until what they build on exists.
_NOT_BUILT: dict[str, str] = {}


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

    @classmethod
    def resolve(cls, architectures: list[str] | str | None, model_impl: str = "auto") -> type[nn.Layer]:
        """The model class for ``architectures`` under ``model_impl`` (see the module docstring).

        Raises:
            ValueError: no implementation of the requested kind has the architecture; the
                message lists what each implementation supports.
        """
        if model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {list(MODEL_IMPLS)}, got {model_impl!r}.")
        archs = [architectures] if isinstance(architectures, str) else list(architectures or [])
        refused = next((a for a in archs if a in _NOT_BUILT and a not in cls._models), None)
        if refused is not None:
            raise NotImplementedError(f"Model architecture {refused}: {_NOT_BUILT[refused]}")
        if model_impl == "paddleformers":
            from fastdeploy.model_executor.models.paddleformers.model import pick_architecture

            pick_architecture(archs)  # raises with PaddleFormers' list when it has none of them
            return _paddleformers_model_class()
        native = next((a for a in archs if a in cls._models), None)
        if native is not None:
            return cls._load(native)
        from fastdeploy.model_executor.models import paddleformers

        pf_arch = next((a for a in archs if paddleformers.find_model_class(a) is not None), None)
        if model_impl == "auto" and pf_arch is not None:
            return _paddleformers_model_class()
        pf_supported = list(paddleformers.supported_architectures())
        pf_label = f"PaddleFormers {paddleformers.paddleformers_version()} (model_impl='paddleformers')"
        if model_impl == "fastdeploy":
            hint = (
                f" PaddleFormers implements {pf_arch}: use model_impl='auto' or 'paddleformers'."
                if pf_arch is not None
                else ""
            )
            raise ValueError(
                f"Model architectures {archs} have no native FastDeploy implementation (model_impl='fastdeploy'). "
                f"Natively supported architectures: {cls.get_supported_archs()}.{hint}"
            )
        raise ValueError(
            f"Model architectures {archs} are not supported for now.{paddleformers.unsupported_reasons(archs)} "
            "Supported architectures: "
            f"natively (model_impl='fastdeploy'): {cls.get_supported_archs()}; "
            f"through {pf_label}: {pf_supported or 'none (paddleformers is not installed)'}."
        )


def _paddleformers_model_class() -> type[nn.Layer]:
    from fastdeploy.model_executor.models.paddleformers.model import PaddleFormersForCausalLM

    return PaddleFormersForCausalLM


def get_supported_archs() -> list[str]:
    """Every registered architecture name."""
    return ModelRegistry.get_supported_archs()


def serves_natively(model_config: Any) -> bool:
    """Whether ``model_config`` is served by a native class: ``model_impl='fastdeploy'``, or "auto" on an
    architecture that has one (else "auto" serves it through PaddleFormers)."""
    if model_config.model_impl != "auto":
        return model_config.model_impl == "fastdeploy"
    try:
        ModelRegistry.resolve(model_config.architectures, "fastdeploy")
    except ValueError:
        return False
    return True
