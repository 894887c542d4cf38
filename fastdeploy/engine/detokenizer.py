"""Incremental detokenization: text grows token by token without re-decoding the whole output."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream first, so the first generated token decodes in context
# (leading spaces of SentencePiece-style tokens, multi-byte characters).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Decodes the output of one request as its tokens arrive."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._backend = tokenizer.backend_tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        try:
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        except TypeError:  # older tokenizers: no prompt context
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.output_text = ""

    def update(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they added (may be empty while a character is incomplete)."""
        added = []
        for token_id in new_token_ids:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                added.append(piece)
        delta = "".join(added)
        self.output_text += delta
        return delta


class TokenStringCache:
    """Decoded text of single tokens (for logprobs), computed once per token id."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_ids: list[int]) -> list[str]:
        missing = [t for t in set(token_ids) if t not in self._cache]
        if missing:
            for tid, text in zip(missing, self._tokenizer.batch_decode([[t] for t in missing]), strict=True):
                self._cache[tid] = text
        return [self._cache[t] for t in token_ids]
