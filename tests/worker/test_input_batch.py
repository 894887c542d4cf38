"""The persistent batch's sampling rows: what make_sampling_metadata builds, step after step, must shape
the logits exactly as a per-request reference built from the raw settings would."""

import numpy as np
import pytest

from fastdeploy.model_executor.layers.sampler import Sampler
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.worker.input_batch import InputBatch

VOCAB = 200
EOS = 3


def random_request(rng):
    sp = SamplingParams(
        temperature=0.0,
        repetition_penalty=float(rng.choice([1.0, 1.3, 0.7])),
        presence_penalty=float(rng.choice([0.0, 0.5])),
        frequency_penalty=float(rng.choice([0.0, -0.3, 0.4])),
        min_tokens=int(rng.choice([0, 3, 8])),
        stop_token_ids=rng.choice(VOCAB, 2, replace=False).tolist() if rng.random() < 0.5 else None,
        logit_bias={int(t): float(rng.uniform(-3, 3)) for t in rng.choice(VOCAB, 10, replace=False)}
        if rng.random() < 0.5 else None,
        allowed_token_ids=rng.choice(VOCAB, 40, replace=False).tolist() if rng.random() < 0.2 else None,
        max_tokens=100,
    )
    words = [[int(rng.integers(VOCAB))]] if rng.random() < 0.5 else []
    words += [rng.integers(0, 20, rng.integers(2, 4)).tolist() for _ in range(int(rng.integers(0, 3)))]
    prompt = rng.integers(0, VOCAB, int(rng.integers(3, 30))).tolist()
    return sp, words or None, prompt


def reference(x, reqs):
    """The logits each request's raw settings give, one request at a time."""
    x = x.copy()
    for r, (sp, words, prompt, output) in enumerate(reqs):
        if sp.allowed_token_ids:
            keep = x[r, sp.allowed_token_ids].copy()
            x[r] = -np.inf
            x[r, sp.allowed_token_ids] = keep
        for w in words or []:
            prefix = w[:-1]
            if not prefix or (len(output) >= len(prefix) and output[-len(prefix):] == prefix):
                x[r, w[-1]] = -np.inf
        for tok, b in (sp.logit_bias or {}).items():
            x[r, tok] += np.float32(b)
        if sp.min_tokens and len(output) < sp.min_tokens:
            x[r, sorted(set(sp.all_stop_token_ids) | {EOS})] = -np.inf
        if sp.repetition_penalty != 1.0 or sp.presence_penalty != 0 or sp.frequency_penalty != 0:
            counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=x.shape[1])
            seen = counts > 0
            seen[prompt] = True
            rep = np.float32(sp.repetition_penalty)
            x[r] = np.where(seen, np.where(x[r] > 0, x[r] / rep, x[r] * rep), x[r])
            x[r] -= np.float32(sp.frequency_penalty) * counts.astype(np.float32)
            x[r] -= np.float32(sp.presence_penalty) * (counts > 0)
    return x


