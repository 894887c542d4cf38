"""/v1/completions end to end: SDK sync/async/stream, token-id prompts, n, usage, echo + logprobs."""

from __future__ import annotations

import httpx
import pytest
from remote_server import MODEL_NAME

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def test_completion_basic(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    assert completion.id.startswith("cmpl-")
    assert completion.object == "text_completion"
    assert completion.model == MODEL_NAME
    choice = completion.choices[0]
    assert choice.text.startswith(" Paris")
    assert choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == 5
    assert completion.usage.completion_tokens == 5
    assert completion.usage.total_tokens == 10


def test_model_may_be_omitted(server):
    r = httpx.post(server.url_for("v1", "completions"), headers=server.headers,
                   json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["model"] == MODEL_NAME


def test_usage_matches_tokenizer(client, server):
    prompt = "Count the tokens of this prompt, please."
    tokens = httpx.post(server.url_for("tokenize"), json={"prompt": prompt}).json()["tokens"]
    completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0)
    assert completion.usage.prompt_tokens == len(tokens)


def test_stream_equals_non_stream_with_seed(client):
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=1234)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("seed", [-421, -(2**63), 2**63 - 1])
def test_any_int64_seed_samples_reproducibly(client, seed):
    """vLLM takes any int64 seed; a negative one once killed the engine core (found by the fuzz test)."""
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=seed, n=2)
    first = [c.text for c in client.completions.create(**kwargs).choices]
    assert [c.text for c in client.completions.create(**kwargs).choices] == first


def test_stream_include_usage(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, n=3, temperature=1.0, seed=7)
    assert sorted(c.index for c in completion.choices) == [0, 1, 2]
    assert completion.usage.completion_tokens == sum(4 for _ in completion.choices)


def test_n_stream(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, n=3, temperature=1.0,
                                            stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1, 2}


def test_token_id_prompts(client, server):
    ids = httpx.post(server.url_for("tokenize"), json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == len(ids) + 3


def test_list_of_text_prompts(client):
    batch = client.completions.create(model=MODEL_NAME, prompt=["Hello", "The sky is"], max_tokens=2, temperature=0)
    assert len(batch.choices) == 2


def test_echo_logprobs_one_entry_per_prompt_token(client, server):
    ids = httpx.post(server.url_for("tokenize"), json={"prompt": PROMPT}).json()["tokens"]
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                           logprobs=1)
    choice = completion.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT)
    assert len(lp.token_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None
    assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None
    # Every top_logprobs entry holds the chosen token.
    for token, tops in zip(lp.tokens[1:], lp.top_logprobs[1:], strict=True):
        assert token in tops
    assert lp.text_offset[0] == 0


def test_echo_max_tokens_zero_returns_only_the_prompt(client, server):
    ids = httpx.post(server.url_for("tokenize"), json={"prompt": PROMPT}).json()["tokens"]
    completion = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=0, temperature=0, echo=True,
                                           logprobs=0)
    choice = completion.choices[0]
    assert choice.text == PROMPT
    assert len(choice.logprobs.token_logprobs) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    assert completion.usage.completion_tokens == 0


def test_echo_logprobs_match_greedy_continuation(client):
    """The logprob of the greedy continuation, read by echo, equals the sampled token's logprob."""
    gen = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    token_lp = gen.choices[0].logprobs.token_logprobs[0]
    echo = client.completions.create(model=MODEL_NAME, prompt=PROMPT + gen.choices[0].text, max_tokens=0, echo=True,
                                     logprobs=1, temperature=0)
    assert echo.choices[0].logprobs.token_logprobs[-1] == pytest.approx(token_lp, abs=1e-3)


def test_echo_stream(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                            stream=True, logprobs=0))
    text = "".join(c.choices[0].text for c in chunks)
    assert text.startswith(PROMPT)
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_stop_string(client):
    completion = client.completions.create(model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=20, temperature=0,
                                           stop=[" 6"])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert " 6" not in choice.text
    assert choice.model_extra["stop_reason"] == " 6"


def test_tokens_as_token_ids(client):
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=2,
                                           extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = completion.choices[0]
    assert all(t.startswith("token_id:") for t in choice.logprobs.tokens)
    assert len(choice.model_extra["token_ids"]) == 2


def test_prompt_tokens_details(client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT * 8, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT * 8, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_extra_vllm_sampling_fields(client):
    completion = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.7,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
                    "skip_special_tokens": True, "stop_token_ids": [2], "bad_words": ["London"],
                    "include_stop_str_in_output": False, "allowed_token_ids": None, "truncate_prompt_tokens": 3,
                    "add_special_tokens": True, "some_unknown_field": 1})
    assert completion.usage.prompt_tokens == 3
    assert completion.usage.completion_tokens == 4


@pytest.mark.anyio
async def test_async_client(server):
    async with server.get_async_client() as client:
        completion = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0)
        stream = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                                 stream=True)
        text = "".join([c.choices[0].text async for c in stream])
    assert completion.choices[0].text.startswith(" Paris")
    assert text == completion.choices[0].text


