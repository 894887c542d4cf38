"""Speculative decoding end to end on tiny random checkpoints: output identical to plain decoding.

Every method runs a mixed batch (long prompts prefilled in chunks next to verifying decodes,
prompts sharing a cached prefix, a KV pool small enough to preempt) and must give, greedy,
token for token what decoding without speculation gives; sampling keeps the distribution.
"""

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from tests.model_executor.utils import build_tiny_checkpoint
from tests.spec_decode.test_rejection_sampler import chi_square, chi_square_critical

VOCAB = 64
K = 3
_KW = dict(skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=128,
           max_num_batched_tokens=32, enable_chunked_prefill=True)
# Bytes of one 4-token KV block of the tiny model (fp32, 2 layers, 2 KV heads of 16).
_BLOCK_BYTES = 2 * 2 * 4 * 2 * 16 * 4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    target = build_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("target"), vocab_size=VOCAB, std=0.5)
    other = build_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("draft"), seed=1, vocab_size=VOCAB,
                                  std=0.5)
    return target, other


def _prompts():
    rng = np.random.default_rng(3)
    shared = rng.integers(1, VOCAB, size=24).tolist()
    loop = [5, 9, 2, 7, 11]
    return [
        loop * 6,                                          # repeats itself: ngram / suffix drafts hit
        shared + [3, 4],                                   # these two share a cached prefix
        shared + [8],
        rng.integers(1, VOCAB, size=70).tolist(),          # prefilled in chunks of the 32-token budget
        [4, 4, 4, 4],
        rng.integers(1, VOCAB, size=9).tolist(),
    ]


GREEDY_KW = dict(temperature=0, max_tokens=36, ignore_eos=True)
GREEDY = SamplingParams(**GREEDY_KW)


