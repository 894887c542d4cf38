"""Health, version, load, models, tokenizer and metrics routes of the real server."""

from __future__ import annotations

import httpx
import pytest
from remote_server import MODEL_NAME

pytestmark = pytest.mark.slow


def test_health_and_ping(server):
    assert httpx.get(server.url_for("health")).status_code == 200
    assert httpx.get(server.url_for("health")).content == b""
    assert httpx.get(server.url_for("ping")).status_code == 200
    assert httpx.post(server.url_for("ping")).status_code == 200


def test_version_and_load(server):
    import fastdeploy

    assert httpx.get(server.url_for("version")).json() == {"version": fastdeploy.__version__}
    assert httpx.get(server.url_for("load")).json()["server_load"] == 0


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].max_model_len == 512


def test_tokenize_detokenize(server):
    r = httpx.post(server.url_for("tokenize"), json={"prompt": "Hello world", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200, body
    assert body["count"] == len(body["tokens"]) == 2
    assert body["max_model_len"] == 512
    assert body["token_strs"] == ["Hello", "Ġworld"]
    r = httpx.post(server.url_for("detokenize"), json={"tokens": body["tokens"]})
    assert r.json() == {"prompt": "Hello world"}


def test_tokenize_chat(server):
    messages = [{"role": "user", "content": "Hi"}]
    body = httpx.post(server.url_for("tokenize"), json={"messages": messages}).json()
    text = httpx.post(server.url_for("detokenize"), json={"tokens": body["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_info(server):
    info = httpx.get(server.url_for("tokenizer_info")).json()
    assert info["eos_token"] == "<|im_end|>"
    assert "{% for message in messages %}" in info["chat_template"]


def test_metrics_port_serves_only_metrics(server):
    metrics_root = f"http://127.0.0.1:{server.metrics_port}"
    r = httpx.get(f"{metrics_root}/metrics")
    assert r.status_code == 200
    assert "vllm:num_requests_running" in r.text
    assert httpx.get(f"{metrics_root}/health").status_code == 404
    assert "vllm:kv_cache_usage_perc" in httpx.get(server.url_for("metrics")).text


def test_unknown_route_is_an_error_envelope(server):
    r = httpx.get(server.url_for("v1", "nothing"), headers=server.headers)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == 404


def test_method_not_allowed_names_the_allowed_methods(server):
    r = httpx.get(server.url_for("v1", "completions"), headers=server.headers)
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == 405


def test_openapi_declares_responses_and_errors(server):
    paths = httpx.get(server.url_for("openapi.json")).json()["paths"]
    bodies = {"/v1/completions": "CompletionResponse", "/v1/chat/completions": "ChatCompletionResponse",
              "/tokenize": "TokenizeResponse", "/detokenize": "DetokenizeResponse"}
    for path, model in bodies.items():
        responses = paths[path]["post"]["responses"]
        assert responses["200"]["content"]["application/json"]["schema"]["$ref"].endswith(model)
        expected_errors = {"400", "404", "default"} | ({"401"} if path.startswith("/v1") else set())
        assert set(responses) == {"200"} | expected_errors, path
        for status in expected_errors:
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
        streams = "text/event-stream" in responses["200"]["content"]
        assert streams == path.startswith("/v1"), path
