"""Reasoning parsers (``--reasoning-parser``): split a thinking model's thoughts from its answer.

``ReasoningParserManager.get_reasoning_parser(name)`` returns the class; build
one per request: ``parser = cls(tokenizer, chat_template_kwargs=...)``.
Registered: ``qwen3``, ``deepseek_r1``, ``ernie45``.
"""

from fastdeploy.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningParserManager
from fastdeploy.reasoning.basic_parsers import BaseThinkingReasoningParser, ThinkTagReasoningParser
from fastdeploy.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from fastdeploy.reasoning.ernie45_reasoning_parser import Ernie45ReasoningParser
from fastdeploy.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

__all__ = [
    "BaseThinkingReasoningParser",
    "DeepSeekR1ReasoningParser",
    "Ernie45ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "ThinkTagReasoningParser",
]
