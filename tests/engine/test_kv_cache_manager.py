"""Block pool and KV cache manager: allocation, prefix-cache hits, LRU eviction."""

import time

from fastdeploy.engine.kv_cache.kv_cache_manager import KVCacheManager
from fastdeploy.engine.request import EngineCoreRequest, LogprobsLists, Request
from fastdeploy.sampling_params import SamplingParams


def make_request(req_id: str, tokens: list[int]) -> Request:
    core = EngineCoreRequest(req_id, tokens, SamplingParams(max_tokens=8), None, time.time())
    return Request(core, max_model_len=1024)


def test_allocate_and_free_returns_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    req = make_request("a", list(range(10)))
    blocks = kv.allocate_slots(req, 10)
    assert len(blocks) == 3
    assert kv.block_pool.get_num_free_blocks() == 7
    kv.free(req)
    assert kv.block_pool.get_num_free_blocks() == 10


def test_allocation_fails_when_pool_is_short():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=False)
    assert kv.allocate_slots(make_request("a", list(range(12))), 12) is None
    assert kv.block_pool.get_num_free_blocks() == 2


def test_prefix_hit_shares_full_blocks_but_never_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    b = make_request("b", list(range(12)) + [99])
    hits, n = kv.get_computed_blocks(b)
    assert n == 12 and [h.block_id for h in hits] == kv.get_block_ids("a")
    # Same prompt exactly: the last block holds the last token, so it is recomputed.
    c = make_request("c", list(range(12)))
    hits, n = kv.get_computed_blocks(c)
    assert n == 8
    kv.allocate_slots(b, 1, hits[:3] if len(hits) >= 3 else None)


def test_freed_cached_blocks_stay_findable_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.free(a)
    b = make_request("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # Filling the pool with other content evicts the cached blocks.
    other = make_request("o", [500 + i for i in range(16)])
    assert kv.allocate_slots(other, 16) is not None
    hits, n = kv.get_computed_blocks(make_request("c", list(range(9))))
    assert n == 0


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0


def _lp_request(req_id: str, tokens: list[int], k: int = 1) -> Request:
    core = EngineCoreRequest(req_id, tokens, SamplingParams(max_tokens=2, prompt_logprobs=k), None, time.time())
    return Request(core, 1024)


def _rows(tokens: list[int], first: int, last: int, k: int = 1) -> LogprobsLists:
    """Made-up rows for positions first..last-1: row p predicts tokens[p + 1]."""
    ids = [[tokens[p + 1], *range(100, 100 + k)] for p in range(first, last)]
    return LogprobsLists(ids, [[-0.5 - p] * (k + 1) for p in range(first, last)], [p + 1 for p in range(first, last)])


def test_prompt_logprobs_requests_hit_only_blocks_that_carry_them():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    # Blocks computed without prompt logprobs cannot serve a request that needs them.
    kv.allocate_slots(make_request("a", list(range(12))), 12)
    assert kv.get_computed_blocks(_lp_request("b", list(range(13)))) == ([], 0)

    tokens = list(range(50, 63))
    c = _lp_request("c", tokens)
    kv.allocate_slots(c, 13)
    # Being computed: a request needing the same prefix waits for the rows instead of recomputing.
    assert kv.prompt_logprobs_pending(_lp_request("d", tokens))
    kv.store_prompt_logprobs(c, 0, _rows(tokens, 0, 6))  # a chunk: block 0 complete, block 1 not
    kv.store_prompt_logprobs(c, 6, _rows(tokens, 6, 12))
    kv.free(c)
    d = _lp_request("d", tokens)
    assert not kv.prompt_logprobs_pending(d)
    hits, n = kv.get_computed_blocks(d)
    assert n == 12
    # The rows a hit returns are the ones stored, position for position.
    assert kv.cached_prompt_logprobs(hits, 0) == _rows(tokens, 0, 12)
    assert kv.cached_prompt_logprobs(hits, 5) == _rows(tokens, 5, 12)
    # Another top-k width: the stored rows do not answer it.
    assert kv.get_computed_blocks(_lp_request("e", tokens, k=2)) == ([], 0)
    # A prompt that leaves the shared prefix right at a block boundary: the last shared block's
    # last row predicted another token, so that block is not a hit.
    other = tokens[:8] + [7, 7, 7, 7, 7]
    assert kv.get_computed_blocks(_lp_request("f", other))[1] == 4


def test_prompt_logprobs_of_a_block_go_when_it_is_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    tokens = list(range(9))
    a = _lp_request("a", tokens)
    kv.allocate_slots(a, 9)
    kv.store_prompt_logprobs(a, 0, _rows(tokens, 0, 8))
    kv.free(a)
    assert kv.get_computed_blocks(_lp_request("b", tokens))[1] == 8
    kv.allocate_slots(make_request("c", list(range(100, 116))), 16)  # takes every block
    assert all(b.prompt_logprobs is None for b in kv.block_pool.blocks)


def test_pending_prompt_logprobs_clear_when_the_owner_goes():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    tokens = list(range(13))
    a = _lp_request("a", tokens)
    kv.allocate_slots(a, 13)
    assert kv.prompt_logprobs_pending(_lp_request("b", tokens))
    kv.free(a)  # aborted before its step: nobody will bring the rows
    assert not kv.prompt_logprobs_pending(_lp_request("b", tokens))
    assert kv.get_computed_blocks(_lp_request("b", tokens)) == ([], 0)


def test_whole_vocabulary_prompt_logprobs_skip_the_prefix_cache():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    kv.allocate_slots(make_request("a", list(range(12))), 12)
    assert kv.get_computed_blocks(_lp_request("b", list(range(13)), k=-1)) == ([], 0)