@pytest.mark.parametrize("seed", range(4))
def test_metadata_over_steps_matches_per_request_reference(seed):
    rng = np.random.default_rng(seed)
    batch = InputBatch(max_num_reqs=16, max_model_len=128, max_num_blocks_per_req=8, vocab_size=VOCAB)
    reqs = {}
    for step in range(25):
        # Requests join and leave; a "preempted" one comes back with its outputs in token_ids.
        if len(reqs) < 12 and rng.random() < 0.6:
            sp, words, prompt = random_request(rng)
            req_id = f"r{step}"
            reqs[req_id] = [sp, words, prompt, []]
            batch.add_request(req_id, prompt, len(prompt), len(prompt), [], sp, eos_token_id=EOS,
                              bad_words_token_ids=words)
        if reqs and rng.random() < 0.2:
            req_id = list(reqs)[int(rng.integers(len(reqs)))]
            batch.remove_request(req_id)
            sp, words, prompt, output = reqs[req_id]
            if rng.random() < 0.5:
                batch.add_request(req_id, prompt + output, len(prompt), len(prompt), [], sp, eos_token_id=EOS,
                                  bad_words_token_ids=words)
            else:
                del reqs[req_id]
        if not reqs:
            continue
        # A random subset in a random order is sampled this step.
        ids = [r for r in reqs if rng.random() < 0.8] or list(reqs)
        ids = [ids[i] for i in rng.permutation(len(ids))]
        rows = np.array([batch.req_id_to_index[r] for r in ids])
        x = (rng.standard_normal((len(ids), VOCAB)) * 2).astype(np.float32)
        md = batch.make_sampling_metadata(rows)
        got = Sampler.apply_logits_processors(x.copy(), md)
        np.testing.assert_array_equal(got, reference(x, [reqs[r] for r in ids]))
        sampled = Sampler()(x, md).sampled_token_ids
        assert sampled.tolist() == got.argmax(-1).tolist()
        # Bad words end in small ids so that their prefixes get matched now and then.
        sampled = np.where(rng.random(len(ids)) < 0.5, rng.integers(0, 20, len(ids)), sampled)
        batch.append_sampled(rows, sampled)
        for r, tok in zip(ids, sampled.tolist(), strict=True):
            reqs[r][3].append(tok)


def test_freed_row_starts_clean_for_the_next_request():
    batch = InputBatch(max_num_reqs=1, max_model_len=32, max_num_blocks_per_req=2, vocab_size=VOCAB)
    batch.add_request("a", [5, 6], 2, 2, [], SamplingParams(presence_penalty=1.0))
    batch.append_sampled(np.array([0]), np.array([7]))
    batch.remove_request("a")
    assert not batch.seen_counts.any()
    batch.add_request("b", [9], 1, 1, [], SamplingParams(frequency_penalty=1.0))
    md = batch.make_sampling_metadata(np.array([0]))
    assert md.penalty_token_ids.tolist() == [9] and md.output_token_counts.tolist() == [0]


def test_logprob_counts_and_generators_come_from_the_rows():
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_num_blocks_per_req=2, vocab_size=VOCAB)
    gen = np.random.default_rng(1)
    batch.add_request("a", [1], 1, 1, [], SamplingParams(temperature=1.0, logprobs=3), generator=gen)
    batch.add_request("b", [1], 1, 1, [], SamplingParams(temperature=0.0, logprobs=-1))
    md = batch.make_sampling_metadata(np.array([batch.req_id_to_index["b"], batch.req_id_to_index["a"]]))
    assert md.max_num_logprobs == VOCAB and md.generators == {1: gen} and not md.all_greedy
    assert batch.make_sampling_metadata(np.array([batch.req_id_to_index["a"]])).max_num_logprobs == 3


def test_logprob_token_ids_come_from_the_rows_in_the_order_asked():
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_num_blocks_per_req=2, vocab_size=VOCAB)
    batch.add_request("a", [1], 1, 1, [], SamplingParams(temperature=0.0, logprobs=1))
    batch.add_request("b", [1], 1, 1, [], SamplingParams(temperature=0.0, logprob_token_ids=[9, 2, 5]))
    a, b = batch.req_id_to_index["a"], batch.req_id_to_index["b"]
    md = batch.make_sampling_metadata(np.array([b, a]))
    # The row's width is its id count, so the ids fit the step's top-k columns.
    assert md.max_num_logprobs == 3
    assert md.logprob_token_ids[0].tolist() == [0, 0, 0] and md.logprob_token_ids[1].tolist() == [9, 2, 5]
    assert batch.make_sampling_metadata(np.array([a])).logprob_token_ids is None
    batch.remove_request("b")
    assert batch.make_sampling_metadata(np.array([a])).logprob_token_ids is None and not batch.logprob_token_ids


