"""POST /tokenize, POST /detokenize and GET /tokenizer_info."""

from __future__ import annotations

from typing import Any

from fastdeploy.engine.async_llm import AsyncLLM
from fastdeploy.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
)
from fastdeploy.entrypoints.openai.serving_chat import render_chat
from fastdeploy.entrypoints.openai.serving_engine import OpenAIServing
from fastdeploy.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization(OpenAIServing):
    """The tokenizer of the served model, over HTTP."""

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, *, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(engine, models, **kwargs)
        self.chat_template = chat_template

    async def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse | ErrorResponse:
        if (error := self.check_model(request)) is not None:
            return error
        try:
            return await self.prepare(self._tokenize, request)
        except Exception as e:
            return self.create_error_response(e)

    def _tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """The tokens of a prompt or a rendered conversation (in the preparation thread, see ``prepare``).

        Not bounded by max_model_len: /tokenize is how clients learn whether a text fits (as in vLLM).
        """
        if isinstance(request, TokenizeChatRequest):
            text = render_chat(self.tokenizer, request.messages,
                               chat_template=request.chat_template or self.chat_template,
                               add_generation_prompt=request.add_generation_prompt,
                               continue_final_message=request.continue_final_message, tools=request.tools,
                               chat_template_kwargs=request.chat_template_kwargs)
        else:
            text = request.prompt
        tokens = self.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        token_strs = self.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens,
                                token_strs=token_strs)

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse | ErrorResponse:
        if (error := self.check_model(request)) is not None:
            return error
        vocab = self.model_config.vocab_size
        bad = [t for t in request.tokens if t < 0 or t >= vocab]
        if bad:
            return self.create_error_response(f"Token id(s) {bad} are out of vocabulary (size {vocab}).",
                                              param="tokens")
        try:
            return DetokenizeResponse(prompt=await self.prepare(self.tokenizer.decode, request.tokens))
        except Exception as e:
            return self.create_error_response(e)

    def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer's class and configuration (JSON-safe values only), with the chat template."""
        tok = self.tokenizer
        info: dict[str, Any] = {"tokenizer_class": type(tok).__name__}
        for key, value in getattr(tok, "init_kwargs", {}).items():
            if isinstance(value, (str, int, float, bool)) or value is None:
                info[key] = value
        for key in ("bos_token", "eos_token", "pad_token", "unk_token", "model_max_length"):
            value = getattr(tok, key, None)
            if isinstance(value, (str, int, float, bool)):
                info[key] = value
        info["chat_template"] = self.chat_template or getattr(tok, "chat_template", None)
        info["vocab_size"] = self.model_config.vocab_size
        return info
