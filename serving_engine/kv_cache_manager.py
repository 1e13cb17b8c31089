"""Per-request block tables on top of the block pool, with prefix-cache lookup (host side, plain Python).

Shaped like vllm/v1/core/kv_cache_manager.py for one full-attention KV-cache group: every layer shares one
block table per request (sliding windows are applied as a mask, not by freeing blocks).

This is the JAX engine's own copy of torch_sources/serving/kv_cache_manager.py: an oracle must stand alone, so the
mirror is intended. Keep the code identical to the original (tests/serving/test_serving_bookkeeping.py checks it).
"""
from __future__ import annotations

from collections.abc import Sequence

from .block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from .request import Request

__all__ = ["KVCacheManager"]


class KVCacheManager:
    def __init__(self, block_size: int, num_blocks: int, enable_caching: bool = False):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of each request already in the cache map
        self.num_prefix_hit_blocks = 0  # prefix-cache hits taken by allocate_slots (committed, not just looked up)

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached FULL blocks from the start of the request -> (blocks, num hit tokens).

        The hit never covers the last token: at least one token must run through the model to give logits,
        so a fully cached prompt recomputes its last block (vLLM caps the hit at num_tokens - 1). A request that
        asks for prompt logprobs gets no hit: every prompt position must run through the model (as in vLLM).
        """
        if (not self.enable_caching or request.num_computed_tokens > 0
                or request.sampling_params.prompt_logprobs is not None):
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens after the computed tokens (request.num_computed_tokens plus the
        prefix-cache hit new_computed_blocks). Returns the newly allocated blocks, or None when the free blocks
        do not suffice (the caller preempts); on None nothing has changed."""
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid, [])
        if new_computed_blocks and req_blocks:
            raise ValueError(f"request {rid} already holds blocks; prefix hits are only taken at first scheduling")
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_required - len(req_blocks) - len(new_computed_blocks))
        # A hit block nobody holds sits in the free list; taking it shrinks what get_new_blocks can hand out.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_evictable_hits:
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[rid] = len(new_computed_blocks)
            self.num_prefix_hit_blocks += len(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        self.req_to_blocks[rid] = req_blocks

        if self.enable_caching:
            # Blocks that become full this step are cached now: their KV is written in this step's forward pass,
            # before any later step could read them through a hit.
            self._update_block_hashes(request)
            num_full = min(num_computed + num_new_tokens, request.num_tokens) // self.block_size
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes,
                                              self.num_cached_blocks.get(rid, 0), num_full)
            self.num_cached_blocks[rid] = max(num_full, self.num_cached_blocks.get(rid, 0))
        return new_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first, so its tail (the least shareable) is evicted first."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    def _update_block_hashes(self, request: Request) -> None:
        # Extend the chain over every block of all_token_ids that has become full (prompt and outputs).
        bs, hashes = self.block_size, request.block_hashes
        num_full = request.num_tokens // bs
        if len(hashes) >= num_full:
            return
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            start, end = i * bs, (i + 1) * bs
            extra = tuple(h for off, n, h in request.mm_placeholders if off < end and off + n > start)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[start:end], extra))
