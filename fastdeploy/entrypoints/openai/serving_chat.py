"""POST /v1/chat/completions: chat template, sampling, streaming with ``delta.role`` first."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from fastdeploy.engine.async_llm import AsyncLLM
from fastdeploy.engine.processor import ProcessedPrompt
from fastdeploy.entrypoints.openai.chat_parsing import ChatOutputParser, ChatParserConfig
from fastdeploy.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionMessageParam,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    ErrorResponse,
    UsageInfo,
)
from fastdeploy.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    clamp_logprob,
    error_response,
    jsonable_prompt_logprobs,
    sse,
    sse_chunk,
    user_data_guard,
)
from fastdeploy.entrypoints.openai.serving_models import OpenAIServingModels
from fastdeploy.logprobs import Logprob
from fastdeploy.outputs import RequestOutput
from fastdeploy.sampling_params import ParamValidationError, SamplingParams, StructuredOutputsParams

_TEXT_PART_TYPES = ("text", "input_text", "output_text")


def load_chat_template(chat_template: str | None) -> str | None:
    """--chat-template: a file path, or the Jinja template itself (vLLM's rule)."""
    if chat_template is None:
        return None
    try:
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if any(c in chat_template for c in "{}\n"):
            return chat_template
        raise ValueError(f"The supplied chat template ({chat_template}) looks like a file path, but it failed to be "
                         f"opened. Reason: {e}") from e


def arguments_as_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Chat templates expect tool-call arguments as objects; OpenAI clients send JSON strings."""
    calls = message.get("tool_calls")
    if not calls or not isinstance(calls, list):
        return message
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            converted.append(call)  # not an OpenAI tool call: left for the template to judge
            continue
        function = dict(function)
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                pass
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}


def conversation_for_template(messages: Sequence[ChatCompletionMessageParam], connector: Any = None,
                              images: list | None = None) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text content as one string (parts joined by newlines).

    ``images`` (a list, for a multimodal model): image parts are loaded with ``connector`` and
    appended to it, and such a message keeps its parts for the template (fastdeploy.multimodal.chat).
    """
    conversation = []
    for message in messages:
        entry = message.model_dump()
        content = entry.get("content")
        if isinstance(content, list) and images is not None:
            from fastdeploy.multimodal.chat import template_content

            entry["content"] = template_content(content, connector, images)
        elif isinstance(content, list):
            texts = []
            for part in content:
                part_type = part.get("type")
                if part_type not in _TEXT_PART_TYPES:
                    raise ValueError(f"Content part type {part_type!r} is not supported: the model takes text only.")
                texts.append(str(part.get("text", "")))
            entry["content"] = "\n".join(texts)
        elif content is None:
            entry["content"] = ""
        conversation.append(arguments_as_objects(entry))
    return conversation


def render_chat(tokenizer, messages: Sequence[ChatCompletionMessageParam], *, chat_template: str | None,
                add_generation_prompt: bool, continue_final_message: bool, tools: list[dict] | None = None,
                documents: list[dict] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                connector: Any = None, images: list | None = None) -> str:
    """The prompt text of a conversation (also used by /tokenize); ``images`` collects the image parts
    (see :func:`conversation_for_template`)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("As of transformers v4.44, default chat template is no longer allowed, so you must provide "
                         "a chat template if the tokenizer does not define one.")
    kwargs = dict(chat_template_kwargs or {})
    if documents is not None:
        kwargs["documents"] = documents
    # The template indexes and iterates whatever the client sent: its failures are the request's.
    with user_data_guard("messages for the chat template", "messages"):
        conversation = conversation_for_template(messages, connector, images)
        return tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, tokenize=False, **kwargs,
        )


class OpenAIServingChat(OpenAIServing):
    """Handles /v1/chat/completions."""

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, *, response_role: str = "assistant",
                 chat_template: str | None = None, parser_config: ChatParserConfig | None = None,
                 **kwargs: Any) -> None:
        super().__init__(engine, models, **kwargs)
        self.response_role = response_role
        self.chat_template = chat_template
        self.parser_config = parser_config or ChatParserConfig()
        # Image parts are kept for a multimodal model only; a text model refuses them by name.
        self.media_connector = None
        if engine.processor.is_multimodal:
            from fastdeploy.multimodal.media import MediaConnector

            mc = engine.processor.model_config
            self.media_connector = MediaConnector(mc.allowed_local_media_path, mc.allowed_media_domains)

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request | None = None,
                                     ) -> AsyncGenerator[str, None] | ChatCompletionResponse | ErrorResponse:
        if (error := self.check_model(request)) is not None:
            return error
        if (error := self.check_unsupported(request) or self._check_tools(request)) is not None:
            return error
        request_id = f"chatcmpl-{self.base_request_id(raw_request, request.request_id)}"
        created = int(time.time())
        engine_id = self.engine_request_id(request_id, 0)
        try:
            parser, request, prompt, params = await self.prepare(self._prepare, request)
            with user_data_guard("request"):
                collector = await self.engine.add_request(engine_id, prompt, params)
        except Exception as e:
            return self.create_error_response(e)
        results = self.engine.stream_outputs(engine_id, collector)
        if request.stream:
            return self._stream(request, parser, results, request_id, created)
        final: RequestOutput | None = None
        try:
            async for res in results:
                final = res
        except Exception as e:
            return self.create_error_response(e)
        assert final is not None
        return self._response(request, parser, final, request_id, created)

    def _prepare(self, request: ChatCompletionRequest,
                 ) -> tuple[ChatOutputParser, ChatCompletionRequest, ProcessedPrompt, SamplingParams]:
        """Parsers, prompt (template rendered, tokenized, checked) and sampling params of a request.

        Runs in the preparation thread, inside the user-data guard (see :meth:`OpenAIServing.prepare`).
        """
        parser = ChatOutputParser(self.parser_config, request, self.tokenizer)
        request = parser.adjust_request()
        images = [] if self.media_connector is not None else None
        prompt_text = render_chat(
            self.tokenizer, request.messages, chat_template=request.chat_template or self.chat_template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, tools=request.tools,
            documents=request.documents, chat_template_kwargs=request.chat_template_kwargs,
            connector=self.media_connector, images=images)
        source = {"prompt": prompt_text, "multi_modal_data": {"image": images}} if images else prompt_text
        prompt = self.process_prompt(source, request.truncate_prompt_tokens, request.add_special_tokens,
                                     request.truncation_side)
        max_tokens = self.max_tokens(request.max_completion_tokens or request.max_tokens, len(prompt.token_ids))
        with user_data_guard("tools or structured outputs", "tools" if request.tools else None):
            constraint = self._constraint(request)
        params = request.sampling_params(max_tokens, self.default_sampling_params,
                                         logprobs=request.top_logprobs if request.logprobs else None,
                                         prompt_logprobs=request.prompt_logprobs, structured_outputs=constraint)
        return parser, request, prompt, params

    def _check_tools(self, request: ChatCompletionRequest) -> ErrorResponse | None:
        """Tools always reach the chat template; "auto" needs a tool-call parser to find the calls."""
        config = self.parser_config
        if request.tool_choice == "auto" and not (config.enable_auto_tools and config.tool_parser_cls is not None):
            return error_response('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                  "to be set", param="tool_choice")
        return None

    def _constraint(self, request: ChatCompletionRequest) -> StructuredOutputsParams | None:
        """The request's own output constraint, or the JSON schema of a forced tool call."""
        from fastdeploy.entrypoints.openai.tool_parsers import get_tool_choice_structured_outputs

        constraint = self.structured_outputs(request)
        forced = get_tool_choice_structured_outputs(request.tools, request.tool_choice, request.parallel_tool_calls)
        if forced is None:
            return constraint
        if constraint is not None:
            raise ParamValidationError("You can only either use constraints for structured outputs or tools, not "
                                       "both.", parameter="tool_choice")
        return forced

    # ---- output shaping ---------------------------------------------------------------------
    def _role(self, request: ChatCompletionRequest) -> str:
        return self.response_role if request.add_generation_prompt else request.messages[-1].role

    def _echo_text(self, request: ChatCompletionRequest, role: str) -> str:
        """With echo, the last message's text when it has the answer's role (the answer continues it)."""
        if not request.echo or not request.messages or request.messages[-1].role != role:
            return ""
        return conversation_for_template(request.messages[-1:])[0]["content"]

    def _logprobs(self, request: ChatCompletionRequest, token_ids: Sequence[int],
                  logprobs: Sequence[dict[int, Logprob]] | None) -> ChatCompletionLogProbs | None:
        if not request.logprobs or logprobs is None:
            return None
        as_id = self.return_as_token_ids(request)
        # With logprob_token_ids every entry is shown: the chosen token and the ids asked for.
        num_top = -1 if request.logprob_token_ids else request.top_logprobs or 0
        content = []
        for i, token_id in enumerate(token_ids):
            step = logprobs[i] if i < len(logprobs) else {}
            chosen = step.get(token_id)
            token = self.token_text(token_id, chosen, as_id)
            tops = [
                self._logprob_entry(self.token_text(tid, lp, as_id), lp.logprob)
                for rank, (tid, lp) in enumerate(step.items())
                if num_top == -1 or rank < num_top
            ]
            entry = self._logprob_entry(token, chosen.logprob if chosen is not None else None)
            content.append(ChatCompletionLogProbsContent(**entry.model_dump(), top_logprobs=tops))
        return ChatCompletionLogProbs(content=content)

    @staticmethod
    def _logprob_entry(token: str, logprob: float | None) -> ChatCompletionLogProb:
        entry = ChatCompletionLogProb(token=token, bytes=list(token.encode("utf-8", errors="replace")))
        if logprob is not None:
            entry.logprob = clamp_logprob(logprob)
        return entry

    def _response(self, request: ChatCompletionRequest, parser: ChatOutputParser, res: RequestOutput,
                  request_id: str, created: int) -> ChatCompletionResponse:
        role = self._role(request)
        echo = self._echo_text(request, role)
        choices = []
        for output in sorted(res.outputs, key=lambda o: o.index):
            answer = parser.parse(output.text)
            content = answer.content if not echo else echo + (answer.content or "")
            choices.append(ChatCompletionResponseChoice(
                index=output.index,
                message=ChatMessage(role=role, content=content, reasoning=answer.reasoning,
                                    reasoning_content=answer.reasoning, tool_calls=answer.tool_calls),
                logprobs=self._logprobs(request, output.token_ids, output.logprobs),
                finish_reason="tool_calls" if answer.tools_called else output.finish_reason,
                stop_reason=output.stop_reason,
                token_ids=list(output.token_ids) if request.return_token_ids else None,
            ))
        num_generated = sum(len(o.token_ids) for o in res.outputs)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.models.model_name, choices=choices,
            usage=self.usage(len(res.prompt_token_ids or ()), num_generated, res.num_cached_tokens),
            prompt_logprobs=jsonable_prompt_logprobs(res.prompt_logprobs),
            prompt_token_ids=res.prompt_token_ids if request.return_token_ids else None,
            kv_transfer_params=res.kv_transfer_params,
            metrics=self.request_metrics(res, num_generated, single=request.n == 1),
        )

    def _chunk(self, request_id: str, created: int, choice: ChatCompletionResponseStreamChoice,
               usage: UsageInfo | None = None, **extra: Any) -> str:
        """One chunk of one choice; ``usage`` only when given (continuous usage), ``extra`` fields as set."""
        chunk = ChatCompletionStreamResponse(id=request_id, created=created, model=self.models.model_name,
                                             choices=[choice], **extra)
        if usage is not None:
            chunk.usage = usage
        return sse_chunk(chunk)

    async def _stream(self, request: ChatCompletionRequest, parser: ChatOutputParser,
                      results: AsyncIterator[RequestOutput], request_id: str,
                      created: int) -> AsyncGenerator[str, None]:
        n = request.n
        role = self._role(request)
        num_tokens = [0] * n
        finished = [False] * n
        include_usage, continuous_usage = self.usage_flags(request)
        num_prompt = 0
        num_cached = None
        first = True
        last: RequestOutput | None = None
        try:
            async for res in results:
                last = res
                if first:
                    first = False
                    num_prompt, num_cached = len(res.prompt_token_ids or ()), res.num_cached_tokens
                    echo = self._echo_text(request, role)
                    # Continuous usage starts on the role chunk: nothing generated yet.
                    usage = self.usage(num_prompt, 0, None) if continuous_usage else None
                    for i in range(n):
                        # As vLLM: logprobs and finish_reason null, and prompt_token_ids (null unless asked) here only.
                        yield self._chunk(request_id, created, ChatCompletionResponseStreamChoice(
                            index=i, delta=DeltaMessage(role=role, content=""), logprobs=None, finish_reason=None),
                            usage, prompt_token_ids=res.prompt_token_ids if request.return_token_ids else None)
                        if echo:
                            yield self._chunk(request_id, created, ChatCompletionResponseStreamChoice(
                                index=i, delta=DeltaMessage(content=echo), logprobs=None, finish_reason=None), usage)
                for output in res.outputs:
                    i = output.index
                    if finished[i] or (not output.text and not output.token_ids and output.finish_reason is None):
                        continue
                    num_tokens[i] += len(output.token_ids)
                    finished[i] = output.finish_reason is not None
                    delta = parser.stream_delta(i, output.text, list(output.token_ids))
                    logprobs = self._logprobs(request, output.token_ids, output.logprobs)
                    if delta is None:
                        # Text held back (a reasoning or tool-call marker may be starting): the chunk still
                        # goes out when it carries token ids (as vLLM) or logprobs (vLLM drops those; we
                        # send them so that a client summing logprobs misses none).
                        if not finished[i] and logprobs is None and not request.return_token_ids:
                            continue
                        delta = DeltaMessage()
                    finish_reason = output.finish_reason
                    if finish_reason is not None and parser.streamed_tool_calls(i):
                        finish_reason = "tool_calls"
                    choice = ChatCompletionResponseStreamChoice(
                        index=i, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                        token_ids=list(output.token_ids) if request.return_token_ids else None)
                    if finish_reason is not None:
                        choice.stop_reason = output.stop_reason  # the last chunk of a choice has it (vLLM)
                    usage = self.usage(num_prompt, num_tokens[i], None) if continuous_usage else None
                    yield self._chunk(request_id, created, choice, usage)
            if include_usage:
                final = ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.models.model_name, choices=[],
                    usage=self.usage(num_prompt, sum(num_tokens), num_cached))
                yield sse_chunk(self.with_request_metrics(final, last, sum(num_tokens), single=n == 1))
        except Exception as e:
            yield sse(self.create_streaming_error_response(e))
        yield SSE_DONE
