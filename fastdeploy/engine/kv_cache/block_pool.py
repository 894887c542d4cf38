"""The pool of KV-cache blocks: allocation, reference counts, the prefix cache and LRU eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockPromptLogprobs:
    """Prompt logprobs of one cached block's positions, kept with the KV they were computed beside.

    Row ``j`` is what position ``j`` of the block predicts (the next token's logprob, its rank
    and the top ``num_logprobs``), so it depends only on the block's hash chain, except for the
    last row's chosen token, which is the first token of the *next* block: a hit checks it.
    """

    num_logprobs: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass(eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's cache."""

    block_id: int
    ref_cnt: int = 0
    # Hash of the full block's tokens (chained with its prefix) while it is in the prefix cache.
    block_hash: int | None = None
    # The block's prompt logprobs, when a request that asked for them computed it (None: unknown).
    prompt_logprobs: BlockPromptLogprobs | None = None
    # A running request asking for prompt logprobs is computing this block: they will be here
    # after its step, so a request that needs them waits a step rather than recomputing the block.
    prompt_logprobs_pending: bool = False


class BlockPool:
    """Owns every block; free blocks wait in LRU order and keep their cached content until reused.

    A freed block that holds a full, hashed block stays findable by its hash
    until it is handed out again, so a later request with the same prefix can
    take it back (prefix caching). Eviction takes the least recently freed.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"The KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Insertion order is the eviction order: the front is evicted first.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def get_usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks, evicting their cached content."""
        if num_blocks > len(self._free):
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool ({len(self._free)} free).")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
        # New content: the old prompt logprobs describe tokens that are gone.
        block.prompt_logprobs = None
        block.prompt_logprobs_pending = False

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (they may be sitting free)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> None:
        """Make a full block findable by its hash (first writer wins)."""
        if block.block_hash is not None:
            return
        if block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks that reach zero go to the back of the eviction queue.

        Callers pass a request's blocks tail first so its last blocks are
        evicted before the shared prefix.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_caching:
                    block.block_hash = None
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.prompt_logprobs = None
            block.prompt_logprobs_pending = False
        self.cached_block_hash_to_block.clear()
        return True
