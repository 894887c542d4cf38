"""Stand-in for the `vllm` package, for running vLLM's OpenAI-server tests against `fastdeploy serve`.

Harness code, not vLLM's: only what the tests need from outside the server is real here
(the version, the tokenizer of the model under test, the vocabulary size, a free port).
Every other `vllm.*` name the tests import (vLLM's Python classes: serving objects,
protocol models, renderers, stat loggers) exists only as a placeholder; a test that *uses*
one is skipped as "vLLM internals" -- it exercises vLLM's Python code, not the HTTP API.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

import pytest

# The real submodules of this shim; everything else under `vllm.` is a placeholder module.
_REAL = {"vllm", "vllm.version", "vllm.tokenizers", "vllm.transformers_utils", "vllm.transformers_utils.tokenizer",
         "vllm.config", "vllm.model_executor", "vllm.model_executor.model_loader",
         "vllm.model_executor.model_loader.weight_utils", "vllm.utils", "vllm.utils.network_utils",
         "vllm.v1", "vllm.v1.engine", "vllm.v1.engine.exceptions", "vllm.exceptions"}


class VllmInternal:
    """A vLLM-internal name: importing it works, using it skips the test (or the module)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _skip(self) -> None:
        pytest.skip(f"vLLM internals: uses {self._name} (vLLM's Python API, not the HTTP server)",
                    allow_module_level=True)

    def __call__(self, *args, **kwargs):
        self._skip()

    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return VllmInternal(f"{self._name}.{item}")

    def __getitem__(self, item):
        return VllmInternal(f"{self._name}[{item!r}]")

    def __mro_entries__(self, bases):
        self._skip()

    def __repr__(self) -> str:
        return f"<vLLM internal {self._name}>"


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return VllmInternal(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("vllm.") and fullname not in _REAL:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _PlaceholderModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())


def __getattr__(item: str):
    if item.startswith("__"):
        raise AttributeError(item)
    if f"vllm.{item}" in _REAL:  # `from vllm import version` before vllm.version was imported
        import importlib

        return importlib.import_module(f"vllm.{item}")
    return VllmInternal(f"vllm.{item}")
