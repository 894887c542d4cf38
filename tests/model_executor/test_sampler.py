"""The batch sampler: greedy, seeded sampling, truncation, penalties and logprobs."""

import numpy as np
import pytest

from fastdeploy import _custom_ops
from fastdeploy.model_executor.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_top_k_top_p,
    gather_logprobs,
    inverse_cdf_sample,
    log_softmax,
    logprobs_of_rows,
    seen_token_counts,
)

V = 50
# The random paths run on numpy, and on csrc/cpu/sampling.cc where it is built (the platform's choice).
KERNELS = [False] + ([True] if _custom_ops.has("fd_sample_random") else [])


@pytest.fixture(params=KERNELS, ids=lambda k: "csrc" if k else "numpy")
def kernels(request):
    return request.param


def logits(rows=3, seed=0):
    return np.random.default_rng(seed).standard_normal((rows, V)).astype(np.float32)


def test_greedy_is_argmax():
    x = logits()
    out = Sampler()(x, SamplingMetadata(temperature=np.zeros(3, np.float32), all_greedy=True))
    assert out.sampled_token_ids.tolist() == x.argmax(-1).tolist()


def test_seeded_rows_do_not_depend_on_batch(kernels):
    x = logits(4)
    md = lambda rows, seeds: SamplingMetadata(  # noqa: E731
        temperature=np.ones(rows, np.float32),
        all_greedy=False,
        generators={i: np.random.default_rng(s) for i, s in enumerate(seeds)},
    )
    alone = [Sampler(kernels)(x[i : i + 1], md(1, [7])).sampled_token_ids[0] for i in [2]]
    together = Sampler(kernels)(x[[1, 2]], md(2, [3, 7])).sampled_token_ids
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


def test_min_p_and_temperature_sampling_stay_in_support(kernels):
    x = np.full((1, V), -10.0, np.float32)
    x[0, [3, 9]] = [5.0, 4.9]
    md = SamplingMetadata(temperature=np.ones(1, np.float32), all_greedy=False, min_p=np.array([0.5], np.float32))
    seen = {int(Sampler(kernels)(x, md).sampled_token_ids[0]) for _ in range(50)}
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


def test_logprob_token_ids_replace_the_top_k_of_their_rows_only():
    """vLLM's logprob_token_ids: a row gets the sampled token then the ids it asked for, in its order,
    each with its true rank; the other rows keep their top-k."""
    x = logits(3, seed=4)
    lp = log_softmax(x)
    md = SamplingMetadata(temperature=np.zeros(3, np.float32), all_greedy=True, max_num_logprobs=3,
                          logprob_token_ids=(np.array([0, 0, 2, 2, 2]), np.array([7, 3, 11, 0, 40])))
    res = Sampler()(x, md).logprobs
    chosen = lp.argmax(-1)
    for row, asked in ((0, [7, 3]), (2, [11, 0, 40])):
        assert res.token_ids[row, 0] == chosen[row]
        assert res.token_ids[row, 1:1 + len(asked)].tolist() == asked
        np.testing.assert_allclose(res.logprobs[row, 1:1 + len(asked)], lp[row, asked])
        assert res.entry_ranks[row, 1:1 + len(asked)].tolist() == [int((lp[row] > lp[row, t]).sum()) + 1
                                                                    for t in asked]
    top = gather_logprobs(lp, chosen, 3)
    np.testing.assert_array_equal(res.token_ids[1], top.token_ids[1])
    assert res.entry_ranks[1].tolist() == [1, 1, 2, 3]
    assert res.entry_ranks[:, 0].tolist() == top.ranks.tolist() == [1, 1, 1]


# ---- the vectorized paths against straightforward per-row references -----------------------
def reference_processors(x, allowed, blocked, bias, penalties):
    """Per row, as a plain loop: allowed ids, blocked ids, logit bias, then penalties."""
    x = x.copy()
    for r in range(len(x)):
        if r in allowed:
            keep = x[r, allowed[r]].copy()
            x[r] = -np.inf
            x[r, allowed[r]] = keep
        x[r, blocked.get(r, [])] = -np.inf
        for tok, b in bias.get(r, {}).items():
            x[r, tok] += np.float32(b)
        if r in penalties:
            rep, pres, freq, prompt, output = penalties[r]
            counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=x.shape[1])
            seen = counts > 0
            seen[prompt] = True
            x[r] = np.where(seen, np.where(x[r] > 0, x[r] / rep, x[r] * rep), x[r])
            x[r] -= freq * counts.astype(np.float32)
            x[r] -= pres * (counts > 0)
    return x


