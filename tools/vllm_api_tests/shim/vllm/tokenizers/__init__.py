"""get_tokenizer: the tokenizer of the model the server really runs (the name asked for is mapped)."""

from vllm._model import tokenizer


def get_tokenizer(tokenizer_name=None, *args, **kwargs):
    return tokenizer()
