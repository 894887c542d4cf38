"""LLM on the real SmolLM2: chat, batching invariance, chunked prefill, prefix caching, preemption,
sampling controls and output shapes."""

import pytest

from fastdeploy import LLM, SamplingParams
from fastdeploy.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village nestled between two mountains, there lived an old clockmaker who",
    "def fibonacci(n):",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
    "Translate to French: good morning",
    "List three primary colors:",
    "In 1492,",
    "The best way to learn a new language is to practice every day, read books, watch films and",
    "Hello! My name is",
    "import numpy as np\n\nx = np.",
    "Roses are red,",
    "The mitochondria is",
    "Photosynthesis converts sunlight into",
]


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_chat_answers_paris(smol_llm):
    # Greedy answers of this 135M model sit at near-ties for some phrasings: "What is the capital of France?"
    # flips between the dequantized path ("The capital ...") and the GGUF blocks ("L'...") on a 0.04-nat
    # margin, and the dequantized path itself misses "What is the capital city of France?". Both paths
    # answer this phrasing with "The capital of France is Paris."
    out = smol_llm.chat(
        [{"role": "user", "content": "Name the capital of France."}],
        SamplingParams(temperature=0.0, max_tokens=20),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"
    # The legacy single-output form keeps working.
    assert out[0].outputs.text == out[0].outputs[0].text


def test_batch_invariance_and_chunked_prefill(smol_llm):
    together = token_ids(smol_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    alone = [token_ids(smol_llm.generate(p, GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert together == alone
    chunked = LLM(
        max_model_len=2048, kv_cache_memory_bytes=128 << 20, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    assert token_ids(chunked.generate(PROMPTS[:6], GREEDY, use_tqdm=False)) == alone[:6]


def test_prefix_caching_hits_and_matches_uncached(smol_llm):
    prefix = "You are a meticulous assistant. " * 12
    smol_llm.generate(prefix + "Tell me a fact about owls.", GREEDY, use_tqdm=False)
    second = smol_llm.generate(prefix + "Tell me a fact about cats.", GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    uncached = LLM(max_model_len=1024, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
    ref = uncached.generate(prefix + "Tell me a fact about cats.", GREEDY, use_tqdm=False)[0]
    assert ref.num_cached_tokens == 0
    assert second.outputs[0].token_ids == ref.outputs[0].token_ids


def test_preemption_keeps_outputs(smol_llm):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    expected = token_ids(smol_llm.generate(PROMPTS[:8], params, use_tqdm=False))
    # 8 requests of up to ~70 tokens need ~40 blocks of 16; give the cache 12 (of the fixture's dtype).
    per_block = smol_llm.llm_engine.engine_core.worker.model_runner.kv_cache_bytes_per_block()
    small = LLM(max_model_len=128, block_size=16, kv_cache_memory_bytes=12 * per_block, enable_prefix_caching=False)
    engine = small.llm_engine.engine_core
    assert engine.fd_config.cache_config.num_blocks == 12
    assert token_ids(small.generate(PROMPTS[:8], params, use_tqdm=False)) == expected
    assert engine.scheduler.num_preemptions > 0


def test_seeded_sampling_is_reproducible_and_n(smol_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    a = smol_llm.generate(PROMPTS[0], sp, use_tqdm=False)[0].outputs[0].token_ids
    # The same seed inside a different batch gives the same tokens.
    batch = smol_llm.generate(
        [PROMPTS[3], PROMPTS[0]], [SamplingParams(temperature=0.8, max_tokens=16), sp], use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == a
    four = smol_llm.generate(PROMPTS[0], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)[0]
    assert [c.index for c in four.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in four.outputs}) > 1


def test_stop_strings_and_stop_reason(smol_llm):
    base = smol_llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0].outputs[0]
    stop = base.text.strip().split()[1]
    out = smol_llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and stop not in c.text
    inc = smol_llm.generate(
        PROMPTS[2],
        SamplingParams(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert inc.text.endswith(stop)
    length = smol_llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert length.finish_reason == "length" and len(length.token_ids) == 5


def test_logprobs_and_prompt_logprobs(smol_llm):
    out = smol_llm.generate(
        {"prompt_token_ids": [504, 3575, 282, 4649, 314]},
        SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the top token
        assert len(lp) == 3
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True))
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 5
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
        assert tok in lp and 2 <= len(lp) <= 3


def test_logprob_token_ids(smol_llm):
    """vLLM's SamplingParams.logprob_token_ids: each position has the sampled token and exactly the ids asked
    for, with their logprobs and ranks over the whole vocabulary (checked against a whole-vocabulary run)."""
    prompt = {"prompt_token_ids": [504, 3575, 282, 4649, 314]}
    asked = [100, 1000, 5000]
    c = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprob_token_ids=asked),
                          use_tqdm=False)[0].outputs[0]
    full = smol_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=20),
                             use_tqdm=False)[0].outputs[0]
    assert c.token_ids == full.token_ids and len(c.logprobs) == 3
    for tok, lp, ref in zip(c.token_ids, c.logprobs, full.logprobs, strict=True):
        assert list(lp) == [tok, *asked]
        assert lp[tok].rank == 1 and lp[tok].logprob == pytest.approx(ref[tok].logprob, abs=1e-5)
        assert all(lp[t].rank > 20 and lp[t].logprob < min(r.logprob for r in ref.values()) for t in asked)
        assert lp[asked[0]].decoded_token == smol_llm.get_tokenizer().decode([asked[0]])
    assert c.cumulative_logprob == pytest.approx(full.cumulative_logprob, abs=1e-4)


def test_min_tokens_bad_words_and_penalties(smol_llm):
    chat = [{"role": "user", "content": "Say OK."}]
    short = smol_llm.chat(chat, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    longer = smol_llm.chat(
        chat, SamplingParams(temperature=0, max_tokens=30, min_tokens=len(short.token_ids) + 3), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 3
    first_word = short.text.split()[0]
    banned = smol_llm.chat(chat, SamplingParams(temperature=0, max_tokens=10, bad_words=[first_word]), use_tqdm=False)[
        0
    ].outputs[0]
    assert not banned.text.startswith(first_word)
    rep = smol_llm.generate(
        PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.5), use_tqdm=False
    )[0].outputs[0]
    base = smol_llm.generate(PROMPTS[2], GREEDY, use_tqdm=False)[0].outputs[0]
    assert rep.token_ids != base.token_ids


def test_output_kinds_and_inputs(smol_llm):
    outs = smol_llm.generate([{"prompt": "Hi"}, {"prompt_token_ids": [1, 4093, 198]}], GREEDY, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[1].prompt_token_ids == [1, 4093, 198]
    with pytest.raises(ValueError, match="lengths of prompts and sampling_params"):
        smol_llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        smol_llm.generate({"prompt_token_ids": [5] * 3000}, GREEDY)
    with pytest.raises(ValueError, match="out of vocabulary"):
        smol_llm.generate({"prompt_token_ids": [10**6]}, GREEDY)
    # The engine is still healthy after rejected inputs.
    assert smol_llm.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine = smol_llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta", "Hello", sp)
    pieces = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].token_ids)
    assert sum(len(p) for p in pieces) == 6 and all(len(p) <= 1 for p in pieces)


def _same_prompt_logprobs(got, want) -> None:
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for g, w in zip(got[1:], want[1:], strict=True):
        assert list(g) == list(w)  # the chosen token first, then the same top-k in the same order
        for tok in w:
            assert g[tok].rank == w[tok].rank
            assert g[tok].logprob == pytest.approx(w[tok].logprob, abs=1e-4)


def test_prompt_logprobs_from_the_prefix_cache_match_a_cold_run(smol_llm):
    """lm-eval's loglikelihood shape: choices sharing their whole context, echo + logprobs.

    The shared context's KV and its prompt logprobs come from the prefix cache, and the
    response is what a request computed from scratch returns.
    """
    tok = smol_llm.get_tokenizer()
    context = tok.encode("The following are multiple choice questions about astronomy.\n\n" * 3
                         + "Where do short-period comets come from?\nA. Kuiper belt\nB. Oort cloud\nAnswer:",
                         add_special_tokens=False)
    prompts = [{"prompt_token_ids": context + tok.encode(c, add_special_tokens=False)} for c in (" A", " B", " C")]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    cold = []
    for prompt in prompts:
        smol_llm.reset_prefix_cache()
        out = smol_llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        cold.append(out.prompt_logprobs)
    smol_llm.reset_prefix_cache()
    # Submitted together: the first computes the context, the others wait a step and reuse it.
    together = smol_llm.generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens > 0 for o in together] == [False, True, True]
    for out, want in zip(together, cold, strict=True):
        _same_prompt_logprobs(out.prompt_logprobs, want)
    # The same prompt again: served from the cache, the very same logprobs.
    again = smol_llm.generate(prompts[0], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    _same_prompt_logprobs(again.prompt_logprobs, together[0].prompt_logprobs)
    # Another top-k width is not in the cache: computed, still right.
    wider = smol_llm.generate(prompts[1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
                              use_tqdm=False)[0]
    assert wider.num_cached_tokens == 0
    assert all(len(lp) >= 3 for lp in wider.prompt_logprobs[1:])