def flat(per_row, with_values=False):
    rows = np.array([r for r, ids in per_row.items() for _ in ids], dtype=np.int64)
    ids = np.array([t for ids in per_row.values() for t in ids], dtype=np.int64)
    if not with_values:
        return rows, ids
    return rows, ids, np.array([v for d in per_row.values() for v in d.values()], dtype=np.float32)


@pytest.mark.parametrize("seed", range(5))
def test_processors_match_per_row_reference(seed):
    rng = np.random.default_rng(seed)
    s, vocab = 12, 300
    x = (rng.standard_normal((s, vocab)) * 3).astype(np.float32)
    allowed = {int(r): rng.choice(vocab, 20).tolist() for r in rng.choice(s, 3, replace=False)}
    blocked = {int(r): np.unique(rng.choice(vocab, 5)).tolist() for r in rng.choice(s, 4, replace=False)}
    bias = {int(r): {int(t): float(rng.uniform(-5, 5)) for t in rng.choice(vocab, 30, replace=False)}
            for r in rng.choice(s, 5, replace=False)}
    penalties = {}
    rep, pres, freq = np.ones(s, np.float32), np.zeros(s, np.float32), np.zeros(s, np.float32)
    entries = ([], [], [])
    for r in rng.choice(s, 7, replace=False).tolist():
        rep[r], pres[r], freq[r] = rng.uniform(0.5, 2.0), rng.uniform(-1, 1), rng.uniform(-1, 1)
        prompt, output = rng.integers(0, vocab, 40), rng.integers(0, vocab // 4, rng.integers(0, 60))
        penalties[r] = (rep[r], pres[r], freq[r], prompt, output)
        ids, counts = seen_token_counts(prompt, output)
        entries[0].append(np.full(len(ids), r))
        entries[1].append(ids)
        entries[2].append(counts)
    md = SamplingMetadata(
        temperature=np.zeros(s, np.float32), all_greedy=True,
        repetition_penalties=rep, presence_penalties=pres, frequency_penalties=freq,
        penalty_token_rows=np.concatenate(entries[0]), penalty_token_ids=np.concatenate(entries[1]),
        output_token_counts=np.concatenate(entries[2]),
        logit_bias=flat(bias, with_values=True), allowed_token_ids=flat(allowed), blocked_token_ids=flat(blocked),
    )
    expected = reference_processors(x, allowed, blocked, bias, penalties)
    np.testing.assert_array_equal(Sampler.apply_logits_processors(x.copy(), md), expected)
    assert Sampler()(x, md).sampled_token_ids.tolist() == expected.argmax(-1).tolist()


def reference_top_k_top_p(probs, top_k, top_p):
    out = np.zeros_like(probs)
    for r, row in enumerate(probs):
        k, p = int(top_k[r]), float(top_p[r])
        use_k = 0 < k < len(row)
        cand = np.argsort(-row, kind="stable")[: k if use_k else len(row)]
        vals = row[cand]
        if p < 1.0:
            cum = np.cumsum(vals, dtype=np.float64)
            cum /= cum[-1] if use_k else row.sum()
            cand = cand[: int(np.searchsorted(cum, np.float32(p))) + 1]
        out[r, cand] = row[cand]
    return out


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_match_per_row_reference(seed):
    rng = np.random.default_rng(seed)
    s, vocab = 24, 5000
    # Peaked rows, flat rows (top-p needs most of the vocabulary: the exact fallback), rows with ties
    # and zeros (min_p), as the sampler hands them over: unnormalised, maximum 1.
    scale = rng.choice([0.1, 1.0, 4.0], s)[:, None]
    probs = np.exp(rng.standard_normal((s, vocab)) * scale).astype(np.float32)
    probs[::5, ::7] = probs[::5, :1]
    probs[1::4] *= probs[1::4] >= np.quantile(probs[1::4], 0.9, axis=-1, keepdims=True)
    probs /= probs.max(-1, keepdims=True)
    top_k = rng.choice([0, 1, 5, 50, 700, vocab], s)
    top_p = rng.choice([1.0, 0.5, 0.9, 0.99], s).astype(np.float32)
    np.testing.assert_array_equal(apply_top_k_top_p(probs, top_k, top_p), reference_top_k_top_p(probs, top_k, top_p))


def test_top_p_over_flat_rows_of_a_real_vocabulary_matches_the_reference(monkeypatch):
    """Top-p that needs most of a 49,152-token vocabulary: the value histogram keeps what a full sort keeps."""
    from fastdeploy.model_executor.layers import sampler

    rng = np.random.default_rng(0)
    vocab = 49152
    logits = rng.standard_normal((8, vocab)) * np.array([0.3, 1.0, 3.0, 1.0, 0.3, 1.0, 3.0, 0.0])[:, None]
    probs = np.exp(logits - logits.max(-1, keepdims=True)).astype(np.float32)
    probs[3, ::2] = 0.0  # min_p zeros
    # Ties across the cut: row 5's at its median value, row 7 a few thousand distinct tokens above 47,152 equal ones.
    probs[5, 1000:30000] = np.median(probs[5])
    probs[7, 2000:] = 0.5
    probs[7, :2000] = np.linspace(1.0, 0.6, 2000)
    top_p = np.array([0.9, 0.95, 0.5, 0.999, 0.99, 0.9, 0.9, 0.9], np.float32)
    histogram_rows = []
    real = sampler._top_p_by_histogram
    monkeypatch.setattr(sampler, "_top_p_by_histogram", lambda p, *a: histogram_rows.append(len(p)) or real(p, *a))
    got = apply_top_k_top_p(probs, None, top_p)
    assert histogram_rows == [7]  # all but row 2, whose best 1,024 tokens hold half its mass
    np.testing.assert_array_equal(got, reference_top_k_top_p(probs, np.zeros(8, np.int64), top_p))
    for r, ties in ((5, slice(1000, 30000)), (7, slice(2000, None))):
        kept = np.count_nonzero(got[r, ties])
        assert 0 < kept < len(got[r, ties]) and got[r, ties][:kept].all()  # tied tokens kept by lower id first


def test_top_p_histogram_rows_do_not_depend_on_the_batch():
    rng = np.random.default_rng(1)
    flat = rng.random((1, 8192)).astype(np.float32)
    heavy = (rng.random((1, 8192)) * 1e30 + 1e30).astype(np.float32)  # unnormalised: its mass dwarfs the other's
    for top_p in (0.5, 0.7, 0.9):
        p = np.full(2, top_p, np.float32)
        together = apply_top_k_top_p(np.concatenate([heavy, flat]), None, p)[1]
        np.testing.assert_array_equal(together, apply_top_k_top_p(flat, None, p[:1])[0])
    # A top_p that is 0 in float32 keeps the best token, as the sorted path does.
    kept = apply_top_k_top_p(np.ones((1, 8192), np.float32), None, np.array([1e-46], np.float32))
    assert np.flatnonzero(kept[0]).tolist() == [0]


def test_inverse_cdf_sample_matches_searchsorted_and_skips_zero_weights():
    rng = np.random.default_rng(0)
    weights = rng.random((64, 3000)).astype(np.float32) * (rng.random((64, 3000)) < 0.3)
    uniform = rng.random(64)
    cum = np.cumsum(weights, axis=-1, dtype=np.float64)
    expected = [int(np.searchsorted(cum[r], uniform[r] * cum[r, -1], side="right")) for r in range(64)]
    got = inverse_cdf_sample(weights, uniform)
    assert got.tolist() == expected
    assert (weights[np.arange(64), got] > 0).all()
    # The extremes of the uniform still land on positive weights.
    for u in (0.0, np.nextafter(1.0, 0.0)):
        picked = inverse_cdf_sample(weights, np.full(64, u))
        assert (weights[np.arange(64), picked] > 0).all()


def test_sampling_frequencies_follow_the_kept_distribution(kernels):
    x = np.log(np.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * 60], np.float32))
    md = SamplingMetadata(temperature=np.ones(1, np.float32), all_greedy=False, top_p=np.array([0.9], np.float32))
    sampler = Sampler(kernels)
    draws = np.array([sampler(x, md).sampled_token_ids[0] for _ in range(4000)])
    assert set(draws.tolist()) <= {0, 1, 2}
    freq = np.bincount(draws, minlength=3)[:3] / len(draws)
    np.testing.assert_allclose(freq, np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.03)