def _run(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def reference(checkpoints):
    llm = LLM(checkpoints[0], kv_cache_memory_bytes=4096 * _BLOCK_BYTES, **_KW)
    return llm, _run(llm, _prompts())


def _spec_llm(checkpoints, method, draft=None, num_blocks=4096, **extra):
    config = {"method": method, "num_speculative_tokens": K, **extra}
    if draft is not None:
        config["model"] = draft
    per_block = _BLOCK_BYTES * (2 if method == "draft_model" else 1)
    return LLM(checkpoints[0], speculative_config=config, kv_cache_memory_bytes=num_blocks * per_block, **_KW)


@pytest.mark.parametrize("method, draft, acceptance", [
    ("ngram", None, None),
    ("suffix", None, None),
    ("draft_model", "target", (0.9, 1.0)),
    ("draft_model", "other", (0.0, 0.35)),
])
def test_greedy_identical_to_plain_decoding(checkpoints, reference, method, draft, acceptance):
    draft_path = {"target": checkpoints[0], "other": checkpoints[1], None: None}[draft]
    extra = {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {}
    llm = _spec_llm(checkpoints, method, draft_path, **extra)
    prompts = _prompts()
    assert _run(llm, prompts) == reference[1]
    # Again: now the shared prefixes are prefix-cache hits.
    assert _run(llm, prompts) == reference[1]
    totals = llm.llm_engine.spec_decode_totals
    assert totals.stats.num_drafts > 0
    if acceptance is not None:
        lo, hi = acceptance
        assert lo <= totals.acceptance_rate <= hi, totals.stats
    if method == "ngram":
        # The self-repeating prompt's continuation is drafted from its own text.
        assert totals.stats.num_accepted_tokens > 0


@pytest.fixture(scope="module")
def spec_llms(checkpoints):
    """ngram (prompt lookup) and the target as its own draft model, built once for the module."""
    return {"ngram": _spec_llm(checkpoints, "ngram", prompt_lookup_min=1, prompt_lookup_max=3),
            "draft_model": _spec_llm(checkpoints, "draft_model", checkpoints[0])}


def _output_dependent_params(setting: str, reference_outputs: list[list[int]]) -> SamplingParams:
    """Greedy settings that read the output so far, chosen to change the reference outputs."""
    if setting == "min_tokens":
        # Tokens the reference outputs produce early are stop tokens, masked for the first 12 outputs.
        return SamplingParams(temperature=0, max_tokens=36, ignore_eos=True, min_tokens=12,
                              stop_token_ids=[reference_outputs[0][2], reference_outputs[3][1]])
    if setting == "bad_words":
        params = SamplingParams(**GREEDY_KW)
        # The engine's tokenised form (skip_tokenizer_init leaves no tokenizer for bad_words strings):
        # two-token words from the reference outputs, so their prefixes match inside verified runs.
        params._bad_words_token_ids = [reference_outputs[0][3:5], reference_outputs[3][4:6], [reference_outputs[5][7]]]
        return params
    return SamplingParams(**{**GREEDY_KW, setting: {"repetition_penalty": 1.3, "presence_penalty": 0.6,
                                                    "frequency_penalty": 0.4}[setting]})


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("setting", ["repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens",
                                     "bad_words"])
def test_output_dependent_settings_speculate_with_identical_output(reference, spec_llms, setting, method):
    """Penalties, min_tokens and bad words read the output so far: each verified position is sampled as
    if the drafts before it were accepted, so the output is plain decoding's and drafts are still kept.

    The target drafting for itself keeps most drafts, so many positions sample after accepted drafts:
    counting those drafts wrongly (or not at all) changes its output for every one of the settings.
    """
    params = _output_dependent_params(setting, reference[1])
    prompts = _prompts()
    expected = _run(reference[0], prompts, params)
    assert expected != reference[1]  # the setting bites
    llm = spec_llms[method]
    stats = llm.llm_engine.spec_decode_totals.stats
    before = stats.num_draft_tokens, stats.num_accepted_tokens
    assert _run(llm, prompts, params) == expected
    drafted, accepted = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert drafted > 0 and accepted > (0 if method == "ngram" else drafted // 2), (drafted, accepted)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_preemption_keeps_outputs_identical(checkpoints, method):
    prompts = _prompts() * 2
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    plain = LLM(checkpoints[0], kv_cache_memory_bytes=40 * _BLOCK_BYTES, **_KW)
    expected = _run(plain, prompts, params)
    assert plain.llm_engine.last_stats.num_preemptions > 0
    extra = {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {}
    llm = _spec_llm(checkpoints, method, checkpoints[0] if method == "draft_model" else None, num_blocks=40, **extra)
    assert _run(llm, prompts, params) == expected
    assert llm.llm_engine.last_stats.num_preemptions > 0


def test_logprobs_of_accepted_tokens(checkpoints, reference):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    prompts = _prompts()[:3]
    plain = reference[0].generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = _spec_llm(checkpoints, "draft_model", checkpoints[0])
    spec = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.llm_engine.spec_decode_totals.stats.num_accepted_tokens > 0
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(pa) == list(pb)
            for tok in pa:
                assert abs(pa[tok].logprob - pb[tok].logprob) < 1e-4 and pa[tok].rank == pb[tok].rank


@pytest.mark.parametrize("penalties", [{}, {"presence_penalty": 1.5}], ids=["plain", "presence_penalty"])
def test_sampled_distribution_matches_plain_decoding(checkpoints, reference, penalties):
    """Tokens 2..4 of many sampled answers (verified from drafts) are distributed as without speculation.

    Seeded, with disjoint seeds for the two runs (each of the n answers draws from its own seed), so
    the samples are independent and the verdict does not change from run to run: unseeded, a correct
    sampler still failed the 0.1% test now and then in CI.
    """
    prompt = [{"prompt_token_ids": [3, 14, 15, 9, 2]}]
    n = 1500
    kw = dict(temperature=1.0, top_k=20, max_tokens=4, ignore_eos=True, n=n, **penalties)
    plain = np.array([o.token_ids for o in reference[0].generate(prompt, SamplingParams(seed=0, **kw))[0].outputs])
    llm = _spec_llm(checkpoints, "draft_model", checkpoints[0])
    spec = np.array([o.token_ids for o in llm.generate(prompt, SamplingParams(seed=n, **kw))[0].outputs])
    totals = llm.llm_engine.spec_decode_totals
    # Both verification outcomes occur: drafts accepted and rejected (then resampled).
    assert 0.1 < totals.acceptance_rate < 0.95, totals.stats
    for pos in range(1, 4):
        a, b = np.bincount(plain[:, pos], minlength=VOCAB), np.bincount(spec[:, pos], minlength=VOCAB)
        # Rare tokens pooled into one bin so every bin's expected count is large enough.
        rare = (a + b) < 20
        a = np.r_[a[~rare], a[rare].sum()]
        b = np.r_[b[~rare], b[rare].sum()]
        stat, df = chi_square(a, b)
        assert stat < chi_square_critical(df), (pos, stat, df)


@pytest.mark.parametrize("draft, penalties", [
    (1, {}),
    # Penalised: the target as its own draft, so many verified runs sample past accepted drafts.
    (0, {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.2}),
])
def test_seeded_sampling_is_reproducible(checkpoints, draft, penalties):
    llm = _spec_llm(checkpoints, "draft_model", checkpoints[draft])
    params = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, n=2, seed=1234, **penalties)
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:3]]
    first = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    second = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    assert first == second
    assert first[0][0] != first[0][1]  # n=2 children sample independently
    assert llm.llm_engine.spec_decode_totals.stats.num_accepted_tokens > 0


def test_disable_by_batch_size(checkpoints, reference):
    llm = _spec_llm(checkpoints, "draft_model", checkpoints[0], disable_by_batch_size=2)
    assert _run(llm, _prompts()) == reference[1]
    busy = llm.llm_engine.spec_decode_totals.stats.num_drafts
    _run(llm, _prompts()[:1])
    alone = llm.llm_engine.spec_decode_totals.stats.num_drafts - busy
    # Six requests at once draft only once the batch has drained to two; one alone drafts every step.
    assert alone >= 30 / (K + 1)
    assert busy < 36


def test_draft_with_another_vocabulary_fails_at_start_up(checkpoints, tmp_path):
    bigger = build_tiny_checkpoint("LlamaForCausalLM", tmp_path, vocab_size=VOCAB * 2)
    with pytest.raises(ValueError, match="vocabulary"):
        _spec_llm(checkpoints, "draft_model", bigger)


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "medusa"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "mtp"),
])
def test_bad_configs_fail_at_start_up(checkpoints, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(checkpoints[0], speculative_config=config, **_KW)
