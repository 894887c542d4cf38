"""The one intake of requests: prompts -> token ids, checks against the model, final sampling params.

:meth:`Processor.process_request` turns a prompt and its :class:`SamplingParams` into the
engine requests to send (one, or n children when ``n > 1``); ``LLMEngine`` and ``AsyncLLM``
both call it and nothing else. The OpenAI server needs a prompt's length before it builds
the parameters (``max_tokens`` defaults to what the context has left), so it runs the
prompt half first (:meth:`Processor.process_prompt`) and hands the resulting
:class:`ProcessedPrompt` over, which is then not tokenized or checked again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastdeploy.config import ModelConfig, StructuredOutputsConfig
from fastdeploy.engine.output_processor import ParentRequest
from fastdeploy.engine.request import EngineCoreRequest
from fastdeploy.engine.sampling_finalization import (
    update_from_generation_config,
    update_from_tokenizer,
    verify_token_ids,
)
from fastdeploy.inputs import PromptType
from fastdeploy.sampling_params import ParamValidationError, SamplingParams

# Slack on the characters-per-token bound: normalizers may fold several characters into one
# (combining marks), so a text may hold a little more than max_model_len longest tokens.
_CHARS_PER_TOKEN_SLACK = 2


@dataclass(frozen=True)
class ProcessedPrompt:
    """A prompt tokenized, truncated and checked by :meth:`Processor.process_prompt`."""

    text: str | None
    token_ids: list[int]
    # Images of the prompt (fastdeploy.multimodal.inputs.MultiModalFeatureSpec), placeholders expanded.
    mm_features: list | None = None


@dataclass(frozen=True)
class EngineRequestSpec:
    """One engine request of a processed request, with its place among the n children (parent None: n = 1)."""

    core_request: EngineCoreRequest
    parent: ParentRequest | None
    index: int


@dataclass(frozen=True)
class ProcessedRequest:
    """What one call to :meth:`Processor.process_request` makes of a prompt and its parameters."""

    request_id: str
    prompt: ProcessedPrompt
    arrival_time: float
    engine_requests: list[EngineRequestSpec]


class Processor:
    """Tokenizes prompts and validates requests before they reach the engine core."""

    def __init__(
        self, model_config: ModelConfig, tokenizer, structured_outputs_config: StructuredOutputsConfig | None = None,
        kv_transfer_enabled: bool = False,
    ) -> None:
        self.model_config = model_config
        self.kv_transfer_enabled = kv_transfer_enabled
        self.tokenizer = tokenizer
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        self.generation_config = model_config.get_generation_config()
        eos = tokenizer.eos_token_id if tokenizer is not None else model_config.hf_config.eos_token_id
        # Configs may list several EOS ids; the first is the model's own, the rest arrive via generation_config.
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.max_prompt_chars = self._max_prompt_chars()
        self._mm_processor = None
        from fastdeploy.multimodal.processing import is_multimodal_architecture

        # Whether the model takes images (the chat front end keeps image parts for it).
        self.is_multimodal = is_multimodal_architecture(model_config.architectures)

    def mm_processor(self):
        """The model's :class:`~fastdeploy.multimodal.processing.MultiModalProcessor`, built on first use.

        Raises:
            ValueError: the model is text only.
        """
        if self._mm_processor is None:
            from fastdeploy.multimodal.processing import MultiModalProcessor

            self._mm_processor = MultiModalProcessor(self.model_config, self.tokenizer)
        return self._mm_processor

    def _max_prompt_chars(self) -> int | None:
        """The most characters a prompt of max_model_len tokens can have with this tokenizer (None: no tokenizer).

        A token spells at most as many characters as its vocabulary entry has (byte-level and
        sentencepiece entries spell each byte or space with one character), so a longer text cannot
        fit and is refused before the tokenizer spends seconds on it.
        """
        if self.tokenizer is None:
            return None
        from fastdeploy.transformers_utils.tokenizer import cached_vocab

        longest = max(map(len, cached_vocab(self.tokenizer)), default=0) or 64
        return self.model_config.max_model_len * longest * _CHARS_PER_TOKEN_SLACK

    def check_prompt_size(self, text: str) -> None:
        """Refuse, without tokenizing it, a text too long for any prompt of max_model_len tokens."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            max_len = self.model_config.max_model_len
            raise ParamValidationError(
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{len(text)} characters, more than {max_len} tokens can spell (at most {self.max_prompt_chars} "
                "characters). Please reduce the length of the input messages.",
                parameter="input_tokens", value=len(text))

    def tokenize_prompt(self, prompt: PromptType, add_special_tokens: bool = True, *,
                        check_size: bool = False) -> tuple[str | None, list[int]]:
        """Text and token ids of a prompt in any accepted form.

        ``check_size``: refuse a text too long to fit max_model_len before tokenizing it.
        """
        if isinstance(prompt, str):
            return prompt, self._encode(prompt, add_special_tokens, check_size)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self._encode(prompt["prompt"], add_special_tokens, check_size)
        raise ValueError(
            "prompt must be a str, a dict with 'prompt' or 'prompt_token_ids', or a list of these; "
            f"got {type(prompt).__name__}."
        )

    def _encode(self, text: str, add_special_tokens: bool, check_size: bool = False) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("A text prompt needs a tokenizer; pass prompt_token_ids instead.")
        if check_size:
            self.check_prompt_size(text)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def process_prompt(self, prompt: PromptType | ProcessedPrompt, *, truncate_prompt_tokens: int | None = None,
                       truncation_side: str | None = None, add_special_tokens: bool = True,
                       leave_room: bool = False) -> ProcessedPrompt:
        """Tokenize (text prompts), keep ``truncate_prompt_tokens`` tokens (-1: as many as fit), check.

        ``truncation_side``: "left" keeps the last tokens, "right" the first; None takes the
        tokenizer's side, which is "left" unless the tokenizer was loaded otherwise (as in vLLM).
        ``leave_room``: the prompt must leave space for at least one generated token, with the
        OpenAI server's wording of the error (vLLM's); otherwise it may fill the context.
        """
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        # A truncated prompt may be any length; an untruncated one must fit.
        text, token_ids = self.tokenize_prompt(prompt, add_special_tokens,
                                               check_size=truncate_prompt_tokens is None)
        mm_features = None
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data"):
            if truncate_prompt_tokens is not None:
                raise ParamValidationError("truncate_prompt_tokens cannot cut a prompt with images.",
                                           parameter="truncate_prompt_tokens", value=truncate_prompt_tokens)
            token_ids, mm_features = self.mm_processor().process(token_ids, prompt["multi_modal_data"],
                                                                 prompt.get("mm_processor_kwargs"))
        if truncate_prompt_tokens is not None:
            keep = self.model_config.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            side = truncation_side or getattr(self.tokenizer, "truncation_side", None) or "left"
            if side not in ("left", "right"):
                raise ParamValidationError(f"truncation_side must be 'left' or 'right', got {side!r}.",
                                           parameter="truncation_side", value=side)
            if not keep:
                token_ids = []
            elif len(token_ids) > keep:
                token_ids = token_ids[-keep:] if side == "left" else token_ids[:keep]
        self.validate_prompt(token_ids, leave_room=leave_room)
        return ProcessedPrompt(text, token_ids, mm_features)

    def process_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> ProcessedRequest:
        """Validate a request and build its engine requests (n children when ``params.n > 1``).

        Raises:
            ValueError: naming what is wrong with the prompt or the parameters.
        """
        self.validate_kv_transfer_params(params)
        prompt = self.process_prompt(prompt, truncate_prompt_tokens=params.truncate_prompt_tokens)
        params = self.finalize_params(params)
        arrival_time = arrival_time or time.time()
        if params.n == 1:
            children = [(request_id, params, None, 0)]
        else:
            parent = ParentRequest(request_id, params.n, params.output_kind)
            children = [(ParentRequest.child_id(i, request_id), ParentRequest.child_sampling_params(params, i), parent,
                         i) for i in range(params.n)]
        specs = [
            EngineRequestSpec(EngineCoreRequest(request_id=engine_id, prompt_token_ids=prompt.token_ids,
                                                sampling_params=sp, eos_token_id=sp.eos_token_id,
                                                arrival_time=arrival_time, priority=priority,
                                                bad_words_token_ids=sp.bad_words_token_ids,
                                                mm_features=prompt.mm_features), parent, index)
            for engine_id, sp, parent, index in children
        ]
        return ProcessedRequest(request_id, prompt, arrival_time, specs)

    def validate_prompt(self, prompt_token_ids: list[int], leave_room: bool = False) -> None:
        """An empty prompt, one too long for the model, or a token id outside the vocabulary is a ValueError."""
        if not prompt_token_ids:
            raise ValueError("The decoder prompt cannot be empty")
        max_len = self.model_config.max_model_len
        if leave_room and len(prompt_token_ids) >= max_len:
            raise ParamValidationError(
                f"This model's maximum context length is {max_len} tokens. However, your request has "
                f"{len(prompt_token_ids)} input tokens. Please reduce the length of the input messages.",
                parameter="input_tokens",
                value=len(prompt_token_ids),
            )
        if len(prompt_token_ids) > max_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum model length "
                f"of {max_len}. Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        vocab = self.model_config.vocab_size
        bad = max(prompt_token_ids)
        if bad >= vocab or min(prompt_token_ids) < 0:
            raise ValueError(f"Token id {bad if bad >= vocab else min(prompt_token_ids)} is out of vocabulary")

    def finalize_params(self, params: SamplingParams) -> SamplingParams:
        """Per-request copy with the model's EOS ids, tokenized bad words and checked logprob counts (once per request)."""
        self.validate_logprobs(params)
        params = params.clone()
        if params.structured_outputs is not None:
            self._validate_structured_outputs(params)
        update_from_generation_config(params, self.generation_config, self.eos_token_id)
        if self.tokenizer is not None:
            update_from_tokenizer(params, self.tokenizer, self.model_config.vocab_size)
        else:
            if params.bad_words:
                # Words are matched as token sequences; without a tokenizer they cannot be, and
                # dropping them would accept the setting and ignore it.
                raise ParamValidationError("bad_words needs a tokenizer, so it can't be used with 'skip_tokenizer_init'",
                                           parameter="bad_words")
            verify_token_ids(params, self.model_config.vocab_size)
        return params

    def validate_logprobs(self, params: SamplingParams) -> None:
        """vLLM's --max-logprobs rule: -1 (the whole vocabulary) counts as the vocabulary size, so it is
        refused unless the server allows that many (``--max-logprobs -1`` or at least the vocabulary)."""
        vocab = self.model_config.vocab_size
        max_logprobs = vocab if self.model_config.max_logprobs == -1 else self.model_config.max_logprobs
        for name, parameter, value in (("sample", "logprobs", params.logprobs),
                                       ("prompt", "prompt_logprobs", params.prompt_logprobs)):
            count = vocab if value == -1 else value
            if count and count > max_logprobs:
                raise ParamValidationError(
                    f"Requested {name} logprobs of {count}, which is greater than max allowed: {max_logprobs}",
                    parameter=parameter, value=count)

    def validate_kv_transfer_params(self, params: SamplingParams) -> None:
        """Check vLLM's ``kv_transfer_params`` (before n > 1 fans a request out)."""
        kv = (params.extra_args or {}).get("kv_transfer_params")
        if kv is None:
            return
        if not isinstance(kv, dict):
            raise ParamValidationError("kv_transfer_params must be an object.", parameter="kv_transfer_params")
        if not (kv.get("do_remote_decode") or kv.get("do_remote_prefill")):
            return
        if not self.kv_transfer_enabled:
            raise ParamValidationError(
                "kv_transfer_params asks for a remote prefill or decode, but this instance runs without KV transfer "
                "(start it with --splitwise-role or --kv-transfer-config).", parameter="kv_transfer_params")
        if params.n != 1:
            raise ParamValidationError("kv_transfer_params needs n=1: one sequence per KV hand-over.",
                                       parameter="kv_transfer_params")

    def _validate_structured_outputs(self, params: SamplingParams) -> None:
        """Reject a constraint the backend cannot enforce here, so the engine only ever sees valid ones."""
        if self.tokenizer is None:
            raise ValueError("Structured outputs requires a tokenizer so it can't be used with 'skip_tokenizer_init'")
        from fastdeploy.model_executor.guided_decoding import validate_structured_outputs

        validate_structured_outputs(params.structured_outputs, self.structured_outputs_config)

    def default_sampling_params(self) -> dict[str, Any]:
        """Sampling defaults from generation_config.json, in SamplingParams' names (vLLM's behaviour)."""
        names = {
            "repetition_penalty": "repetition_penalty",
            "temperature": "temperature",
            "top_k": "top_k",
            "top_p": "top_p",
            "min_p": "min_p",
            "max_new_tokens": "max_tokens",
        }
        return {dst: self.generation_config[src] for src, dst in names.items() if src in self.generation_config}