def test_seeded_row_does_not_depend_on_other_rows_settings(kernels):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, V)).astype(np.float32)

    def run(rows, top_k, top_p, min_p):
        md = SamplingMetadata(
            temperature=np.ones(len(rows), np.float32), all_greedy=False,
            top_k=np.array(top_k), top_p=np.array(top_p, np.float32), min_p=np.array(min_p, np.float32),
            generators={len(rows) - 1: np.random.default_rng(11)},
        )
        return [int(Sampler(kernels)(x[rows], md).sampled_token_ids[-1]) for _ in range(1)][0]

    for own in ((0, 1.0, 0.0), (10, 0.8, 0.1)):
        alone = run([3], [own[0]], [own[1]], [own[2]])
        mixed = run([0, 1, 3], [5, 0, own[0]], [0.5, 1.0, own[1]], [0.2, 0.0, own[2]])
        assert alone == mixed


def test_gather_logprobs_top1_is_the_first_of_the_top_k():
    """The top-1 fast path (argmax) returns what the general top-k path returns first."""
    rng = np.random.default_rng(0)
    logprobs = rng.standard_normal((64, 1000)).astype(np.float32)
    chosen = rng.integers(0, 1000, 64)
    one, three = gather_logprobs(logprobs, chosen, 1), gather_logprobs(logprobs, chosen, 3)
    np.testing.assert_array_equal(one.token_ids, three.token_ids[:, :2])
    np.testing.assert_array_equal(one.logprobs, three.logprobs[:, :2])
    np.testing.assert_array_equal(one.ranks, three.ranks)
    np.testing.assert_array_equal(one.token_ids[:, 1], logprobs.argmax(axis=-1))


