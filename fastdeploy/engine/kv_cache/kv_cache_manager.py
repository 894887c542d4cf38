"""Per-request KV block tables on top of the block pool, with prefix-cache lookups.

Requests asking for prompt logprobs (lm-eval's loglikelihood: ``echo`` + ``logprobs``)
need a logprob for every prompt token, including the ones whose KV a cache hit would
skip. The logprobs a position predicts depend only on the tokens up to it, i.e. on the
block's hash chain, so they are kept with the cached block (``BlockPromptLogprobs``)
when a request computes them, and a later request with the same prefix and the same
``prompt_logprobs`` reuses the block and its logprobs: the values are the ones computed
then, exactly. The last row of a block predicts the next block's first token, which the
hash does not cover: a hit checks it against the request's own token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastdeploy.engine.kv_cache.block_pool import BlockPool, BlockPromptLogprobs, KVCacheBlock
from fastdeploy.engine.kv_cache.kv_cache_utils import update_block_hashes
from fastdeploy.engine.request import LogprobsLists, Request

# Prompt logprobs up to this many top-k per position are kept with cached blocks (vLLM's
# default max_logprobs); a request asking for more (or -1, the whole vocabulary) skips the cache.
MAX_CACHED_PROMPT_LOGPROBS = 20


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _PromptLogprobRows:
    """The rows a request computed that are not yet stored with a full block, from position ``first``."""

    first: int
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.first + len(self.ranks)


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
        # Per request asking for prompt logprobs: computed rows waiting for their block to fill.
        self._prompt_logprob_rows: dict[str, _PromptLogprobRows] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_blocks - self.block_pool.get_num_free_blocks()

    def get_computed_blocks(self, request: Request, wait_for_pending: bool = False,
                            ) -> tuple[list[KVCacheBlock], int] | None:
        """Longest run of the request's full blocks already in the cache, and its token count.

        The last token is never taken from the cache: its logits are needed. A request that
        still owes prompt logprobs only takes blocks that carry them (see the module doc).
        With ``wait_for_pending``, None when the run stops at a block whose prompt logprobs are
        being computed (``prompt_logprobs_pending``): the same walk answers both questions.
        """
        if not self.enable_caching:
            return [], 0
        k = self.needs_prompt_logprobs(request)
        if k is not None and k > MAX_CACHED_PROMPT_LOGPROBS:
            # Too wide to keep with the blocks: every prompt position is computed (as vLLM does).
            return [], 0
        hits, stopped_at = self._cached_run(request, k)
        if wait_for_pending and stopped_at is not None and stopped_at.prompt_logprobs_pending:
            return None
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def needs_prompt_logprobs(self, request: Request) -> int | None:
        """The request's ``prompt_logprobs`` (-1 counted as the whole vocabulary) while some are still owed."""
        k = request.sampling_params.prompt_logprobs
        if k is None or request.num_prompt_logprobs_sent >= request.num_prompt_tokens - 1:
            return None
        return k if k >= 0 else 1 << 30

    def _has_prompt_logprobs(self, block: KVCacheBlock, request: Request, index: int, k: int) -> bool:
        """Whether ``block`` (the request's ``index``-th) carries this request's prompt logprobs."""
        lp = block.prompt_logprobs
        # The last row's chosen token is the next block's first token: the hash does not cover it.
        return lp is not None and lp.num_logprobs == k and lp.token_ids[-1][0] == request.all_token_ids[
            (index + 1) * self.block_size]

    def prompt_logprobs_pending(self, request: Request) -> bool:
        """Whether the request's next cacheable block is still being computed by a request that
        will leave its prompt logprobs there: waiting one step then beats recomputing it."""
        k = self.needs_prompt_logprobs(request)
        if not self.enable_caching or k is None or k > MAX_CACHED_PROMPT_LOGPROBS:
            return False
        _, stopped_at = self._cached_run(request, k)
        return stopped_at is not None and stopped_at.prompt_logprobs_pending

    def _cached_run(self, request: Request, k: int | None) -> tuple[list[KVCacheBlock], KVCacheBlock | None]:
        """The request's leading full blocks in the cache (with its prompt logprobs when ``k`` is set),
        and the cached block that ended the run for lacking them (None: the run ended otherwise)."""
        update_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            getattr(request, "mm_features", None))
        hits: list[KVCacheBlock] = []
        # The last token is never taken from the cache: its logits are needed.
        for i, block_hash in enumerate(request.block_hashes[: (request.num_tokens - 1) // self.block_size]):
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                return hits, None
            if k is not None and not self._has_prompt_logprobs(block, request, i, k):
                return hits, block
            hits.append(block)
        return hits, None

    def cached_prompt_logprobs(self, blocks: list[KVCacheBlock], first: int) -> LogprobsLists:
        """The prompt logprobs kept with cache-hit ``blocks``, from position ``first`` on."""
        bs = self.block_size
        out = LogprobsLists([], [], [])
        for i, block in enumerate(blocks):
            lp = block.prompt_logprobs
            assert lp is not None, "a prompt-logprobs hit on a block without them"
            skip = max(first - i * bs, 0)
            if skip >= bs:
                continue
            out.token_ids += lp.token_ids[skip:]
            out.logprobs += lp.logprobs[skip:]
            out.ranks += lp.ranks[skip:]
        return out

    def store_prompt_logprobs(self, request: Request, first: int, rows: LogprobsLists) -> None:
        """Keep the rows a step computed (positions ``first``...) with the request's full cached blocks."""
        k = request.sampling_params.prompt_logprobs
        if not self.enable_caching or k is None or not 0 <= k <= MAX_CACHED_PROMPT_LOGPROBS or not rows.ranks:
            return
        buf = self._prompt_logprob_rows.get(request.request_id)
        if buf is None or buf.end != first:
            # The first rows, or a fresh run after a preemption: rows before ``first`` are not here.
            buf = self._prompt_logprob_rows[request.request_id] = _PromptLogprobRows(first)
        buf.token_ids += rows.token_ids
        buf.logprobs += rows.logprobs
        buf.ranks += rows.ranks
        bs = self.block_size
        i = cdiv(buf.first, bs)
        # A block is complete once its last position's row (which predicts the next token) is here.
        while (i + 1) * bs <= buf.end and i < len(request.block_hashes):
            a, b = i * bs - buf.first, (i + 1) * bs - buf.first
            # The block that lookups find by this hash: its KV is this request's, token for token.
            block = self.block_pool.get_cached_block(request.block_hashes[i])
            if block is not None:
                block.prompt_logprobs = BlockPromptLogprobs(k, buf.token_ids[a:b], buf.logprobs[a:b],
                                                            buf.ranks[a:b])
                block.prompt_logprobs_pending = False
            i += 1
        done = i * bs - buf.first
        if done > 0:
            del buf.token_ids[:done], buf.logprobs[:done], buf.ranks[:done]
            buf.first += done

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVCacheBlock] | None = None,
        cache: bool = True, num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request room for ``num_new_tokens`` more tokens; None when the pool is short.

        ``num_lookahead_tokens`` more slots are allocated (not cached) for a draft model's proposals.

        ``cache=False`` keeps the new blocks out of the prefix cache for now: their content
        arrives later (from a prefill instance), and another request must not share them before.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
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
        update_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                            getattr(request, "mm_features", None))
        k = self.needs_prompt_logprobs(request)
        # Prompt positions whose rows this request computes (the last prompt token predicts nothing).
        owes = k is not None and k <= MAX_CACHED_PROMPT_LOGPROBS
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
            if owes and blocks[i].block_hash is not None and blocks[i].prompt_logprobs is None \
                    and (i + 1) * self.block_size < request.num_prompt_tokens:
                blocks[i].prompt_logprobs_pending = True
        self.num_cached_block[request.request_id] = num_full

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self._prompt_logprob_rows.pop(request.request_id, None)
        for block in blocks:
            # Whoever was computing their prompt logprobs is gone (finished, aborted, preempted).
            block.prompt_logprobs_pending = False
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """Queries and hits (in tokens) since the last call."""
        stats = (self.prefix_cache_queries, self.prefix_cache_hits)
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        return stats
