"""The served model names and GET /v1/models."""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission


@dataclass
class BaseModelPath:
    """A name the model is served under, and where it was loaded from."""

    name: str
    model_path: str


class OpenAIServingModels:
    """Names the server answers to (--served-model-name, else --model); the first is reported in responses."""

    def __init__(self, base_model_paths: list[BaseModelPath], max_model_len: int) -> None:
        self.base_model_paths = base_model_paths
        self.max_model_len = max_model_len

    @property
    def model_name(self) -> str:
        return self.base_model_paths[0].name

    def is_base_model(self, model_name: str | None) -> bool:
        """Whether ``model_name`` is served here; a missing name selects the first one."""
        return not model_name or any(m.name == model_name for m in self.base_model_paths)

    def show_available_models(self) -> ModelList:
        return ModelList(
            data=[
                ModelCard(id=m.name, root=m.model_path, max_model_len=self.max_model_len,
                          permission=[ModelPermission()])
                for m in self.base_model_paths
            ]
        )
