"""DeepSeek-R1: ``<think>`` is in the prompt, so the output is reasoning until ``</think>``."""

from __future__ import annotations

from collections.abc import Sequence

from fastdeploy.entrypoints.chat_deltas import DeltaMessage
from fastdeploy.reasoning.abs_reasoning_parsers import ReasoningParserManager
from fastdeploy.reasoning.basic_parsers import ThinkTagReasoningParser


@ReasoningParserManager.register_module("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """``<think>`` reasoning ``</think>`` answer; without ``<think>`` in the output the text still starts as reasoning."""

    def _without_start(
        self, previous_token_ids: Sequence[int], delta_text: str, delta_token_ids: Sequence[int]
    ) -> DeltaMessage | None:
        # R1's template opens the reasoning in the prompt: treat the output as if it had started it.
        return self._after_start(previous_token_ids, delta_text, delta_token_ids)
