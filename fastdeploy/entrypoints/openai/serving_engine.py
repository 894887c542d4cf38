"""OpenAIServing: what the completion, chat and tokenizer endpoints share.

Error envelopes, model-name checks, prompt intake, max_tokens clamping,
request ids and token spelling in logprobs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from http import HTTPStatus
from typing import Any, TypeVar

import jinja2
from fastapi import Request
from pydantic import BaseModel

from fastdeploy.engine.async_llm import AsyncLLM
from fastdeploy.engine.exceptions import EngineDeadError, EngineGenerateError
from fastdeploy.engine.processor import ProcessedPrompt
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionStreamResponse,
    CompletionStreamResponse,
    ErrorInfo,
    ErrorResponse,
    PerRequestTimingMetrics,
    PromptTokenUsageInfo,
    SamplingRequest,
    UsageInfo,
    random_uuid,
)
from fastdeploy.entrypoints.openai.serving_models import OpenAIServingModels
from fastdeploy.logger import init_logger
from fastdeploy.logprobs import Logprob
from fastdeploy.outputs import RequestOutput
from fastdeploy.sampling_params import ParamValidationError, StructuredOutputsParams

logger = init_logger(__name__)

# JSON has no -inf: logprobs below this are reported as this value (as OpenAI and vLLM do).
MIN_LOGPROB = -9999.0


def sse(data: str) -> str:
    """One server-sent event."""
    return f"data: {data}\n\n"


def _unset(model: BaseModel) -> dict[str, bool]:
    return {name: True for name in type(model).model_fields if name not in model.model_fields_set}


def sse_chunk(chunk: BaseModel) -> str:
    """One streamed chunk as an event, with the fields its producer set, as vLLM's ``exclude_unset``
    sends them: ``usage``, ``prompt_token_ids``, ``stop_reason``... appear only in the chunks that
    were given them. That rule covers the chunk's and its choices' own fields; what they hold
    (logprobs, usage, delta) goes whole."""
    exclude: dict[str, Any] = _unset(chunk)
    usage = getattr(chunk, "usage", None)
    if usage is not None and usage.prompt_tokens_details is None:
        exclude["usage"] = {"prompt_tokens_details": True}  # a chunk's usage has no nulls (vLLM)
    choices = getattr(chunk, "choices", None)
    if choices:
        exclude["choices"] = {i: _unset(choice) for i, choice in enumerate(choices)}
    return sse(chunk.model_dump_json(exclude=exclude))


SSE_DONE = sse("[DONE]")

T = TypeVar("T")
StreamT = TypeVar("StreamT", CompletionStreamResponse, ChatCompletionStreamResponse)

# What request data makes the preparation steps raise (chat templates indexing an empty or
# odd conversation, a client's own chat_template, tokenizers given the wrong types, malformed
# tool or structured-output specs): the client's fault, a 400. Anything else raised there (RuntimeError, AttributeError,
# MemoryError, a dead engine...) is a server fault: a 500, logged with its traceback.
USER_DATA_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, TypeError, LookupError, ArithmeticError, RecursionError, jinja2.TemplateError)

# One thread renders chat templates and tokenizes for the whole server: off the event loop, so
# /health and streaming answer while a big prompt is prepared, and one at a time, because a
# fast tokenizer used from two threads at once fails ("Already borrowed"), as in vLLM.
_PREPARATION_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fd-request-prep")


@contextmanager
def user_data_guard(what: str, param: str | None = None) -> Iterator[None]:
    """Turn a user-data error raised inside into a 400 :class:`ParamValidationError` naming ``what`` failed.

    Errors that already name their parameter pass through unchanged, so nested guards keep the
    innermost, most precise message; server faults pass through to become 500s.
    """
    try:
        yield
    except ParamValidationError:
        raise
    except USER_DATA_ERRORS as e:
        detail = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        raise ParamValidationError(f"Invalid {what}: {detail}", parameter=param) from e


def error_response(message: str, err_type: str = "BadRequestError", status_code: int = HTTPStatus.BAD_REQUEST,
                   param: str | None = None) -> ErrorResponse:
    """vLLM's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=int(status_code)))