@pytest.mark.parametrize("num_logprobs", [0, 1, 3, -1])
def test_logprobs_of_rows_in_chunks_equal_the_whole_array(num_logprobs):
    """Prompt logprobs a chunk of rows at a time: exactly gather_logprobs(log_softmax(...)), read-only input."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((37, 500)) * 4).astype(np.float32)  # 37 rows: chunks of 16, 16 and 5
    x.flags.writeable = False
    chosen = rng.integers(0, 500, 37)
    want = gather_logprobs(log_softmax(x), chosen, num_logprobs)
    got = logprobs_of_rows(x, chosen, num_logprobs)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_array_equal(got.logprobs, want.logprobs)
    np.testing.assert_array_equal(got.ranks, want.ranks)


@pytest.mark.skipif(len(KERNELS) == 1, reason="the C++ kernels are not built")
@pytest.mark.parametrize("settings", [{}, {"top_p": 0.9}, {"top_k": 40}, {"min_p": 0.05}])
def test_kernel_sampler_draws_what_the_numpy_sampler_draws(settings):
    """Same seeds, same tokens: the kernels compute the numpy sampler's weights (to ~1 ulp) and its draw."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 49152)) * 2.5).astype(np.float32)
    rows = len(x)
    extra = {k: np.full(rows, v, np.float32 if k != "top_k" else np.int64) for k, v in settings.items()}

    def draw(kernels: bool) -> list[int]:
        md = SamplingMetadata(temperature=np.linspace(0.5, 1.5, rows).astype(np.float32), all_greedy=False,
                              generators={i: np.random.default_rng(100 + i) for i in range(rows)}, **extra)
        return Sampler(kernels)(x, md).sampled_token_ids.tolist()

    assert draw(True) == draw(False)