@pytest.mark.parametrize("seed", range(8))
def test_verified_positions_see_the_drafts_before_them(seed):
    """Speculative decoding: position j of a request with drafts d_1..d_k shapes the logits as the
    reference does for the output extended by d_1..d_j (penalties, min_tokens, bad words)."""
    rng = np.random.default_rng(100 + seed)
    batch = InputBatch(max_num_reqs=16, max_model_len=128, max_num_blocks_per_req=8, vocab_size=VOCAB)
    reqs, drafts = {}, {}
    for i in range(10):
        sp, words, prompt = random_request(rng)
        # Outputs and drafts of small ids (bad-word prefixes match), EOS among them (min_tokens masks it).
        output = rng.integers(0, 20, int(rng.integers(0, 10))).tolist()
        batch.add_request(f"r{i}", prompt + output, len(prompt), len(prompt), [], sp, eos_token_id=EOS,
                          bad_words_token_ids=words)
        reqs[f"r{i}"] = (sp, words, prompt, output)
        drafts[f"r{i}"] = rng.integers(0, 20, int(rng.integers(0, 5))).tolist()
    ids = [list(reqs)[i] for i in rng.permutation(len(reqs))]
    rows = np.array([batch.req_id_to_index[r] for r in ids])
    for r, row in zip(ids, rows.tolist(), strict=True):
        n = batch.num_tokens[row]
        batch.token_ids[row, n : n + len(drafts[r])] = drafts[r]
    num_pos = np.array([len(drafts[r]) + 1 for r in ids])
    x = (rng.standard_normal((int(num_pos.sum()), VOCAB)) * 2).astype(np.float32)
    md = batch.make_sampling_metadata(rows, num_pos)
    got = Sampler.apply_logits_processors(x.copy(), md)
    positions = [(sp, words, prompt, output + drafts[r][:j])
                 for r in ids for sp, words, prompt, output in [reqs[r]] for j in range(len(drafts[r]) + 1)]
    np.testing.assert_array_equal(got, reference(x, positions))
    # The drafts stay where they are: the batch's own state is unchanged by building the rows.
    assert batch.num_tokens[rows].tolist() == [len(reqs[r][2]) + len(reqs[r][3]) for r in ids]


def test_request_settings_repeat_over_their_verified_positions():
    """Logit bias, allowed tokens, requested logprob ids and a seeded generator serve each position."""
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_num_blocks_per_req=2, vocab_size=VOCAB)
    gen = np.random.default_rng(7)
    batch.add_request("a", [1], 1, 1, [], SamplingParams(temperature=0.0, logit_bias={5: 100.0},
                                                          logprob_token_ids=[11, 2]))
    batch.add_request("b", [1], 1, 1, [], SamplingParams(temperature=0.0, allowed_token_ids=[3, 7, 9]))
    batch.add_request("c", [1], 1, 1, [], SamplingParams(temperature=1.0), generator=gen)
    a, b, c = (batch.req_id_to_index[r] for r in "abc")
    md = batch.make_sampling_metadata(np.array([b, a, c]), np.array([3, 2, 3]))
    x = np.random.default_rng(0).standard_normal((8, VOCAB)).astype(np.float32)
    out = Sampler()(x.copy(), md)
    allowed = x[:3][:, [3, 7, 9]].argmax(axis=-1)
    assert out.sampled_token_ids[:3].tolist() == np.array([3, 7, 9])[allowed].tolist()
    assert out.sampled_token_ids[3:5].tolist() == [5, 5]          # request a: the bias wins
    # Requested logprob ids at request a's positions only, in the order asked.
    assert md.logprob_token_ids[0].tolist() == [3, 3, 4, 4] and md.logprob_token_ids[1].tolist() == [11, 2] * 2
    # Request c's generator draws once per position, in position order.
    assert list(md.generators) == [5, 6, 7] and all(g is gen for g in md.generators.values())
