"""Import PaddleFormers safely and find its model class for an architecture.

Three things about paddleformers 1.2.0 are handled here so that callers never see them:

- ``import paddleformers`` imports ``transformers`` with ``torch`` hidden, which leaves
  transformers believing torch is absent for the rest of the process (its PyTorch
  models stop working). Importing transformers first keeps its own view of torch.
- The Qwen2 / Qwen3 modeling modules import ``paddlefleet`` (Baidu's GPU training
  stack, not installable here) at import time, only to define a Fleet "model provider"
  used by their Fleet classes. A placeholder for that one module lets them import; the
  backend then builds their plain-Paddle classes (``*Deprecated``), which is what
  PaddleFormers' own auto loader falls back to.
- Baidu's ERNIE 4.5 checkpoints name the architecture ``Ernie4_5_ForCausalLM``.

PaddleFormers classes known not to run correctly through the backend are refused with
the reason (:data:`KNOWN_UNSUPPORTED`); classes not validated here are built with a warning.
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any

from fastdeploy.logger import init_logger

logger = init_logger(__name__)

REQUIRED_VERSION = "1.2.0"
_PROVIDER_MODULE = "paddleformers.transformers.gpt_provider"
# Checkpoint architecture names that PaddleFormers spells differently.
_ALIASES = {
    "Ernie4_5_ForCausalLM": "Ernie4_5ForCausalLM",
}
# Checked here against transformers, token for token, through the whole engine.
VALIDATED = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM", "Ernie4_5_ForCausalLM",
     "Phi3ForCausalLM", "Qwen2MoeForCausalLM"}
)  # fmt: skip
# PaddleFormers 1.2.0 classes that build here but cannot run correctly through the backend.
# They are refused (with the reason) rather than served with wrong outputs.
KNOWN_UNSUPPORTED = {
    "Gemma3ForCausalLM": (
        "PaddleFormers' Gemma 3 attention falls back to its own sdpa whenever no mask is passed, bypassing "
        "the paged KV cache, and applies the global RoPE base to its sliding-window layers"
    ),
    "GptOssForCausalLM": "its attention sinks have no counterpart in FastDeploy's paged attention",
    "Ernie4_5_MoeForCausalLM": (
        "PaddleFormers' ERNIE 4.5 MoE layer calls expand_modality_expert_id, a Paddle kernel built for GPUs only "
        "(not registered on CPU); the native Ernie4_5_MoeForCausalLM runs it"
    ),
    "Qwen3MoeForCausalLM": (
        "PaddleFormers' Qwen3-MoE module imports paddlefleet_ops (DeepEP's GPU all-to-all), which cannot be "
        "installed here; the native Qwen3MoeForCausalLM runs it"
    ),
}

# Config values a PaddleFormers 1.2.0 class ignores (it would compute another model): field -> (fine?, why).
CONFIG_REFUSALS: dict[str, dict[str, tuple[Any, str]]] = {
    "Qwen2MoeForCausalLM": {
        "decoder_sparse_step": (lambda v: v in (None, 1), "PaddleFormers' Qwen2-MoE makes every layer sparse"),
        "mlp_only_layers": (lambda v: not v, "PaddleFormers' Qwen2-MoE makes every layer sparse"),
    },
}


def check_config(arch: str, hf_config: Any) -> None:
    """Refuse a config whose values PaddleFormers' class of ``arch`` would silently ignore.

    Raises:
        ValueError: naming the field, its value and why; model_impl='fastdeploy' runs it.
    """
    for field, (ok, why) in CONFIG_REFUSALS.get(arch, {}).items():
        value = getattr(hf_config, field, None)
        if not ok(value):
            raise ValueError(f"model_impl='paddleformers' cannot run {arch} with {field}={value!r}: {why}; "
                             "use model_impl='fastdeploy' (or 'auto').")


class PaddleFormersUnavailableError(ImportError):
    """paddleformers is not installed (or cannot be imported)."""


def _install_provider_placeholder() -> None:
    """Let modeling modules that only *define* a paddlefleet provider import without paddlefleet."""
    from paddleformers.utils.import_utils import is_paddlefleet_available

    if is_paddlefleet_available() or _PROVIDER_MODULE in sys.modules:
        return

    class GPTModelProvider:
        """Stands in for paddlefleet's provider; the Fleet classes that use it are never built here."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError("This PaddleFormers model class needs paddlefleet, which is not installed.")

    placeholder = types.ModuleType(_PROVIDER_MODULE)
    placeholder.GPTModelProvider = GPTModelProvider
    placeholder.__doc__ = "FastDeploy placeholder: paddlefleet is not installed."
    sys.modules[_PROVIDER_MODULE] = placeholder