def test_use_beam_search(client):
    greedy = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    # One beam is greedy search.
    one = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, n=1,
                                    extra_body={"use_beam_search": True, "ignore_eos": True})
    assert one.choices[0].text == greedy.choices[0].text
    beams = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, n=3,
                                      extra_body={"use_beam_search": True, "length_penalty": 1.0, "ignore_eos": True})
    texts = [c.text for c in beams.choices]
    assert len(texts) == 3 and len(set(texts)) == 3


# ---- vLLM's extension fields ----------------------------------------------------------------
def test_prompt_logprobs_on_each_choice(client, server):
    """prompt_logprobs on every choice, as vLLM puts them: None first, then {token id: logprob, rank, text}."""
    ids = httpx.post(server.url_for("tokenize"), json={"prompt": "My name is"}).json()["tokens"]
    completion = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "My name is"], max_tokens=1,
                                           temperature=0, extra_body={"prompt_logprobs": 1})
    for choice in completion.choices:
        assert choice.prompt_logprobs[0] is None and len(choice.prompt_logprobs) > 1
    second = completion.choices[1].prompt_logprobs
    assert len(second) == len(ids)
    for token_id, entry in zip(ids[1:], second[1:], strict=True):
        # The prompt token and the top 1 (the same token when it ranks first).
        assert str(token_id) in entry and 1 <= len(entry) <= 2
        assert set(entry[str(token_id)]) == {"logprob", "rank", "decoded_token"}
    # Not asked for: null, and still an attribute of the SDK's choice.
    assert client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1).choices[0].prompt_logprobs is None


def test_whole_vocabulary_prompt_logprobs_refused(server):
    """-1 means the whole vocabulary, more than --max-logprobs (20) allows: vLLM's 400."""
    r = httpx.post(server.url_for("v1", "completions"), headers=server.headers,
                   json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": -1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Requested prompt logprobs of 49152, which is greater than max allowed: 20"
    assert r.json()["error"]["param"] == "prompt_logprobs"


def test_extension_fields_are_null_when_not_asked_for(server):
    body = httpx.post(server.url_for("v1", "completions"), headers=server.headers,
                      json={"prompt": PROMPT, "max_tokens": 1}).json()
    choice = body["choices"][0]
    assert {k: choice[k] for k in ("prompt_logprobs", "prompt_token_ids", "token_ids", "stop_reason")} == dict.fromkeys(
        ("prompt_logprobs", "prompt_token_ids", "token_ids", "stop_reason"))
    assert body["service_tier"] is None and body["kv_transfer_params"] is None


def test_return_token_ids_stream_and_whole(client, server):
    ids = httpx.post(server.url_for("tokenize"), json={"prompt": PROMPT}).json()["tokens"]
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"return_token_ids": True})
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.prompt_token_ids == ids and len(whole.token_ids) == 4
    chunks = list(client.completions.create(stream=True, **kwargs))
    # The prompt's ids come with the first chunk only; each chunk has its own new token ids.
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == whole.token_ids


def test_truncation_side(client):
    """vLLM's truncation_side: "right" keeps the first tokens, "left" (the default) the last."""
    ids = list(range(100, 108))

    def kept(**extra):
        return client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=1, temperature=0, extra_body={
            "return_token_ids": True, "truncate_prompt_tokens": 4, **extra}).choices[0].prompt_token_ids

    assert kept(truncation_side="right") == ids[:4]
    assert kept(truncation_side="left") == kept() == ids[-4:]


def test_stream_usage_only_as_asked(client):
    """vLLM's stream_options: none (even {}) means no usage; continuous_usage_stats needs include_usage."""
    def usages(options):
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                                stream=True, stream_options=options))
        return [None if c.usage is None else c.usage.completion_tokens for c in chunks]

    assert usages({}) == usages({"include_usage": False, "continuous_usage_stats": True}) == [None] * 3
    assert usages({"include_usage": True, "continuous_usage_stats": True}) == [1, 2, 3, 3]


def test_logprob_token_ids(client, server):
    """vLLM's logprob_token_ids: each position's top_logprobs hold the chosen token and exactly the asked ids."""
    asked = [100, 1000, 5000]
    choice = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=3,
                                       extra_body={"logprob_token_ids": asked, "return_tokens_as_token_ids": True,
                                                   "return_token_ids": True}).choices[0]
    for token_id, tops in zip(choice.token_ids, choice.logprobs.top_logprobs, strict=True):
        assert list(tops) == [f"token_id:{t}" for t in [token_id, *asked]]
        assert all(-9999 < v <= 0 for v in tops.values())
    r = httpx.post(server.url_for("v1", "completions"), headers=server.headers,
                   json={"prompt": PROMPT, "max_tokens": 1, "logprob_token_ids": asked})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_token_ids"
