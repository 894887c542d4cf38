"""Helpers for tool-call and reasoning parser tests: a tokenizer with special tags, and a streaming driver."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from typing import Any

from fastdeploy.entrypoints.chat_deltas import DeltaMessage

SPECIAL_TAGS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<response>",
    "</response>",
    "<|python_tag|>",
)


class TagTokenizer:
    """Tokenizer whose special tags are single tokens and every other character is one token.

    Deltas then split text at arbitrary places, as real tokenizers do, while the
    tags arrive whole (they are special tokens in the models these parsers serve).
    """

    def __init__(self, tags: Sequence[str] = SPECIAL_TAGS) -> None:
        self.tags = list(tags)
        self._vocab = {tag: i for i, tag in enumerate(self.tags)}
        self._chars: dict[int, str] = {}

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in self.tags if text.startswith(t, i)), None)
            if tag is not None:
                ids.append(self._vocab[tag])
                i += len(tag)
            else:
                token = 1000 + ord(text[i])
                self._chars[token] = text[i]
                ids.append(token)
                i += 1
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self.tags[i] if i < len(self.tags) else self._chars[i] for i in ids)


def chunked(ids: list[int], seed: int) -> list[list[int]]:
    """``ids`` cut into chunks of 1-3 tokens (a stream's deltas), reproducibly."""
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 3)
        chunks.append(ids[i : i + size])
        i += size
    return chunks


def stream(
    tokenizer: TagTokenizer,
    text: str,
    step: Callable[..., DeltaMessage | None],
    seed: int = 0,
    **kwargs: Any,
) -> list[DeltaMessage]:
    """Feed ``text`` to a streaming extractor chunk by chunk; returns the non-empty deltas."""
    ids = tokenizer.encode(text)
    previous_text, previous_ids, deltas = "", [], []
    for chunk in chunked(ids, seed):
        delta_text = tokenizer.decode(chunk)
        current_ids = previous_ids + chunk
        delta = step(previous_text, previous_text + delta_text, delta_text, previous_ids, current_ids, chunk, **kwargs)
        if delta is not None:
            deltas.append(delta)
        previous_text, previous_ids = previous_text + delta_text, current_ids
    return deltas


def merge_tool_deltas(deltas: list[DeltaMessage]) -> tuple[str, list[dict[str, Any]]]:
    """Streamed content joined, and the tool calls rebuilt from their pieces (by index)."""
    content = "".join(d.content or "" for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            call = calls.setdefault(piece.index, {"name": None, "arguments": "", "id": None})
            if piece.id is not None:
                assert call["id"] is None, "a tool call's id is sent once"
                call["id"] = piece.id
            if piece.function is not None:
                if piece.function.name is not None:
                    assert call["name"] is None, "a tool call's name is sent once"
                    call["name"] = piece.function.name
                call["arguments"] += piece.function.arguments or ""
    return content, [calls[i] for i in sorted(calls)]


def parsed_arguments(calls: list[Any]) -> list[tuple[str, Any]]:
    """``(name, arguments as JSON)`` of ToolCalls or merged streamed calls."""
    out = []
    for call in calls:
        if isinstance(call, dict):
            out.append((call["name"], json.loads(call["arguments"])))
        else:
            out.append((call.function.name, json.loads(call.function.arguments)))
    return out
