"""Schema-driven fuzzing (schemathesis) of the request operations, from the server's own /openapi.json.

Valid and invalid bodies alike must never get a 5xx, and every response must be one the
document declares: its status, its content type and its schema (the error envelope included).
Bounded (examples per operation, a small max_tokens) so it takes a minute or two on the CI machine.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.slow

OPERATIONS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# Examples per operation and generation mode; with at most a few generated tokens each request is quick.
MAX_EXAMPLES = 60
# Generation is cut short: the fuzz is about request handling, not about the model's speed.
MAX_GENERATED_TOKENS = 2
MAX_CHOICES = 2

STATUSES: Counter[int] = Counter()


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(server.url_for("openapi.json"))
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema


# The filter goes on the lazy schema: the one that parametrizes the test.
schema = schemathesis.pytest.from_fixture("api_schema").include(path=OPERATIONS, method="POST")


def bounded(body: Any) -> Any:
    """The body with its generation made cheap (few tokens, few choices, no whole-vocabulary logprobs)."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body[key], bool):
            body[key] = min(body[key], MAX_GENERATED_TOKENS)
    if body.get("max_tokens") is None:
        # Unset or null means "the rest of the context": hundreds of tokens.
        body["max_tokens"] = MAX_GENERATED_TOKENS
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], MAX_CHOICES)
    for key in ("min_tokens", "prompt_logprobs"):
        body.pop(key, None)
    return body


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck), derandomize=True, database=None)
def test_no_server_error_and_documented_responses(case, server):
    if case.path != "/detokenize":
        case.body = bounded(case.body)
    response = case.call(headers=server.headers, timeout=60)
    STATUSES[response.status_code] += 1
    case.validate_response(response, checks=CHECKS)


def test_fuzz_reached_the_handlers(api_schema):
    """Runs after the fuzz (same module): the requests were many, valid ones among them, and none was a 5xx."""
    if not STATUSES:
        pytest.skip("sums up test_no_server_error_and_documented_responses, which did not run")
    assert sum(STATUSES.values()) >= 4 * MAX_EXAMPLES // 2, STATUSES
    assert STATUSES[200] > 0 and STATUSES[400] > 0, STATUSES
    assert not [s for s in STATUSES if s >= 500], STATUSES
