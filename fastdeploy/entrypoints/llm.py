"""``LLM``: offline batched generation, with vLLM's constructor and methods."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from fastdeploy.beam_search import BeamSearch
from fastdeploy.engine.arg_utils import EngineArgs
from fastdeploy.engine.llm_engine import LLMEngine
from fastdeploy.inputs import PromptType, TokensPrompt
from fastdeploy.outputs import BeamSearchOutput, RequestOutput
from fastdeploy.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

ChatMessage = Mapping[str, Any]


class LLM:
    """A language model for offline inference.

    Args:
        model: A local Hugging Face folder, a GGUF file, or the default model's
            name; ``None`` uses the embedded SmolLM2-135M-Instruct.
        tokenizer: Tokenizer folder when it differs from the model's.
        trust_remote_code, tensor_parallel_size, dtype, quantization, seed,
        gpu_memory_utilization, max_model_len, enable_prefix_caching,
        speculative_config, model_impl: as in vLLM.
        **engine_kwargs: any other :class:`EngineArgs` field (``block_size``,
            ``max_num_seqs``, ``kv_cache_memory_bytes``, ...).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        quantization: str | None = None,
        seed: int | None = 0,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        enable_prefix_caching: bool | None = None,
        speculative_config: dict[str, Any] | None = None,
        model_impl: str = "auto",
        **engine_kwargs: Any,
    ) -> None:
        engine_kwargs.pop("disable_log_stats", None)
        args = EngineArgs.from_kwargs(
            model=model,
            tokenizer=tokenizer,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            quantization=quantization,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            speculative_config=speculative_config,
            model_impl=model_impl,
            disable_log_stats=True,
            **engine_kwargs,
        )
        self.llm_engine = LLMEngine.from_engine_args(args)
        self.request_counter = itertools.count()
        # Loads the images of LLM.chat's image_url parts, built on first use.
        self._media_connector = None

    # ---- accessors --------------------------------------------------------------------
    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's behaviour)."""
        defaults = self.llm_engine.processor.default_sampling_params()
        return SamplingParams.from_optional(**defaults) if defaults else SamplingParams()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    # ---- generation -------------------------------------------------------------------
    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for the prompts; outputs come back in input order."""
        prompt_list = self._as_prompt_list(prompts)
        params = self._as_params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError("The lengths of prompts and priority must be the same.")
        return self._run(prompt_list, params, use_tqdm, priority)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations with the chat template."""
        if add_generation_prompt and continue_final_message:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conversation in conversations:
            images: list = []
            conversation = self._with_image_parts(conversation, images)
            text = tokenizer.apply_chat_template(
                list(conversation),
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # The template already holds any BOS: do not add special tokens again.
            prompt = TokensPrompt(prompt=text, prompt_token_ids=tokenizer.encode(text, add_special_tokens=False))
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _with_image_parts(self, conversation: Sequence[ChatMessage], images: list) -> list[ChatMessage]:
        """The conversation with its image content parts loaded into ``images`` and turned into
        ``{"type": "image"}`` parts for the chat template (fastdeploy.multimodal.chat)."""
        from fastdeploy.multimodal.chat import IMAGE_PART_TYPES, template_content

        out = []
        for message in conversation:
            content = message.get("content") if isinstance(message, Mapping) else None
            if isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") in IMAGE_PART_TYPES
                                                 for p in content):
                if self._media_connector is None:
                    from fastdeploy.multimodal.media import MediaConnector

                    mc = self.llm_engine.processor.model_config
                    self._media_connector = MediaConnector(mc.allowed_local_media_path, mc.allowed_media_domains)
                message = {**message, "content": template_content(content, self._media_connector, images)}
            out.append(message)
        return out

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search per prompt (vLLM's ``LLM.beam_search``).

        Each step generates one token for every live beam with ``2 * beam_width``
        logprobs and keeps the ``beam_width`` best continuations by
        length-normalised score; prefix caching makes re-reading the beams cheap.

        Args:
            prompts: prompts in any form ``generate`` takes.
            params: beam width, ``max_tokens``, ``ignore_eos``, temperature, ``length_penalty``.
            use_tqdm: show a progress bar over the search steps.
            concurrency_limit: search at most this many prompts at a time (all by default).

        Returns:
            One :class:`BeamSearchOutput` per prompt; its sequences, best first, hold
            the prompt plus generated tokens (``tokens``) and their decoded ``text``.
        """
        prompt_list = self._as_prompt_list(prompts)
        engine = self.llm_engine
        tokenized = [engine.processor.tokenize_prompt(p)[::-1] for p in prompt_list]
        chunk = concurrency_limit or len(tokenized)
        if chunk < 1:
            raise ValueError(f"concurrency_limit must be at least 1, got {concurrency_limit}.")
        results: list[BeamSearchOutput] = []
        for start in range(0, len(tokenized), chunk):
            search = BeamSearch(params, engine.processor.eos_token_id, tokenized[start : start + chunk])
            step_params = search.step_sampling_params
            steps = tqdm(total=params.max_tokens, desc="Beam search", dynamic_ncols=True, disable=not use_tqdm)
            with steps:
                while beams := search.live_beams():
                    prompts_step: list[PromptType] = [TokensPrompt(prompt_token_ids=b.tokens) for b in beams]
                    search.advance(self._run(prompts_step, [step_params] * len(beams), False, None))
                    steps.update(1)
            results.extend(search.outputs(self.get_tokenizer()))
        return results

    # ---- internals --------------------------------------------------------------------
    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, Mapping)):
            return [prompts]
        if isinstance(prompts, Sequence) and prompts and all(isinstance(p, int) for p in prompts):
            raise ValueError("A prompt of token ids must be passed as {'prompt_token_ids': [...]}.")
        prompt_list = list(prompts)
        if not prompt_list:
            raise ValueError("prompts must not be empty.")
        return prompt_list

    def _as_params_list(self, sampling_params, count: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * count
        else:
            params = list(sampling_params)
            if len(params) != count:
                raise ValueError("The lengths of prompts and sampling_params must be the same.")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}.")
        return params

    def _run(
        self, prompts: list[PromptType], params: list[SamplingParams], use_tqdm: bool, priority: list[int] | None
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                sp = sp.clone()
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                request_id = str(next(self.request_counter))
                engine.add_request(request_id, prompt, sp, priority=priority[i] if priority else 0)
                ids.append(request_id)
        except Exception:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        in_tokens = out_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    results[out.request_id] = out
                    in_tokens += len(out.prompt_token_ids or ())
                    out_tokens += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"est. speed input: {in_tokens / elapsed:.2f} toks/s, output: {out_tokens / elapsed:.2f} toks/s",
                        refresh=False,
                    )
                    bar.update(1)
        except BaseException:
            engine.abort_request([i for i in ids if i not in results])
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]
