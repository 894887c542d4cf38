"""Harness set-up (not vLLM's): the `vllm` stand-in on sys.path, and the tests outside this comparison.

Skipped, with the reason in the report:
- LoRA: FastDeploy has no LoRA adapters (it refuses --lora-modules by name); the harness drops
  the LoRA flags and skips the tests that ask for an adapter.
- multimodal / embeddings (run_batch with an embedding model): text-only generation here.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "shim"))
# FastDeploy's own test server (remote_server.RemoteOpenAIServer), which the stand-in extends.
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "entrypoints", "openai"))

# No network: the LoRA fixtures' downloads return a placeholder folder (the flags are dropped anyway).
import huggingface_hub  # noqa: E402
import vllm  # noqa: E402,F401 - installs the stand-in before any test module imports vllm.*

_LORA_PLACEHOLDER = "/nonexistent/lora-adapter"
huggingface_hub.snapshot_download = lambda *args, **kwargs: _LORA_PLACEHOLDER


def _uses_lora(item: pytest.Item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(isinstance(v, str) and "lora" in v for v in params.values()):
        return True
    func = getattr(item, "function", None)
    if func is None:
        return False
    code = func.__code__
    own_args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return any("lora" in arg for arg in own_args)


def pytest_collection_modifyitems(config, items):
    lora = pytest.mark.skip(reason="LoRA: not built in FastDeploy (--lora-modules is refused), flags dropped")
    mm = pytest.mark.skip(reason="multimodal: out of scope (text-only model)")
    emb = pytest.mark.skip(reason="embeddings / run_batch: out of scope")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if _uses_lora(item):
            item.add_marker(lora)
        elif params.get("model_key") == "multimodal":
            item.add_marker(mm)
        elif item.name == "test_metrics_exist_run_batch":
            item.add_marker(emb)


# Tests that load "their" model's tokenizer straight from the Hub (test_metrics.py) get the
# tokenizer of the model the server really runs: no network here, and the token counts must match.
import transformers  # noqa: E402
from vllm._model import tokenizer  # noqa: E402

_from_pretrained = transformers.AutoTokenizer.from_pretrained.__func__


def _mapped_from_pretrained(cls, name, *args, **kwargs):
    if isinstance(name, str) and not os.path.exists(name):
        return tokenizer()
    return _from_pretrained(cls, name, *args, **kwargs)


transformers.AutoTokenizer.from_pretrained = classmethod(_mapped_from_pretrained)
