"""The one model every test runs on: FastDeploy's default model, whatever name the test uses."""

import functools
import os

FD_MODEL = os.environ.get("VLLM_TESTS_FD_MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct")


@functools.cache
def model_config():
    """FastDeploy's view of the served model (the embedded default is a GGUF file)."""
    from fastdeploy.config import ModelConfig

    return ModelConfig(model=FD_MODEL)


@functools.cache
def tokenizer():
    """The tokenizer the server uses (a Hugging Face tokenizer, read from the GGUF metadata)."""
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer_for_model

    return get_tokenizer_for_model(model_config())


def vocab_size() -> int:
    return model_config().vocab_size


def hidden_size() -> int:
    return model_config().hf_config.hidden_size
