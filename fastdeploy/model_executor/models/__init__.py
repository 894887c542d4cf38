"""Model implementations and the architecture registry."""

from fastdeploy.model_executor.models.registry import ModelRegistry, get_supported_archs

__all__ = ["ModelRegistry", "get_supported_archs"]
