"""Beam search: the search logic on scripted outputs, and LLM.beam_search against exhaustive search on a tiny model."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fastdeploy import LLM, BeamSearchParams, StructuredOutputsParams
from fastdeploy.beam_search import BeamSearch, beam_search_async, beam_search_params_from_request
from fastdeploy.logprobs import Logprob
from fastdeploy.outputs import CompletionOutput, RequestOutput, get_beam_search_score
from tests.model_executor.utils import build_tiny_checkpoint, load_hf_model

EOS = 2
VOCAB = 16


def scripted(distributions: list[dict[int, float]]) -> list[RequestOutput]:
    """One-token outputs whose logprobs are the given ``{token: logprob}`` per beam."""
    return [
        RequestOutput(str(i), None, [1], None,
                      [CompletionOutput(0, "", [max(d, key=d.get)], None, [{t: Logprob(lp) for t, lp in d.items()}])],
                      True)
        for i, d in enumerate(distributions)
    ]


def test_search_keeps_the_best_and_sets_eos_beams_aside():
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=2), EOS, [([7], "p")])
    (root,) = search.live_beams()
    search.advance(scripted([{5: -0.1, EOS: -0.5, 6: -2.0}]))
    assert [b.tokens for b in search.live_beams()] == [[7, 5], [7, 6]]
    assert [b.tokens for b in search.instances[0].completed] == [[7, EOS]]
    search.advance(scripted([{8: -3.0, 9: -4.0}, {8: -0.1}]))
    assert search.live_beams() == []  # max_tokens reached
    best = search.best_beams()[0]
    # Scores are length-normalised over prompt + generated tokens; a trailing EOS is not counted.
    assert [b.tokens for b in best] == [[7, EOS], [7, 6, 8]]
    assert best[0].finish_reason == "stop" and best[1].finish_reason == "length"
    assert best[1].cum_logprob == pytest.approx(-2.1)


def test_length_penalty_and_ignore_eos():
    def run(**kw):
        search = BeamSearch(BeamSearchParams(beam_width=1, max_tokens=2, **kw), EOS, [([7], None)])
        search.advance(scripted([{EOS: -0.6, 5: -0.5}]))
        if search.live_beams():
            search.advance(scripted([{6: -0.4}]))
        return search.best_beams()[0][0].tokens

    # Normalised per token, the longer beam wins; without normalisation the short EOS beam does.
    assert run() == [7, 5, 6]
    assert run(length_penalty=0.0) == [7, EOS]
    # With ignore_eos, EOS is an ordinary token: it can be extended.
    search = BeamSearch(BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True), EOS, [([7], None)])
    search.advance(scripted([{EOS: -0.1, 5: -0.5}]))
    assert search.live_beams()[0].tokens == [7, EOS]


def test_rejects_structured_outputs_and_maps_requests():
    with pytest.raises(ValueError, match="not supported with beam search"):
        BeamSearch(BeamSearchParams(beam_width=2, max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a")),
                   EOS, [([1], None)])
    params = beam_search_params_from_request({"n": 3, "length_penalty": 0.5, "ignore_eos": True}, 10, {"temperature": 0.2})
    assert (params.beam_width, params.max_tokens, params.temperature, params.length_penalty, params.ignore_eos) == (
        3, 10, 0.2, 0.5, True)
    assert beam_search_params_from_request({"temperature": 0.0}, 4).beam_width == 1


# ---- against exhaustive search on a tiny model ---------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = build_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("beam"), vocab_size=VOCAB, std=0.5)
    llm = LLM(folder, skip_tokenizer_init=True, dtype="float32", block_size=4, kv_cache_memory_bytes=8 << 20)
    return llm, load_hf_model(folder)


def exhaustive(hf, prompt: list[int], steps: int, length_penalty: float) -> list[tuple[tuple[int, ...], float]]:
    """Every continuation of up to ``steps`` tokens (stopping at EOS), ranked by beam score, from transformers."""
    import torch

    finished, frontier = [], [(tuple(prompt), 0.0)]
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([list(seq) for seq, _ in frontier])).logits[:, -1].float()
        logprobs = torch.log_softmax(logits, -1).numpy()
        extended = [(seq + (tok,), cum + float(row[tok])) for (seq, cum), row in zip(frontier, logprobs, strict=True)
                    for tok in range(VOCAB)]
        finished += [c for c in extended if c[0][-1] == EOS]
        frontier = [c for c in extended if c[0][-1] != EOS]
    return sorted(finished + frontier, key=lambda c: get_beam_search_score(list(c[0]), c[1], EOS, length_penalty),
                  reverse=True)


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_width_four_finds_the_exhaustive_best(tiny, length_penalty):
    llm, hf = tiny
    prompts = [[5, 7, 3, 9], [11, 4], [8, 8, 8, 1, 6, 13]]
    steps = 3
    params = BeamSearchParams(beam_width=4, max_tokens=steps, length_penalty=length_penalty)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, result in zip(prompts, results, strict=True):
        ranked = exhaustive(hf, prompt, steps, length_penalty)
        best = result.sequences[0]
        assert tuple(best.tokens) == ranked[0][0]
        assert best.cum_logprob == pytest.approx(ranked[0][1], abs=1e-4)
        assert len(result.sequences) == 4
        scores = [get_beam_search_score(s.tokens, s.cum_logprob, EOS, length_penalty) for s in result.sequences]
        assert scores == sorted(scores, reverse=True)
        assert len(best.logprobs) == len(best.tokens) - len(prompt)


def test_beam_search_with_small_batches_and_async_path(tiny):
    llm, _ = tiny
    prompts = [{"prompt_token_ids": [5, 7, 3, 9]}, {"prompt_token_ids": [11, 4]}]
    params = BeamSearchParams(beam_width=3, max_tokens=4)
    together = llm.beam_search(prompts, params)
    one_at_a_time = llm.beam_search(prompts, params, concurrency_limit=1)
    assert [[s.tokens for s in r.sequences] for r in together] == [[s.tokens for s in r.sequences] for r in one_at_a_time]

    async def generate(prompt, sampling_params, request_id):
        # An AsyncLLM.generate stand-in backed by the offline engine.
        yield llm.generate([prompt], sampling_params, use_tqdm=False)[0]

    output = asyncio.run(beam_search_async(generate, [5, 7, 3, 9], params, "req", eos_token_id=EOS))
    assert output.finished and output.request_id == "req"
    assert [c.token_ids for c in output.outputs] == [s.tokens[4:] for s in together[0].sequences]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert np.allclose([c.cumulative_logprob for c in output.outputs], [s.cum_logprob for s in together[0].sequences])


@pytest.mark.slow
def test_beam_search_text_on_the_real_model_is_decoded(smol_llm):
    out = smol_llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=2, max_tokens=4))
    best = out[0].sequences[0]
    # As vLLM: tokens and text hold the prompt and the continuation.
    assert best.text.startswith("The capital of France is") and len(best.tokens) > 5
