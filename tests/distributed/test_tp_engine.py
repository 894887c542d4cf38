"""The engine with -tp 2 (one worker process per rank) serves exactly what one rank serves.

One tiny random Llama, an engine at each size with the same small limits: a 16-token step
budget (every prompt is a chunked prefill) and a KV cache of 12 blocks per rank, too small for
the batch, so requests are preempted and recomputed. Greedy tokens and their logprobs must be
the same, batched or alone, and a shared prefix is served from the cache under TP too.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy import LLM, SamplingParams
from tests.model_executor.utils import TINY_VOCAB, build_tiny_checkpoint

pytestmark = pytest.mark.slow

# Bytes of one 16-token KV block at one rank (2 layers, K and V, 2 KV heads of 16, fp32); a rank of
# two holds one KV head, half of it. 12 blocks either way.
BLOCK_BYTES_TP1 = 2 * 2 * 16 * 2 * 16 * 4
NUM_BLOCKS = 12
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)


def _engine(path: str, tp: int) -> LLM:
    return LLM(path, tensor_parallel_size=tp, dtype="float32", max_model_len=128, max_num_batched_tokens=16,
               max_num_seqs=8, kv_cache_memory_bytes=NUM_BLOCKS * BLOCK_BYTES_TP1 // tp, skip_tokenizer_init=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    path = build_tiny_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))
    return _engine(path, 1), _engine(path, 2)


def _prompts(n: int = 6, length: int = 30) -> list[dict]:
    return [{"prompt_token_ids": np.random.default_rng(i).integers(3, TINY_VOCAB, length + i).tolist()}
            for i in range(n)]


def _tokens_and_logprobs(outputs) -> tuple[list[list[int]], np.ndarray]:
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [lp[t].logprob for o in outputs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                                   strict=True)]
    return tokens, np.array(logprobs)


def test_tp2_equals_tp1_with_chunked_prefill_and_preemption(engines):
    tp1, tp2 = engines
    assert tp2.llm_engine.engine_core.worker.world_size == 2
    want, want_lp = _tokens_and_logprobs(tp1.generate(_prompts(), GREEDY))
    got, got_lp = _tokens_and_logprobs(tp2.generate(_prompts(), GREEDY))
    assert got == want
    np.testing.assert_allclose(got_lp, want_lp, atol=1e-4, rtol=0)
    # Both engines ran out of KV blocks and recomputed some requests.
    for llm in engines:
        assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_tp2_batched_equals_alone(engines):
    _, tp2 = engines
    prompts = _prompts(3)
    batched, _ = _tokens_and_logprobs(tp2.generate(prompts, GREEDY))
    alone = [_tokens_and_logprobs(tp2.generate([p], GREEDY))[0][0] for p in prompts]
    assert batched == alone


def test_tp2_prefix_cache(engines):
    tp1, tp2 = engines
    prefix = np.random.default_rng(99).integers(3, TINY_VOCAB, 40).tolist()
    first, second = {"prompt_token_ids": prefix + [7, 8]}, {"prompt_token_ids": prefix + [9]}
    tp2.generate([first], GREEDY)
    out = tp2.generate([second], GREEDY)[0]
    assert out.num_cached_tokens >= 32  # two full blocks of the shared prefix
    assert list(out.outputs[0].token_ids) == list(tp1.generate([second], GREEDY)[0].outputs[0].token_ids)
