"""The PaddleFormers backend (``model_impl="paddleformers"``): PaddleFormers' model classes
run inside FastDeploy's engine with its paged attention, layers and weight loaders.

Importing this package does not import paddleformers; that happens when a model is built
or support is queried.
"""

from fastdeploy.model_executor.models.paddleformers.compat import (
    PaddleFormersUnavailableError,
    find_model_class,
    paddleformers_version,
    supported_architectures,
    unsupported_reasons,
)

__all__ = [
    "PaddleFormersForCausalLM",
    "PaddleFormersUnavailableError",
    "find_model_class",
    "paddleformers_version",
    "supported_architectures",
    "unsupported_reasons",
]


def __getattr__(name: str):
    # The model class pulls in paddle layers: import it on first use only.
    if name == "PaddleFormersForCausalLM":
        from fastdeploy.model_executor.models.paddleformers.model import PaddleFormersForCausalLM

        return PaddleFormersForCausalLM
    raise AttributeError(name)
