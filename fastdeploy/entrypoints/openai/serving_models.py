"""The served model names and GET /v1/models."""

from __future__ import annotations

from dataclasses import dataclass

from fastdeploy.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission


@dataclass
class BaseModelPath:
    """A name the model is served under, and where it was loaded from."""

    name: str
    # What the user passed as the model (a name or a path), reported as the card's ``root``, as in vLLM.
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

    def _card(self, model: BaseModelPath) -> ModelCard:
        return ModelCard(id=model.name, root=model.model_path, max_model_len=self.max_model_len,
                         permission=[ModelPermission()])

    def show_available_models(self) -> ModelList:
        """GET /v1/models: one card per served name."""
        return ModelList(data=[self._card(m) for m in self.base_model_paths])

    def model_card(self, model_name: str) -> ModelCard | None:
        """GET /v1/models/{model}: the card of a served name, None when it is not served."""
        return next((self._card(m) for m in self.base_model_paths if m.name == model_name), None)
