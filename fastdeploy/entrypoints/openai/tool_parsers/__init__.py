"""Tool-call parsers (``--tool-call-parser``), vLLM's names and output.

``ToolParserManager.get_tool_parser(name)`` returns the class; build one per
request: ``parser = cls(tokenizer, tools)`` (arguments optional).

Registered: ``hermes``, ``llama3_json`` (``llama4_json``), ``qwen3_xml``
(``qwen3_coder``), ``ernie45``. ``tool_choice`` "required" / named functions are
enforced with structured outputs instead: see :mod:`.tool_choice`.
"""

from fastdeploy.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    IncrementalToolParser,
    ToolParser,
    ToolParserManager,
)
from fastdeploy.entrypoints.openai.tool_parsers.ernie45_tool_parser import Ernie45ToolParser
from fastdeploy.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from fastdeploy.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from fastdeploy.entrypoints.openai.tool_parsers.qwen3xml_tool_parser import Qwen3XMLToolParser
from fastdeploy.entrypoints.openai.tool_parsers.tool_choice import (
    get_required_tools_json_schema,
    get_tool_choice_structured_outputs,
    make_constrained_tool_call_streamer,
    named_tool_choice,
    tool_calls_from_constrained_output,
)

__all__ = [
    "Ernie45ToolParser",
    "Hermes2ProToolParser",
    "IncrementalToolParser",
    "Llama3JsonToolParser",
    "Qwen3XMLToolParser",
    "ToolParser",
    "ToolParserManager",
    "get_required_tools_json_schema",
    "get_tool_choice_structured_outputs",
    "make_constrained_tool_call_streamer",
    "named_tool_choice",
    "tool_calls_from_constrained_output",
]
