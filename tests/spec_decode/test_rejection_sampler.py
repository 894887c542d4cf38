"""The exact verification rule: accepted lengths, expanded sampling settings, and the sampled distribution."""

import numpy as np

from fastdeploy.model_executor.layers.sampler import Sampler, SamplingMetadata
from fastdeploy.spec_decode.rejection_sampler import expand_sampling_metadata, verify


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at about 1 - 0.001 (Wilson-Hilferty), without scipy."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi_square(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """Two-sample chi-square statistic of count vectors and its degrees of freedom."""
    keep = (a + b) > 0
    a, b = a[keep].astype(float), b[keep].astype(float)
    ka, kb = np.sqrt(b.sum() / a.sum()), np.sqrt(a.sum() / b.sum())
    return float((((ka * a - kb * b) ** 2) / (a + b)).sum()), int(keep.sum()) - 1


def test_accepted_lengths():
    # Three requests: 3 drafts (2 match), no drafts, 2 drafts (all match).
    sampled = np.array([4, 5, 9, 1, 7, 3, 8, 2])
    drafts = np.array([4, 5, 6, 3, 8])
    v = verify(sampled, drafts, np.array([3, 0, 2]))
    assert v.num_accepted.tolist() == [2, 0, 2]
    assert v.starts.tolist() == [0, 4, 5]
    # The first draft wrong: nothing accepted even when later ones match.
    v = verify(np.array([1, 5, 6]), np.array([2, 6]), np.array([2]))
    assert v.num_accepted.tolist() == [0]


def test_expanded_metadata_samples_each_position_as_its_own_row():
    """A request's settings repeated over its positions sample as if each position were a request."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 40)).astype(np.float32)
    counts = np.array([2, 3])
    md = SamplingMetadata(temperature=np.array([0.0, 0.0], np.float32), all_greedy=True,
                          allowed_token_ids=(np.array([1, 1, 1]), np.array([3, 7, 9])),
                          logit_bias=(np.array([0]), np.array([5]), np.array([100.0], np.float32)),
                          max_num_logprobs=2, logprob_token_ids=(np.array([0, 0]), np.array([11, 2])))
    out = Sampler()(logits.copy(), expand_sampling_metadata(md, counts))
    assert out.sampled_token_ids[:2].tolist() == [5, 5]          # request 0: the bias wins
    allowed = logits[2:][:, [3, 7, 9]].argmax(axis=-1)
    assert out.sampled_token_ids[2:].tolist() == np.array([3, 7, 9])[allowed].tolist()
    # Requested logprob ids, per position of request 0 only.
    assert out.logprobs.token_ids[:2, 1:].tolist() == [[11, 2], [11, 2]]


def test_seeded_positions_draw_in_order_from_the_request_generator():
    logits = np.zeros((3, 8), np.float32)
    md = SamplingMetadata(temperature=np.ones(1, np.float32), all_greedy=False,
                          generators={0: np.random.default_rng(7)})
    a = Sampler()(logits.copy(), expand_sampling_metadata(md, np.array([3]))).sampled_token_ids
    md.generators = {0: np.random.default_rng(7)}
    b = Sampler()(logits.copy(), expand_sampling_metadata(md, np.array([3]))).sampled_token_ids
    ref = np.floor(np.random.default_rng(7).random(3) * 8).astype(int)
    assert a.tolist() == b.tolist() == ref.tolist()


def test_verified_tokens_follow_the_target_distribution():
    """Output token after a one-hot draft (accepted or resampled) is distributed as p (top-k/top-p applied)."""
    vocab, trials = 6, 20000
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
    md = SamplingMetadata(temperature=np.ones(trials, np.float32), all_greedy=False,
                          top_k=np.full(trials, 4), top_p=np.full(trials, 0.8, np.float32))
    sampler = Sampler()
    sampler._rng = np.random.default_rng(1)
    # Two positions per trial: draft d=1 at position 0, then the bonus position.
    counts = np.full(trials, 2)
    out = sampler(np.tile(logits, (2 * trials, 1)), expand_sampling_metadata(md, counts)).sampled_token_ids
    v = verify(out, np.full(trials, 1), np.ones(trials, dtype=np.int64))
    first = out[v.starts]
    # top-k 4 leaves [.4, .25, .15, .1] / .9; top-p 0.8 then keeps the first three (0.889 >= 0.8).
    p = np.r_[np.exp(logits[:3]) / np.exp(logits[:3]).sum(), np.zeros(vocab - 3)]
    expected = p * trials
    observed = np.bincount(first, minlength=vocab)
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    assert observed[~keep].sum() == 0
    assert stat < chi_square_critical(int(keep.sum()) - 1), (observed, expected)
    # Acceptance happens exactly when the target draws the draft: P = p(1).
    assert abs(v.num_accepted.mean() - p[1]) < 0.02
