"""The batch sampler: greedy, seeded sampling, truncation, penalties and logprobs."""

import numpy as np
import pytest

from fastdeploy.model_executor.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k_top_p,
    gather_logprobs,
    log_softmax,
    seen_token_counts,
)

V = 50


def logits(rows=3, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, V)).astype(np.float32)


def test_greedy_is_argmax():
    x = logits()
    out = Sampler()(x, SamplingMetadata(temperature=np.zeros(3, np.float32), all_greedy=True))
    assert out.sampled_token_ids.tolist() == x.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_batch():
    x = logits(4)
    md = lambda rows, seeds: SamplingMetadata(  # noqa: E731
        temperature=np.ones(rows, np.float32),
        all_greedy=False,
        generators={i: np.random.default_rng(s) for i, s in enumerate(seeds)},
    )
    alone = [Sampler()(x[i : i + 1], md(1, [7])).sampled_token_ids[0] for i in [2]]
    together = Sampler()(x[[1, 2]], md(2, [3, 7])).sampled_token_ids
    assert together[1] == alone[0]


def test_top_k_one_is_greedy_and_top_p_keeps_minimal_prefix():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]], dtype=np.float32)
    kept = apply_top_k_top_p(probs, np.array([1]), None)
    assert np.count_nonzero(kept) == 1 and kept[0, 0] == 0.5
    kept = apply_top_k_top_p(probs, None, np.array([0.8], np.float32))
    assert np.nonzero(kept[0])[0].tolist() == [0, 1]
    # top_p after top_k renormalises over the top-k tokens.
    kept = apply_top_k_top_p(probs, np.array([2]), np.array([0.6], np.float32))
    assert np.nonzero(kept[0])[0].tolist() == [0]


def test_min_p_and_temperature_sampling_stay_in_support():
    x = np.full((1, V), -10.0, np.float32)
    x[0, [3, 9]] = [5.0, 4.9]
    md = SamplingMetadata(temperature=np.ones(1, np.float32), all_greedy=False, min_p=np.array([0.5], np.float32))
    seen = {int(Sampler()(x, md).sampled_token_ids[0]) for _ in range(50)}
    assert seen <= {3, 9} and len(seen) == 2


def test_penalties_follow_vllm_semantics():
    x = np.zeros((1, V), np.float32)
    x[0, 1] = 2.0
    x[0, 2] = -2.0
    ids, counts = seen_token_counts(np.array([1]), np.array([2, 2]))
    md = SamplingMetadata(
        temperature=np.zeros(1, np.float32),
        all_greedy=True,
        repetition_penalties=np.array([2.0], np.float32),
        presence_penalties=np.array([0.5], np.float32),
        frequency_penalties=np.array([0.25], np.float32),
        penalty_token_rows=np.zeros(len(ids), np.int64),
        penalty_token_ids=ids,
        output_token_counts=counts,
    )
    out = Sampler.apply_logits_processors(x.copy(), md)
    assert out[0, 1] == pytest.approx(1.0)  # prompt token: positive logit divided
    assert out[0, 2] == pytest.approx(-4.0 - 0.5 - 0.5)  # output token x2: multiplied, presence, frequency*2


def test_logit_bias_allowed_bad_words_and_min_tokens():
    x = np.zeros((2, V), np.float32)
    md = SamplingMetadata(
        temperature=np.zeros(2, np.float32),
        all_greedy=True,
        logit_bias=(np.array([0]), np.array([7]), np.array([100.0], np.float32)),
        allowed_token_ids=(np.array([1, 1]), np.array([4, 5])),
        # Row 0's bad word [7] and row 1's stop token 5 under min_tokens.
        blocked_token_ids=(np.array([0, 1]), np.array([7, 5])),
    )
    out = Sampler()(x, md).sampled_token_ids.tolist()
    assert out[0] != 7 and out[1] == 4


def test_logprobs_rank_and_topk_include_chosen():
    x = logits(2)
    lp = log_softmax(x)
    chosen = np.array([int(np.argsort(-lp[0])[3]), int(lp[1].argmax())])
    res = gather_logprobs(lp, chosen, 2)
    assert res.token_ids.shape == (2, 3)
    assert res.ranks.tolist() == [4, 1]
    assert res.token_ids[0, 0] == chosen[0] and res.token_ids[0, 1] == lp[0].argmax()
    assert np.allclose(np.exp(lp).sum(-1), 1.0, atol=1e-5)
    full = gather_logprobs(lp, chosen, -1)
    assert full.token_ids.shape == (2, V + 1)