def error_from_exception(exc: BaseException) -> ErrorResponse:
    """Map an exception to its envelope: bad input is 400, a dead engine or a bug is 500."""
    if isinstance(exc, ParamValidationError):
        return error_response(str(exc), param=exc.parameter)
    if isinstance(exc, ValueError):
        return error_response(str(exc))
    if isinstance(exc, NotImplementedError):
        return error_response(str(exc), "NotImplementedError", HTTPStatus.NOT_IMPLEMENTED)
    if not isinstance(exc, (EngineDeadError, EngineGenerateError)):
        logger.exception("Internal error while serving a request.", exc_info=exc)
    return error_response(str(exc) or type(exc).__name__, "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR)


class OpenAIServing:
    """Base of the OpenAI endpoints' handlers."""

    request_id_prefix = ""

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, *, return_tokens_as_token_ids: bool = False,
                 enable_prompt_tokens_details: bool = False, enable_force_include_usage: bool = False,
                 enable_per_request_metrics: bool = False) -> None:
        self.engine = engine
        self.models = models
        self.model_config = engine.model_config
        self.max_model_len = engine.model_config.max_model_len
        self.tokenizer = engine.tokenizer
        self.token_strings = engine.output_processor.token_strings
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        self.enable_force_include_usage = enable_force_include_usage
        self.enable_per_request_metrics = enable_per_request_metrics
        # Sampling defaults from the model's generation_config.json (vLLM's behaviour).
        self.default_sampling_params = engine.processor.default_sampling_params()

    # ---- errors -------------------------------------------------------------------------
    @staticmethod
    def create_error_response(message: str | BaseException, err_type: str = "BadRequestError",
                              status_code: int = HTTPStatus.BAD_REQUEST, param: str | None = None) -> ErrorResponse:
        if isinstance(message, BaseException):
            return error_from_exception(message)
        return error_response(message, err_type, status_code, param)

    def create_streaming_error_response(self, message: str | BaseException) -> str:
        return json.dumps(self.create_error_response(message).model_dump())

    # ---- checks -------------------------------------------------------------------------
    def check_model(self, request: Any) -> ErrorResponse | None:
        """404 for a model name this server does not serve (no name means the default)."""
        if self.models.is_base_model(getattr(request, "model", None)):
            return None
        return error_response(f"The model `{request.model}` does not exist.", "NotFoundError", HTTPStatus.NOT_FOUND,
                              param="model")

    def check_unsupported(self, request: SamplingRequest, beam_search: bool = False) -> ErrorResponse | None:
        """400 for request features this build cannot honour, rather than ignoring them silently."""
        if request.use_beam_search and not beam_search:
            return error_response("Beam search (`use_beam_search`) is not supported by this FastDeploy build yet.",
                                  param="use_beam_search")
        if request.priority != 0:
            return error_response(f"Got priority {request.priority} but Priority scheduling is not enabled.",
                                  param="priority")
        if request.truncate_prompt_tokens is not None and request.truncate_prompt_tokens > self.max_model_len:
            return error_response("truncate_prompt_tokens value is greater than max_model_len. "
                                  "Please, select a smaller truncation size.", param="truncate_prompt_tokens")
        return None

    @staticmethod
    def structured_outputs(request: SamplingRequest) -> StructuredOutputsParams | None:
        """The output constraint of response_format / structured_outputs / guided_* (ValueError when malformed)."""
        from fastdeploy.model_executor.guided_decoding.openai_params import structured_outputs_from_request

        return structured_outputs_from_request(request)

    @staticmethod
    async def prepare(step: Callable[..., T], *args: Any, what: str = "request") -> T:
        """``step(*args)``, a CPU-bound preparation step (chat template, tokenization, parameters), run off
        the event loop inside the user-data guard: bad data becomes a 400 naming ``what``, a server fault a 500."""
        with user_data_guard(what):
            return await asyncio.get_running_loop().run_in_executor(_PREPARATION_EXECUTOR, step, *args)

    def process_prompt(self, prompt: str | list[int] | dict, truncate_prompt_tokens: int | None,
                       add_special_tokens: bool = True, truncation_side: str | None = None) -> ProcessedPrompt:
        """Tokenize, truncate (on ``truncation_side``) and check a prompt once, through the engine's intake
        (the same checks ``LLM`` gets); it must leave room for one generated token. The engine does not
        check it again."""
        source = prompt if isinstance(prompt, (str, dict)) else {"prompt_token_ids": list(prompt)}
        return self.engine.processor.process_prompt(source, truncate_prompt_tokens=truncate_prompt_tokens,
                                                    truncation_side=truncation_side,
                                                    add_special_tokens=add_special_tokens, leave_room=True)

    def max_tokens(self, requested: int | None, num_prompt_tokens: int) -> int:
        """Requested max_tokens clamped to what the context has left (default: all of it, or the model's)."""
        candidates = [self.max_model_len - num_prompt_tokens, requested, self.default_sampling_params.get("max_tokens")]
        return min(v for v in candidates if v is not None)

    @staticmethod
    def base_request_id(raw_request: Request | None, default: str | None = None) -> str:
        """The X-Request-Id header, else the request's request_id, else a new uuid."""
        if raw_request is not None and (header := raw_request.headers.get("X-Request-Id")):
            return header
        return default or random_uuid()

    @staticmethod
    def engine_request_id(response_id: str, index: int) -> str:
        # A random tail keeps two clients that send the same X-Request-Id apart in the engine.
        return f"{response_id}-{index}-{random_uuid()[:8]}"

    # ---- logprobs -----------------------------------------------------------------------
    def token_text(self, token_id: int, logprob: Logprob | None, as_token_id: bool) -> str:
        """How a token is spelled in logprobs: its text, or ``token_id:<id>`` when asked."""
        if as_token_id:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.token_strings([token_id])[0]

    # ---- usage --------------------------------------------------------------------------
    def usage(self, num_prompt: int, num_generated: int, num_cached: int | None) -> UsageInfo:
        """Token counts of a response (cached prompt tokens with --enable-prompt-tokens-details)."""
        usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_generated,
                          total_tokens=num_prompt + num_generated)
        if self.enable_prompt_tokens_details and num_cached is not None:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=num_cached)
        return usage

    def request_metrics(self, res: RequestOutput | None, num_generated: int,
                        single: bool) -> PerRequestTimingMetrics | None:
        """--enable-per-request-metrics: the timings of ``res``, when the response is one sequence
        (``single``: one prompt, n = 1; the timings would not belong to the request otherwise)."""
        if not self.enable_per_request_metrics or not single or res is None or res.metrics is None:
            return None
        m = res.metrics
        return PerRequestTimingMetrics.from_timestamps(m.arrival_time, m.first_scheduled_time, m.first_token_time,
                                                       m.last_token_time, num_generated)

    def with_request_metrics(self, chunk: StreamT, res: RequestOutput | None, num_generated: int,
                             single: bool) -> StreamT:
        """A stream's final usage chunk, with the request's timings when there are (else the field stays
        unset, so the chunk does not carry it: vLLM sends metrics on that chunk only)."""
        metrics = self.request_metrics(res, num_generated, single)
        if metrics is not None:
            chunk.metrics = metrics
        return chunk

    def usage_flags(self, request: SamplingRequest) -> tuple[bool, bool]:
        """(final usage chunk, usage on every chunk) of a stream, as vLLM decides them.

        ``--enable-force-include-usage`` turns both on whatever the request says; otherwise
        ``stream_options.include_usage`` gives the final chunk and ``continuous_usage_stats``
        (with it) usage on every chunk.
        """
        if self.enable_force_include_usage:
            return True, True
        options = request.stream_options
        include = bool(options and options.include_usage)
        return include, include and bool(options and options.continuous_usage_stats)

    def return_as_token_ids(self, request: SamplingRequest) -> bool:
        if request.return_tokens_as_token_ids is not None:
            return request.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def jsonable_prompt_logprobs(prompt_logprobs: list[Mapping[int, Logprob] | None] | None) -> list | None:
    """Prompt logprobs as JSON-safe dicts (``-inf`` clamped), for the ``prompt_logprobs`` response field."""
    if prompt_logprobs is None:
        return None
    return [
        None if entry is None else {
            tid: {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in prompt_logprobs
    ]
