"""Per-request KV block tables on top of the block pool, with prefix-cache lookups."""

from __future__ import annotations

from fastdeploy.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from fastdeploy.engine.kv_cache.kv_cache_utils import update_block_hashes
from fastdeploy.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates the blocks each request's tokens need and shares full blocks by hash."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_blocks - self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's full blocks already in the cache, and its token count.

        The last token is never taken from the cache: its logits are needed.
        """
        # Prompt logprobs need every prompt position computed, so such requests skip the cache (as vLLM).
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        update_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None,
        cache: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for ``num_new_tokens`` more tokens; None when the pool is short.

        ``cache=False`` keeps the new blocks out of the prefix cache for now: their content
        arrives later (from a prefill instance), and another request must not share them before.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Cache hits that sit in the free queue stop being free once taken.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        if self.enable_caching and cache:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_block.get(request.request_id, 0)
        if num_full <= start:
            return
        update_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_block[request.request_id] = num_full

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """Queries and hits (in tokens) since the last call."""
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats
