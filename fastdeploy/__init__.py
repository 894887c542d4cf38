"""FastDeploy: LLM serving on PaddlePaddle, a drop-in replacement for vLLM.

Public names are imported lazily so that ``import fastdeploy.sampling_params``
(or the API server's front end) does not pay for importing Paddle.
"""

import importlib
import os as _os

from fastdeploy import envs as _envs
from fastdeploy import omp_runtime as _omp_runtime

# Whether the user chose the thread count; the API server then passes it to the engine
# process unchanged instead of leaving one core to the HTTP process.
USER_SET_OMP_NUM_THREADS = _envs.omp_num_threads() is not None
# Paddle forces OMP_NUM_THREADS=1 at import unless it is already set: set it before anything imports Paddle.
if not USER_SET_OMP_NUM_THREADS:
    _os.environ["OMP_NUM_THREADS"] = str(_envs.default_omp_num_threads())
# Paddle's OpenMP first in the global symbol scope, before anything imports torch (which brings its
# own libgomp): oneDNN, Paddle and the kernels then share one pool of threads (fastdeploy/omp_runtime.py).
_omp_runtime.make_paddle_openmp_global()

from fastdeploy.version import __version__  # noqa: E402

_EXPORTS = {
    "LLM": "fastdeploy.entrypoints.llm",
    "LLMEngine": "fastdeploy.engine.llm_engine",
    "EngineArgs": "fastdeploy.engine.arg_utils",
    "AsyncEngineArgs": "fastdeploy.engine.arg_utils",
    "AsyncLLMEngine": "fastdeploy.engine.async_llm",
    "SamplingParams": "fastdeploy.sampling_params",
    "BeamSearchParams": "fastdeploy.sampling_params",
    "StructuredOutputsParams": "fastdeploy.sampling_params",
    "GuidedDecodingParams": "fastdeploy.sampling_params",
    "RequestOutputKind": "fastdeploy.sampling_params",
    "RequestOutput": "fastdeploy.outputs",
    "CompletionOutput": "fastdeploy.outputs",
    "TextPrompt": "fastdeploy.inputs",
    "TokensPrompt": "fastdeploy.inputs",
    "PromptType": "fastdeploy.inputs",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastdeploy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
