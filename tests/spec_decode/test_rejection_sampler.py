"""The exact verification rule: accepted lengths, per-position sampling settings, and the sampled distribution."""

import numpy as np

from fastdeploy.model_executor.layers.sampler import Sampler
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.spec_decode.rejection_sampler import verify
from fastdeploy.worker.input_batch import InputBatch
from tests.worker.test_input_batch import reference


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


def _verified_rows(trials: int, sp: SamplingParams, tokens: list[int], num_prompt: int, draft: int,
                   vocab: int, generator: np.random.Generator | None = None):
    """``trials`` copies of one request in a persistent batch, each verifying ``draft``: its two positions' settings."""
    batch = InputBatch(max_num_reqs=trials, max_model_len=len(tokens) + 1, max_num_blocks_per_req=1, vocab_size=vocab)
    for i in range(trials):
        batch.add_request(f"r{i}", tokens, num_prompt, len(tokens), [], sp, generator=generator)
    rows = np.array([batch.req_id_to_index[f"r{i}"] for i in range(trials)])
    batch.token_ids[rows, len(tokens)] = draft
    return batch.make_sampling_metadata(rows, np.full(trials, 2))


def _assert_follows(observed_tokens: np.ndarray, p: np.ndarray) -> None:
    """Chi-square goodness of fit of sampled tokens to the distribution ``p`` (zero-probability tokens never drawn)."""
    observed = np.bincount(observed_tokens, minlength=len(p))
    expected = p * len(observed_tokens)
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    assert observed[~keep].sum() == 0, (observed, expected)
    assert stat < chi_square_critical(int(keep.sum()) - 1), (observed, expected)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_seeded_positions_draw_in_order_from_the_request_generator():
    logits = np.zeros((3, 8), np.float32)
    sp = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):
        batch = InputBatch(max_num_reqs=1, max_model_len=8, max_num_blocks_per_req=1, vocab_size=8)
        batch.add_request("a", [1], 1, 1, [], sp, generator=np.random.default_rng(7))
        md = batch.make_sampling_metadata(np.array([0]), np.array([3]))
        runs.append(Sampler()(logits.copy(), md).sampled_token_ids.tolist())
    ref = np.floor(np.random.default_rng(7).random(3) * 8).astype(int)
    assert runs[0] == runs[1] == ref.tolist()


def test_verified_tokens_follow_the_target_distribution():
    """Output token after a one-hot draft (accepted or resampled) is distributed as p (top-k/top-p applied)."""
    vocab, trials = 6, 20000
    logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
    md = _verified_rows(trials, SamplingParams(temperature=1.0, top_k=4, top_p=0.8), [0], 1, 1, vocab)
    sampler = Sampler()
    sampler._rng = np.random.default_rng(1)
    # Two positions per trial: draft d=1 at position 0, then the bonus position.
    out = sampler(np.tile(logits, (2 * trials, 1)), md).sampled_token_ids
    v = verify(out, np.full(trials, 1), np.ones(trials, dtype=np.int64))
    # top-k 4 leaves [.4, .25, .15, .1] / .9; top-p 0.8 then keeps the first three (0.889 >= 0.8).
    p = np.r_[np.exp(logits[:3]) / np.exp(logits[:3]).sum(), np.zeros(vocab - 3)]
    _assert_follows(out[v.starts], p)
    # Acceptance happens exactly when the target draws the draft: P = p(1).
    assert abs(v.num_accepted.mean() - p[1]) < 0.02


def test_penalised_positions_follow_the_distribution_with_the_draft_counted():
    """With penalties, the first output token follows p penalised by the history, and the bonus token
    after an accepted draft follows p penalised by the history plus the draft (one more output)."""
    vocab, trials = 6, 20000
    logits = np.log(np.array([0.3, 0.25, 0.2, 0.1, 0.1, 0.05], np.float32))
    sp = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    prompt, output, draft = [2], [0, 0], 1
    md = _verified_rows(trials, sp, prompt + output, len(prompt), draft, vocab)
    sampler = Sampler()
    sampler._rng = np.random.default_rng(2)
    out = sampler(np.tile(logits, (2 * trials, 1)), md).sampled_token_ids
    v = verify(out, np.full(trials, draft), np.ones(trials, dtype=np.int64))
    p0, p1 = (_softmax(reference(logits[None], [(sp, None, prompt, seen)])[0]) for seen in (output, output + [draft]))
    assert p1[draft] < 0.5 * p0[draft]  # the draft's own penalty matters at the bonus position
    _assert_follows(out[v.starts], p0)
    accepted = v.num_accepted == 1
    assert abs(accepted.mean() - p0[draft]) < 0.02
    _assert_follows(out[v.starts[accepted] + 1], p1)
