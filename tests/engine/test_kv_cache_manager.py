"""Block pool and KV cache manager: allocation, prefix-cache hits, LRU eviction."""

import time

from fastdeploy.engine.kv_cache.kv_cache_manager import KVCacheManager
from fastdeploy.engine.request import EngineCoreRequest, Request
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


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = make_request("a", list(range(12)))
    kv.allocate_slots(a, 12)
    core = EngineCoreRequest("b", list(range(13)), SamplingParams(max_tokens=2, prompt_logprobs=1), None, time.time())
    assert kv.get_computed_blocks(Request(core, 1024)) == ([], 0)
