"""Structured outputs (guided decoding) with xgrammar.

- :func:`validate_structured_outputs` checks a request's constraint in the front end
  (a bad schema, regex or grammar is a ``ValueError`` before the engine sees it).
- :class:`StructuredOutputManager` compiles grammars off the engine loop, caches
  them by constraint key and builds each step's batch bitmask.
- :func:`structured_outputs_from_openai` turns OpenAI ``response_format`` and vLLM's
  ``structured_outputs`` / legacy ``guided_*`` request fields into
  :class:`~fastdeploy.sampling_params.StructuredOutputsParams`.
"""

from __future__ import annotations

from fastdeploy.config import StructuredOutputsConfig
from fastdeploy.model_executor.guided_decoding.manager import StructuredOutputManager
from fastdeploy.model_executor.guided_decoding.openai_params import (
    structured_outputs_from_openai,
    structured_outputs_from_request,
)
from fastdeploy.model_executor.guided_decoding.request import (
    StructuredOutputKey,
    StructuredOutputOptions,
    StructuredOutputRequest,
    get_structured_output_key,
)
from fastdeploy.sampling_params import StructuredOutputsParams

__all__ = [
    "StructuredOutputKey",
    "StructuredOutputManager",
    "StructuredOutputOptions",
    "StructuredOutputRequest",
    "get_structured_output_key",
    "structured_outputs_from_openai",
    "structured_outputs_from_request",
    "validate_structured_outputs",
]


def validate_structured_outputs(params: StructuredOutputsParams, config: StructuredOutputsConfig | None = None) -> None:
    """Check the constraint against the engine's backend and record that backend on ``params``.

    Raises:
        ValueError: the constraint is invalid or not supported (the HTTP server answers 400).
    """
    from fastdeploy.model_executor.guided_decoding.backend_xgrammar import validate_xgrammar_grammar

    config = config or StructuredOutputsConfig()
    validate_xgrammar_grammar(params)
    params._backend = config.resolved_backend
    params._backend_was_auto = config.backend == "auto"
