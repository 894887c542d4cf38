"""Pydantic models of the OpenAI-compatible API, with vLLM's extra fields and checks.

Requests accept (and ignore) fields they do not know; a bad value becomes a
400 ``BadRequestError`` (the checks raise :class:`ParamValidationError`, whose
``parameter`` is reported as ``param``).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_serializer, model_validator
from typing_extensions import TypedDict  # pydantic needs this one before Python 3.12

from fastdeploy.logger import init_logger
from fastdeploy.sampling_params import ParamValidationError, RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = init_logger(__name__)

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_ignored_fields_logged: set[str] = set()
# Tags of the union request bodies: they appear in validation errors' locations, which the server drops.
UNION_TAG_PREFIX = "union:"


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    """Base of every API model: unknown request fields are kept aside and ignored."""

    model_config = ConfigDict(extra="allow")
    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        result = handler(data)
        if isinstance(data, dict) and result.model_extra:
            new = set(result.model_extra) - _ignored_fields_logged
            if new:
                # Once per field name: clients such as lm-eval send the same extras every time.
                _ignored_fields_logged.update(new)
                logger.warning("The following fields were present in the request but ignored: %s", sorted(new))
        return result


# ---- errors, usage, models ---------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fastdeploy"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PerRequestTimingMetrics(OpenAIBaseModel):
    """One request's timings, in a response's ``metrics`` with --enable-per-request-metrics (vLLM's).

    From when the request was first scheduled: queue time before it, time to the first token
    after it, generation time from the first to the last token, the mean gap between tokens,
    and output tokens per second over scheduled .. last token (prefill included). A field whose
    timestamps are missing is null.
    """

    time_to_first_token_ms: float | None = None
    generation_time_ms: float | None = None
    queue_time_ms: float | None = None
    mean_itl_ms: float | None = None
    tokens_per_second: float | None = None

    @classmethod
    def from_timestamps(cls, arrival: float | None, scheduled: float | None, first_token: float | None,
                        last_token: float | None, num_generation_tokens: int) -> PerRequestTimingMetrics:
        def ms(start: float | None, end: float | None) -> float | None:
            return (end - start) * 1000.0 if start and end and end >= start else None

        generation = ms(first_token, last_token)
        inference = last_token - scheduled if scheduled and last_token and last_token > scheduled else None
        return cls(
            time_to_first_token_ms=ms(scheduled, first_token),
            generation_time_ms=generation,
            queue_time_ms=ms(arrival, scheduled),
            mean_itl_ms=generation / (num_generation_tokens - 1) if generation is not None
            and num_generation_tokens > 1 else None,
            tokens_per_second=num_generation_tokens / inference if inference else None,
        )


# ---- request pieces ----------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    """Usage in a stream: a final usage chunk (``include_usage``), and usage on every chunk as well
    (``continuous_usage_stats``, only with ``include_usage``). Both off unless set, as in vLLM."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaResponseFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's and vLLM's extras)."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int = 1
    presence_penalty: float | None = None
    seed: Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's sampling extras.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    # With truncate_prompt_tokens: "left" keeps the last tokens, "right" the first; unset: the
    # tokenizer's side ("left", as vLLM loads it for generation).
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    # vLLM's extension: the logprobs of these ids at every generated position (with the sampled
    # token's), in place of the top-k; needs logprobs.
    logprob_token_ids: Annotated[list[int], Field(min_length=1)] | None = None
    bad_words: list[str] | None = None
    # Output constraints.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # Request handling.
    priority: int = 0
    request_id: str = Field(default_factory=random_uuid)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    # Disaggregated serving (vLLM's field): set by a router or a vLLM disaggregation proxy.
    kv_transfer_params: dict[str, Any] | None = None

    _DEFAULT_SAMPLING_PARAMS: ClassVar[dict[str, float]] = {
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
    }

    @model_validator(mode="before")
    @classmethod
    def _check_stream_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("stream_options") and not data.get("stream"):
            raise ParamValidationError("Stream options can only be defined when `stream=True`.",
                                       parameter="stream_options")
        prompt_logprobs = data.get("prompt_logprobs")
        if prompt_logprobs is not None:
            if not isinstance(prompt_logprobs, int) or isinstance(prompt_logprobs, bool):
                raise ParamValidationError("`prompt_logprobs` must be an integer.", parameter="prompt_logprobs")
            if data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1):
                raise ParamValidationError("`prompt_logprobs` are not available when `stream=True`.",
                                           parameter="prompt_logprobs")
            if prompt_logprobs < 0 and prompt_logprobs != -1:
                raise ParamValidationError("`prompt_logprobs` must be a positive value or -1.",
                                           parameter="prompt_logprobs")
        return data

    @staticmethod
    def _check_logprob_token_ids(data: dict[str, Any], *, logprobs_given: bool, needs: str,
                                 completion: bool = False) -> None:
        """vLLM's checks of ``logprob_token_ids``, in its order; a value that is no list is left to the field."""
        if not isinstance(data.get("logprob_token_ids"), list):
            return
        error = None
        if not data["logprob_token_ids"]:
            error = "`logprob_token_ids` must not be an empty list."
        elif data.get("use_beam_search"):
            error = "`logprob_token_ids` is not supported with beam search."
        elif completion and data.get("echo") and data.get("max_tokens") == 0:
            error = ("`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0` because no output "
                     "tokens are generated.")
        elif not logprobs_given:
            error = f"when using `logprob_token_ids`, `logprobs` must be {needs}."
        if error is not None:
            raise ParamValidationError(error, parameter="logprob_token_ids")

    def sampling_params(self, max_tokens: int, defaults: dict[str, Any], *, logprobs: int | None,
                        prompt_logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """SamplingParams of this request; unset fields take the model's generation_config defaults."""
        values = {
            name: value if (value := getattr(self, name)) is not None else defaults.get(name, default)
            for name, default in self._DEFAULT_SAMPLING_PARAMS.items()
        }
        return SamplingParams.from_optional(
            n=self.n,
            **values,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            # Asked-for ids replace the top-k (vLLM sends no logprobs count with them).
            logprobs=None if self.logprob_token_ids else logprobs,
            prompt_logprobs=prompt_logprobs,
            logprob_token_ids=self.logprob_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            structured_outputs=structured_outputs,
            extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None,
        )


class ResponseHead(OpenAIBaseModel):
    """The fields every generation response and chunk starts with (subclasses fix ``object``).

    Streamed chunks are sent with ``exclude_unset`` (vLLM's rule: a chunk carries the fields its
    producer set, so later chunks have no ``prompt_token_ids`` and no ``usage`` unless asked); the
    head fields always count as set.
    """

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str

    @model_validator(mode="after")
    def _head_always_set(self) -> ResponseHead:
        self.__pydantic_fields_set__.update(("id", "object", "created", "model"))
        return self


class LogprobEntry(TypedDict):
    """One token's logprob in ``prompt_logprobs`` (vLLM's ``Logprob``).

    A typed dict, not a model: a long prompt has thousands of these, and as many model objects
    cost ~15 ms a response in garbage collection (600 prompt tokens), ten times the rest.
    """

    logprob: float
    rank: int | None
    decoded_token: str | None


# One entry per prompt token, the first null: {token id: its logprob} of the prompt token and the top-k.
PromptLogprobsField = list[dict[int, LogprobEntry] | None] | None


# ---- completions -------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    # Required and non-empty (prompt_embeds is not supported); a missing or empty one gets vLLM's
    # message from the check below. The bounds tell clients and fuzzers so in /openapi.json.
    prompt: (Annotated[list[int], Field(min_length=1)] | Annotated[list[Annotated[list[int], Field(min_length=1)]],
                                                                   Field(min_length=1)]
             | Annotated[str, Field(min_length=1)] | Annotated[list[str], Field(min_length=1)])
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _check_completion_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("max_tokens") is None and "max_tokens" in data:
            data = {**data, "max_tokens": 16}
        prompt = data.get("prompt")
        if prompt is None or prompt == "" or prompt == []:
            raise ParamValidationError("Either prompt or prompt_embeds must be provided and non-empty.",
                                       parameter="prompt")
        logprobs = data.get("logprobs")
        cls._check_logprob_token_ids(data, logprobs_given=logprobs is not None, needs="set", completion=True)
        if logprobs is not None:
            if not isinstance(logprobs, int) or isinstance(logprobs, bool):
                raise ParamValidationError("`logprobs` must be an integer.", parameter="logprobs")
            if logprobs < 0 and logprobs != -1:
                raise ParamValidationError("`logprobs` must be a positive value or -1.", parameter="logprobs")
        return data


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponseChoice(CompletionResponseStreamChoice):
    # vLLM's extension fields are always there, null when not asked for.
    prompt_logprobs: PromptLogprobsField = None


class CompletionResponse(ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None
    # --enable-per-request-metrics, for one prompt with n = 1; else null.
    metrics: PerRequestTimingMetrics | None = None


class CompletionStreamResponse(ResponseHead):
    object: str = "text_completion"
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    # --enable-per-request-metrics: on the final usage chunk only.
    metrics: PerRequestTimingMetrics | None = None


# ---- chat --------------------------------------------------------------------------------
class ChatCompletionMessageParam(OpenAIBaseModel):
    """One message of a conversation; extra keys (tool_calls, name, ...) reach the chat template."""

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    # At least one message, as OpenAI requires: templates index messages[0].
    messages: Annotated[list[ChatCompletionMessageParam], Field(min_length=1)]
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    reasoning_effort: str | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_chat_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        cls._check_logprob_token_ids(data, logprobs_given=bool(data.get("logprobs")), needs="set to true")
        top_logprobs = data.get("top_logprobs")
        if top_logprobs is not None:
            if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool):
                raise ParamValidationError("`top_logprobs` must be an integer.", parameter="top_logprobs")
            if top_logprobs < 0 and top_logprobs != -1:
                raise ParamValidationError("`top_logprobs` must be a positive value or -1.",
                                           parameter="top_logprobs")
            if (top_logprobs == -1 or top_logprobs > 0) and not data.get("logprobs"):
                raise ParamValidationError("when using `top_logprobs`, `logprobs` must be set to true.",
                                           parameter="top_logprobs")
        if data.get("tools") == []:
            raise ParamValidationError(
                "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                parameter="tools")
        if "tool_choice" not in data and data.get("tools"):
            # OpenAI's default when tools are given.
            data = {**data, "tool_choice": "auto"}
        choice = data.get("tool_choice")
        if choice not in (None, "none"):
            if not data.get("tools"):
                raise ParamValidationError("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
            if choice not in ("auto", "required") and not isinstance(choice, dict):
                raise ParamValidationError(
                    f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                    "\"required\" are supported.", parameter="tool_choice")
        if data.get("add_generation_prompt", True) and data.get("continue_final_message"):
            raise ParamValidationError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                parameter="continue_final_message")
        return data


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    # OpenAI's fields this server never fills, null as in vLLM.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    reasoning: str | None = None
    # Older clients read reasoning_content (vLLM's former name).
    reasoning_content: str | None = None
    # Sent as [] when there are none, as vLLM does (clients compare the message's keys).
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatChoiceBase(OpenAIBaseModel):
    """Fields every chat choice has, whole or streamed."""

    index: int
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponseChoice(ChatChoiceBase):
    message: ChatMessage
    finish_reason: str | None = "stop"


class ChatCompletionResponse(ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    system_fingerprint: str | None = None
    usage: UsageInfo
    # vLLM's extension fields are always there, null when not asked for.
    prompt_logprobs: PromptLogprobsField = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # --enable-per-request-metrics, with n = 1; else null.
    metrics: PerRequestTimingMetrics | None = None


class DeltaMessage(OpenAIBaseModel):
    # A delta carries only what changed: these keys are left out of the JSON when None or empty.
    _omit_if_empty: ClassVar[frozenset[str]] = frozenset(
        {"role", "content", "reasoning", "reasoning_content", "tool_calls"})

    @model_serializer(mode="wrap")
    def _omit_empty(self, handler: Any):  # no return type: the JSON schema stays the fields' own
        data = handler(self)
        for key in self._omit_if_empty:
            if key in data and (data[key] is None or data[key] == []):
                del data[key]
        return data

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    # Older clients read reasoning_content (vLLM's former name).
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionResponseStreamChoice(ChatChoiceBase):
    delta: DeltaMessage


class ChatCompletionStreamResponse(ResponseHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    # On the first (role) chunk only; null there when return_token_ids is not set.
    prompt_token_ids: list[int] | None = None
    # --enable-per-request-metrics: on the final usage chunk only.
    metrics: PerRequestTimingMetrics | None = None


# ---- tokenizer endpoints -----------------------------------------------------------------
class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    # At least one message, as OpenAI requires: templates index messages[0].
    messages: Annotated[list[ChatCompletionMessageParam], Field(min_length=1)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


def _tokenize_kind(body: Any) -> str:
    return UNION_TAG_PREFIX + ("chat" if isinstance(body, dict) and "messages" in body else "completion")


# A body with ``messages`` is a chat request, else a completion one: the errors are then those of
# the one the client meant (a plain union reports both members' errors).
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag(UNION_TAG_PREFIX + "completion")]
    | Annotated[TokenizeChatRequest, Tag(UNION_TAG_PREFIX + "chat")],
    Discriminator(_tokenize_kind),
]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    # The tokens' strings with return_token_strs, else null (vLLM always sends the key).
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
