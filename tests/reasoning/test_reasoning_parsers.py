"""Reasoning parsers on recorded outputs: whole and streamed (chunk boundaries anywhere), same split both ways."""

from __future__ import annotations

import pytest

from fastdeploy.reasoning import ReasoningParserManager
from tests.entrypoints.parser_test_utils import TagTokenizer, stream

TOKENIZER = TagTokenizer()

TOOL_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"

# (parser, case, output, chat_template_kwargs, expected (reasoning, content))
CASES = [
    ("deepseek_r1", "tags", "<think>Let me add 2 and 2.</think>The answer is 4.", None,
     ("Let me add 2 and 2.", "The answer is 4.")),
    ("deepseek_r1", "start_in_prompt", "2 plus 2 is 4.\n</think>\n\n**4**", None, ("2 plus 2 is 4.\n", "\n\n**4**")),
    ("deepseek_r1", "cut_off", "Hmm, still thinking about", None, ("Hmm, still thinking about", None)),
    ("deepseek_r1", "ends_after_thinking", "<think>short</think>", None, ("short", None)),
    ("qwen3", "tags", "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?", None,
     ("\nThe user greets me.\n", "\n\nHello! How can I help?")),
    ("qwen3", "start_in_prompt", "Paris is the capital.</think>Paris.", None, ("Paris is the capital.", "Paris.")),
    ("qwen3", "thinking_disabled", "Just the answer.", {"enable_thinking": False}, (None, "Just the answer.")),
    ("qwen3", "cut_off", "Let me think step by step", None, ("Let me think step by step", None)),
    ("qwen3", "tool_call_ends_reasoning", "I need the weather tool.\n" + TOOL_CALL, None,
     ("I need the weather tool.\n", TOOL_CALL)),
    ("qwen3", "tool_call_only_mentioned", "Answer with <tool_call> tags? No.</think>No tools needed.", None,
     ("Answer with <tool_call> tags? No.", "No tools needed.")),
    ("ernie45", "response_tags", "abc\n</think>\n\n<response>\ndef\n</response>\n", None, ("abc\n", "\ndef\n")),
    ("ernie45", "plain_answer", "Let me see.\n</think>\nThe answer is 42.", None, ("Let me see.\n", "The answer is 42.")),
    ("ernie45", "cut_off", "thinking...", None, ("thinking...", None)),
]
IDS = [f"{c[0]}-{c[1]}" for c in CASES]


def make(name, chat_template_kwargs=None):
    return ReasoningParserManager.get_reasoning_parser(name)(TOKENIZER, chat_template_kwargs=chat_template_kwargs)


@pytest.mark.parametrize(("name", "case", "output", "kwargs", "expected"), CASES, ids=IDS)
def test_extract_reasoning(name, case, output, kwargs, expected):
    parser = make(name, kwargs)
    assert parser.extract_reasoning(output, None) == expected
    assert parser.extract_reasoning_content(output, None) == expected  # vLLM's former name


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize(("name", "case", "output", "kwargs", "expected"), CASES, ids=IDS)
def test_streaming_matches_whole_output(name, case, output, kwargs, expected, seed):
    parser = make(name, kwargs)
    deltas = stream(TOKENIZER, output, parser.extract_reasoning_streaming, seed=seed)
    reasoning = "".join(d.reasoning or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning or None, content or None) == expected
    # OpenAI JSON of a delta: only the fields it carries (reasoning_content is the former name).
    for delta in deltas:
        assert set(delta.to_dict()) <= {"content", "reasoning"}
        assert delta.reasoning_content == delta.reasoning


def test_is_reasoning_end_and_content_ids():
    parser = make("deepseek_r1")
    think, end = parser.start_token_id, parser.end_token_id
    assert not parser.is_reasoning_end([5, think, 7])
    assert parser.is_reasoning_end([think, 7, end, 8])
    assert not parser.is_reasoning_end([end, think, 9])  # reopened
    assert parser.extract_content_ids([think, 7, end, 8, 9]) == [8, 9]
    assert parser.extract_content_ids([think, 7, end]) == []


def test_qwen3_tool_call_ends_reasoning_only_with_a_function():
    parser = make("qwen3")
    call = TOKENIZER.encode("thinking " + TOOL_CALL[: TOOL_CALL.index("Paris")])
    assert parser.is_reasoning_end(call)
    mention = TOKENIZER.encode("use <tool_call> maybe")
    assert not parser.is_reasoning_end(mention)
    # A closed example pair (e.g. in the prompt) is not a call either.
    assert not parser.is_reasoning_end(TOKENIZER.encode(TOOL_CALL + " now thinking"))


def test_registry_and_missing_tokens():
    assert {"qwen3", "deepseek_r1", "ernie45"} <= set(ReasoningParserManager.list_registered())
    with pytest.raises(KeyError, match="not found in reasoning_parsers"):
        ReasoningParserManager.get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="vocabulary has no '<think>' or '</think>'"):
        ReasoningParserManager.get_reasoning_parser("qwen3")(TagTokenizer(tags=["<tool_call>"]))
    with pytest.raises(ValueError, match="vocabulary has no '<think>':"):
        ReasoningParserManager.get_reasoning_parser("qwen3")(TagTokenizer(tags=["</think>"]))


def test_server_refuses_a_reasoning_parser_the_model_cannot_use():
    """The default model (SmolLM2) has no think tokens: checked once at start-up, naming them."""
    from fastdeploy.entrypoints.openai.chat_parsing import ChatParserConfig
    from fastdeploy.transformers_utils.tokenizer import get_tokenizer

    config = ChatParserConfig.from_names(None, "qwen3", False)
    with pytest.raises(ValueError, match="'<think>' or '</think>'.*--reasoning-parser"):
        config.check(get_tokenizer(None))
    ChatParserConfig.from_names(None, None, False).check(get_tokenizer(None))