@functools.cache
def import_paddleformers() -> types.ModuleType:
    """The ``paddleformers`` package, imported so that it leaves transformers and torch working.

    Raises:
        PaddleFormersUnavailableError: the package is missing or fails to import.
    """
    import transformers  # noqa: F401  - before paddleformers, see the module docstring

    try:
        import paddleformers
    except Exception as e:  # noqa: BLE001 - any import failure means the backend is unavailable
        raise PaddleFormersUnavailableError(
            f"model_impl='paddleformers' needs the paddleformers package "
            f"(pip install paddleformers=={REQUIRED_VERSION}): {e}"
        ) from e
    _install_provider_placeholder()
    version = getattr(paddleformers, "__version__", "unknown")
    if version != REQUIRED_VERSION:
        logger.warning("paddleformers %s is installed; the backend is tested with %s.", version, REQUIRED_VERSION)
    return paddleformers


def paddleformers_version() -> str:
    """Installed paddleformers version, or "not installed"."""
    try:
        return import_paddleformers().__version__
    except PaddleFormersUnavailableError:
        return "not installed"


def _module_for(arch: str) -> str | None:
    """PaddleFormers' modeling package of ``arch``, by its longest matching name prefix (as its auto loader does)."""
    from paddleformers.transformers.auto.modeling import MAPPING_NAMES

    for flag in sorted(MAPPING_NAMES, key=len, reverse=True):
        if arch.startswith(flag):
            return MAPPING_NAMES[flag]
    return None


# Why find_model_class found no class for an architecture whose module PaddleFormers ships (for the refusal).
_UNAVAILABLE: dict[str, str] = {}


@functools.cache
def find_model_class(arch: str) -> type | None:
    """The plain-Paddle PaddleFormers causal-LM class of ``arch``, or None when PaddleFormers has none here.

    Only text generation (``*ForCausalLM``) classes qualify; a class that needs
    paddlefleet is replaced by its ``*Deprecated`` plain-Paddle twin when there is one.
    """
    try:
        import_paddleformers()
    except PaddleFormersUnavailableError:
        return None
    name = _ALIASES.get(arch, arch)
    if not name.endswith("ForCausalLM") or arch in KNOWN_UNSUPPORTED:
        return None
    package = _module_for(name)
    if package is None:
        return None
    try:
        module = importlib.import_module(f"paddleformers.transformers.{package}.modeling")
    except Exception as e:  # noqa: BLE001 - e.g. modules that need paddlefleet's compiled ops
        logger.debug("PaddleFormers cannot import %s here: %s", package, e)
        _UNAVAILABLE[arch] = f"PaddleFormers' {package} module does not import here ({type(e).__name__}: {e})"
        return None
    cls = getattr(module, name, None)
    if cls is None or _needs_fleet(cls):
        cls = getattr(module, name + "Deprecated", None)
    if cls is None or _needs_fleet(cls):
        _UNAVAILABLE[arch] = f"PaddleFormers' {name} builds paddlefleet's GPU model only"
        return None
    if arch not in VALIDATED:
        logger.warning("PaddleFormers' %s has not been validated with the FastDeploy backend.", arch)
    return cls


def _needs_fleet(cls: type) -> bool:
    """Fleet classes build a paddlefleet GPT model in ``__new__`` instead of the PaddleFormers layers."""
    return bool(getattr(cls, "is_fleet", False)) or "__new__" in vars(cls)


def unsupported_reasons(architectures: list[str]) -> str:
    """Why PaddleFormers' classes for any of ``architectures`` are refused or unavailable ("" when none is known)."""
    reasons = {**_UNAVAILABLE, **KNOWN_UNSUPPORTED}
    return "".join(f" {a}: {reasons[a]}." for a in architectures if a in reasons)


@functools.cache
def supported_architectures() -> tuple[str, ...]:
    """Every ``*ForCausalLM`` architecture PaddleFormers can build in this environment."""
    try:
        import_paddleformers()
    except PaddleFormersUnavailableError:
        return ()
    from paddleformers.transformers.auto.modeling import MAPPING_NAMES

    candidates = {f"{flag}ForCausalLM" for flag in MAPPING_NAMES} | set(_ALIASES)
    return tuple(sorted(arch for arch in candidates if find_model_class(arch) is not None))
