"""Stand-in for the pieces of vLLM's tests/conftest.py and tests/entrypoints/conftest.py the chosen
tests use (harness code). The sample fixtures hold the same values as vLLM's."""

import pytest


class LocalAssetServer:
    """Only the multimodal tests use it, and they are skipped."""


@pytest.fixture
def local_asset_server():
    return None


@pytest.fixture
def sample_regex():
    return (r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}"
            r"(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)")


@pytest.fixture
def sample_json_schema():
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "skills": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 3},
            "work_history": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"company": {"type": "string"}, "duration": {"type": "number"},
                                   "position": {"type": "string"}},
                    "required": ["company", "position"],
                },
            },
        },
        "required": ["name", "age", "skills", "work_history"],
    }


@pytest.fixture
def sample_structured_outputs_choices():
    return ["Python", "Java", "JavaScript", "C++", "C#", "PHP", "TypeScript", "Ruby", "Swift", "Kotlin"]


@pytest.fixture(scope="session")
def qwen3_lora_files():
    """LoRA is not built: a placeholder path (the LoRA tests are skipped, the flags dropped)."""
    return "/nonexistent/lora-adapter"
