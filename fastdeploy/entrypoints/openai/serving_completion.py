"""POST /v1/completions.

``echo`` with ``logprobs`` returns one logprob entry per prompt token (the first
``None``) followed by the generated ones, as lm-eval's loglikelihood expects.
``max_tokens=0`` with ``echo`` returns only the prompt: the engine needs at least
one generated token, so the request runs with ``max_tokens=1`` and prompt
logprobs, and the generated token is dropped.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

from fastapi import Request

from fastdeploy.engine.processor import ProcessedPrompt
from fastdeploy.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    ErrorResponse,
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
from fastdeploy.logprobs import Logprob
from fastdeploy.outputs import CompletionOutput, RequestOutput
from fastdeploy.utils.async_utils import merge_async_iterators


@dataclass
class _Generated:
    """What a choice reports: the echoed prompt (when asked) and the generated part."""

    text: str
    token_ids: Sequence[int]
    logprobs: list | None


class OpenAIServingCompletion(OpenAIServing):
    """Handles /v1/completions, streaming or not, for one or several prompts."""

    async def create_completion(self, request: CompletionRequest, raw_request: Request | None = None,
                                ) -> AsyncGenerator[str, None] | CompletionResponse | ErrorResponse:
        if (error := self.check_model(request)) is not None:
            return error
        if request.suffix is not None:
            return error_response("suffix is not currently supported", param="suffix")
        if (error := self.check_unsupported(request, beam_search=True)) is not None:
            return error
        request_id = f"cmpl-{self.base_request_id(raw_request, request.request_id)}"
        created = int(time.time())
        try:
            prompts = await self.prepare(self._tokenize, request, what="prompt")
            with user_data_guard("request"):
                if request.use_beam_search:
                    streams = [self._beam_search(request, p, self.engine_request_id(request_id, i))
                               for i, p in enumerate(prompts)]
                else:
                    streams = await self._start(request, prompts, request_id)
        except Exception as e:
            return self.create_error_response(e)
        results = merge_async_iterators(*streams)
        if request.stream:
            return self._stream(request, prompts, results, request_id, created)
        final: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, res in results:
                final[i] = res
        except Exception as e:
            return self.create_error_response(e)
        return self._response(request, prompts, final, request_id, created)

    # ---- request preparation ----------------------------------------------------------------
    def _tokenize(self, request: CompletionRequest) -> list[ProcessedPrompt]:
        prompt = request.prompt
        if isinstance(prompt, str):
            items: list = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        return [self.process_prompt(item, request.truncate_prompt_tokens, request.add_special_tokens,
                                    request.truncation_side) for item in items]

    async def _start(self, request: CompletionRequest, prompts: list[ProcessedPrompt], request_id: str) -> list[AsyncIterator]:
        echo_only = bool(request.echo) and request.max_tokens == 0
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs
        structured_outputs = self.structured_outputs(request)
        streams: list[AsyncIterator[RequestOutput]] = []
        engine_ids: list[str] = []
        try:
            for i, prompt in enumerate(prompts):
                max_tokens = 1 if echo_only else self.max_tokens(request.max_tokens, len(prompt.token_ids))
                params = request.sampling_params(max_tokens, self.default_sampling_params, logprobs=request.logprobs,
                                                 prompt_logprobs=prompt_logprobs,
                                                 structured_outputs=structured_outputs)
                engine_id = self.engine_request_id(request_id, i)
                collector = await self.engine.add_request(engine_id, prompt, params)
                engine_ids.append(engine_id)
                streams.append(self.engine.stream_outputs(engine_id, collector))
        except BaseException:
            await self.engine.abort(engine_ids)
            raise
        return streams

    async def _beam_search(self, request: CompletionRequest, prompt: ProcessedPrompt, engine_id: str,
                           ) -> AsyncIterator[RequestOutput]:
        """vLLM's use_beam_search: n beams, ranked with length_penalty; one final output."""
        from fastdeploy.beam_search import beam_search_async, beam_search_params_from_request

        params = beam_search_params_from_request(
            request, self.max_tokens(request.max_tokens, len(prompt.token_ids)), self.default_sampling_params)
        yield await beam_search_async(self.engine.generate, prompt.token_ids, params, engine_id,
                                      eos_token_id=self.tokenizer.eos_token_id, tokenizer=self.tokenizer,
                                      prompt=prompt.text)

    # ---- output shaping ---------------------------------------------------------------------
    def _prompt_text(self, prompt: ProcessedPrompt) -> str:
        if prompt.text:
            return prompt.text
        # --skip-tokenizer-init: no text anywhere, the echoed prompt is in its token ids alone.
        return self.tokenizer.decode(prompt.token_ids) if self.tokenizer is not None else ""

    @staticmethod
    def _generated(request: CompletionRequest, output: CompletionOutput) -> _Generated:
        if request.echo and request.max_tokens == 0:
            # The one token generated to get the prompt's logprobs is not part of the answer.
            return _Generated("", [], [])
        return _Generated(output.text, output.token_ids, output.logprobs)

    def _echoed(self, request: CompletionRequest, prompt: ProcessedPrompt, res: RequestOutput,
                generated: _Generated) -> _Generated:
        logprobs = [*(res.prompt_logprobs or []), *(generated.logprobs or [])]
        # With return_token_ids the prompt comes back as prompt_token_ids, not as text (vLLM).
        text = "" if request.return_token_ids else self._prompt_text(prompt)
        return _Generated(text + generated.text, [*prompt.token_ids, *generated.token_ids], logprobs)

    def _logprobs(self, request: CompletionRequest, shown: _Generated, text_offset: int = 0) -> CompletionLogProbs | None:
        if request.logprobs is None:
            return None
        # With logprob_token_ids every entry is shown: the chosen token and the ids asked for.
        num_top = -1 if request.logprob_token_ids else request.logprobs
        return self.completion_logprobs(shown.token_ids, shown.logprobs or [], num_top,
                                        self.return_as_token_ids(request), text_offset)

    def completion_logprobs(self, token_ids: Sequence[int], top_logprobs: Sequence[dict[int, Logprob] | None],
                            num_top: int, as_token_id: bool, text_offset: int = 0) -> CompletionLogProbs:
        """OpenAI's completion logprobs; each top_logprobs dict holds the chosen token and the top ``num_top``
        (-1: every entry given)."""
        result = CompletionLogProbs()
        last_len = 0
        for i, token_id in enumerate(token_ids):
            step = top_logprobs[i] if i < len(top_logprobs) else None
            chosen = None if step is None else step.get(token_id)
            token = self.token_text(token_id, chosen, as_token_id)
            if step is None or chosen is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                result.token_logprobs.append(clamp_logprob(chosen.logprob))
                result.top_logprobs.append({
                    self.token_text(tid, lp, as_token_id): clamp_logprob(lp.logprob)
                    for rank, (tid, lp) in enumerate(step.items())
                    if num_top == -1 or rank <= num_top
                })
            result.text_offset.append(text_offset if i == 0 else result.text_offset[-1] + last_len)
            result.tokens.append(token)
            last_len = len(token)
        return result

    def _response(self, request: CompletionRequest, prompts: list[ProcessedPrompt], final: list[RequestOutput | None],
                  request_id: str, created: int) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        num_prompt = num_generated = 0
        num_cached = None
        for prompt, res in zip(prompts, final, strict=True):
            assert res is not None
            num_cached = res.num_cached_tokens
            for output in sorted(res.outputs, key=lambda o: o.index):
                generated = self._generated(request, output)
                shown = self._echoed(request, prompt, res, generated) if request.echo else generated
                choices.append(CompletionResponseChoice(
                    index=len(choices),
                    text=shown.text,
                    logprobs=self._logprobs(request, shown),
                    finish_reason=output.finish_reason,
                    stop_reason=output.stop_reason,
                    token_ids=list(generated.token_ids) if request.return_token_ids else None,
                    # Whenever the engine computed them (prompt_logprobs, or echo with logprobs), as vLLM.
                    prompt_logprobs=jsonable_prompt_logprobs(res.prompt_logprobs),
                    prompt_token_ids=prompt.token_ids if request.return_token_ids else None,
                ))
                num_generated += len(generated.token_ids)
            num_prompt += len(prompt.token_ids)
        kv_params = final[0].kv_transfer_params if len(final) == 1 and final[0] is not None else None
        return CompletionResponse(id=request_id, created=created, model=self.models.model_name, choices=choices,
                                  usage=self.usage(num_prompt, num_generated, num_cached),
                                  kv_transfer_params=kv_params,
                                  metrics=self.request_metrics(final[0], num_generated,
                                                               single=len(final) == 1 and request.n == 1))

    async def _stream(self, request: CompletionRequest, prompts: list[ProcessedPrompt],
                      results: AsyncIterator[tuple[int, RequestOutput]], request_id: str,
                      created: int) -> AsyncGenerator[str, None]:
        n = request.n
        text_lens = [0] * (n * len(prompts))
        num_tokens = [0] * (n * len(prompts))
        # Whether a choice's first chunk (the echoed prompt and/or its prompt_token_ids) was sent.
        echoed = [False] * (n * len(prompts))
        include_usage, continuous_usage = self.usage_flags(request)
        num_cached = None
        model = self.models.model_name
        last: RequestOutput | None = None
        try:
            async for p, res in results:
                last = res
                if num_cached is None:
                    num_cached = res.num_cached_tokens
                for output in res.outputs:
                    i = output.index + p * n
                    generated = self._generated(request, output)
                    first = not echoed[i]
                    if request.echo and first:
                        if not output.token_ids and output.finish_reason is None:
                            continue  # the prompt's logprobs are complete once the first token is sampled
                        shown = self._echoed(request, prompts[p], res, generated)
                    else:
                        shown = generated
                        if not shown.text and not shown.token_ids and output.finish_reason is None:
                            continue
                    echoed[i] = True
                    logprobs = self._logprobs(request, shown, text_lens[i])
                    text_lens[i] += len(shown.text)
                    num_tokens[i] += len(generated.token_ids)
                    # vLLM's first chunk of a choice carries the prompt's ids (with return_token_ids or echo).
                    prompt_ids = prompts[p].token_ids if first and (request.return_token_ids or request.echo) else None
                    chunk = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[
                        CompletionResponseStreamChoice(
                            index=i, text=shown.text, logprobs=logprobs, finish_reason=output.finish_reason,
                            stop_reason=output.stop_reason, prompt_token_ids=prompt_ids,
                            token_ids=list(generated.token_ids) if request.return_token_ids else None)
                    ])
                    if continuous_usage:
                        chunk.usage = self.usage(len(prompts[p].token_ids), num_tokens[i], None)
                    yield sse_chunk(chunk)
            if include_usage:
                usage = self.usage(sum(len(pr.token_ids) for pr in prompts), sum(num_tokens), num_cached)
                final = CompletionStreamResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
                yield sse_chunk(self.with_request_metrics(final, last, sum(num_tokens),
                                                          single=len(prompts) == 1 and n == 1))
        except Exception as e:
            yield sse(self.create_streaming_error_response(e))
        yield SSE_DONE
