"""ModelConfig(model=...).get_vocab_size(): the vocabulary of the model the server really runs."""

from vllm import VllmInternal
from vllm._model import hidden_size, vocab_size


class ModelConfig:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def get_vocab_size(self) -> int:
        return vocab_size()

    def get_hidden_size(self) -> int:
        return hidden_size()


def __getattr__(item: str):
    if item.startswith("__"):
        raise AttributeError(item)
    return VllmInternal(f"vllm.config.{item}")
