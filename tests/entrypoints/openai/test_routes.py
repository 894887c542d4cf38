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


def test_model_cards_show_the_name_the_model_was_given(server, client):
    # root is the model as the user named it (vLLM's), not the folder it resolved to.
    assert client.models.list().data[0].root == MODEL_NAME
    card = client.models.retrieve(MODEL_NAME)
    assert (card.id, card.root) == (MODEL_NAME, MODEL_NAME)
    r = httpx.get(server.url_for("v1", "models", "no-such-model"), headers=server.headers)
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `no-such-model` does not exist."


def test_tokenize_sends_token_strs_as_null_unless_asked(server):
    body = httpx.post(server.url_for("tokenize"), json={"prompt": "Hello world"}).json()
    assert "token_strs" in body and body["token_strs"] is None


def test_invocations_serves_the_request_type_the_body_is(server, client):
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(server.url_for("invocations"), json=chat, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    expected = client.chat.completions.create(**chat).model_dump()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    r = httpx.post(server.url_for("invocations"), json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = httpx.post(server.url_for("invocations"), json={"input": "neither"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("Cannot find suitable handler for request. Expected one of: "
                                            "['ChatCompletionRequest', 'CompletionRequest']")
    r = httpx.post(server.url_for("invocations"), content=b"{oops", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("JSON decode error: ")


def test_a_body_that_is_not_json_is_a_400(server):
    r = httpx.post(server.url_for("v1", "completions"), content=b"prompt=x",
                   headers={**server.headers, "Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    assert "Only 'application/json' is allowed" in r.json()["error"]["message"]


def test_per_request_metrics_in_responses(server, client):
    """--enable-per-request-metrics: the timings of a one-sequence request; null for n > 1 (vLLM's)."""
    fields = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    metrics = completion.model_extra["metrics"]
    assert set(metrics) == fields and all(v is not None and v >= 0 for v in metrics.values())
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / 3)
    two = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2, n=2, temperature=1)
    assert two.model_extra["metrics"] is None
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert [c.model_extra.get("metrics") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert set(chunks[-1].model_extra["metrics"]) == fields


def test_vllm_metric_names(server, client):
    client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)
    text = httpx.get(server.url_for("metrics")).text
    for name in ("vllm:request_params_n_count", "vllm:request_num_preemptions_count",
                 f'vllm:num_requests_waiting_by_reason{{engine="0",model_name="{MODEL_NAME}",reason="capacity"}}',
                 'reason="deferred"', "kv_cache_size_tokens=", "kv_cache_max_concurrency="):
        assert name in text, name
    assert server.metric("vllm:request_params_n_count") >= 1
