"""KV-cache block pool with an LRU free list and a prefix cache of full blocks (host side, plain Python).

Shaped like vllm/v1/core/block_pool.py and docs/design/prefix_caching.md: a block is cached under the chained
hash of its tokens; a freed block keeps its hash and stays findable until the free list hands it out again.
Block 0 is the null block, as in vLLM: never handed out, never cached, never freed. Padding entries of a block
table point at it, so a padded write can never land in a request's KV.

This is the JAX engine's own copy of torch_sources/serving/block_pool.py: an oracle must stand alone, so the
mirror is intended. Keep the code identical to the original (tests/serving/test_serving_bookkeeping.py checks it).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["NONE_HASH", "hash_block_tokens", "KVCacheBlock", "BlockPool"]

# Parent of the first block. vLLM draws it from os.urandom unless PYTHONHASHSEED is set; a constant keeps the
# hashes equal across processes, which the recorder and the JAX engine rely on.
NONE_HASH = hashlib.sha256(b"t2j-refs/serving/none-hash").digest()


def _encode_key(key: int | str | bytes) -> bytes:
    # Tagged and length-prefixed, so (1, "2") and ("12",) can never encode the same.
    if isinstance(key, bool) or not isinstance(key, (int, str, bytes)):
        raise TypeError(f"extra key must be int, str or bytes, got {type(key).__name__}")
    if isinstance(key, int):
        return b"i" + struct.pack("<q", key)
    raw = key.encode("utf-8") if isinstance(key, str) else key
    return (b"s" if isinstance(key, str) else b"b") + struct.pack("<I", len(raw)) + raw


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: Sequence[int | str | bytes] = ()) -> bytes:
    """sha256(parent hash, token ids as little-endian int64, extra keys) -> 32 bytes; parent None means NONE_HASH."""
    h = hashlib.sha256()
    h.update(NONE_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack("<I", len(token_ids)))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        h.update(_encode_key(key))
    return h.digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0  # requests holding the block; 0 means it sits in the free list
    block_hash: bytes | None = None  # set once the block is full and cached


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        # LRU free list: pop from the head, append freed blocks at the tail. An OrderedDict keyed by block id
        # gives the O(1) removal from the middle that touch() needs (vLLM uses an intrusive linked list).
        self.free_list: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        # hash -> {block_id: block}; several blocks may hold the same hash because block tables are append-only.
        self.cached_blocks: dict[bytes, dict[int, KVCacheBlock]] = {}
        self.num_queries = 0  # get_cached_block lookups
        self.num_hits = 0  # lookups that found a block
        self.num_evictions = 0  # cached blocks whose hash was dropped on reuse
        # Block ids as they return to the free list and as their cached hash is evicted, in event order, until
        # take_block_events() hands them over (the scheduler's per-step trace).
        self.freed_block_ids: list[int] = []
        self.evicted_block_ids: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_list)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1  # all but the null block

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        self.num_queries += 1
        blocks = self.cached_blocks.get(block_hash)
        if not blocks:
            return None
        self.num_hits += 1
        return next(iter(blocks.values()))

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Cache blocks[num_cached_blocks:num_full_blocks] of one request under block_hashes[i]."""
        if num_full_blocks > len(block_hashes):
            raise ValueError(f"{num_full_blocks} full blocks but only {len(block_hashes)} hashes")
        for i in range(num_cached_blocks, num_full_blocks):
            # blocks[:num_cached_blocks] hold the prefix hits and what earlier steps cached; the rest are fresh
            block = blocks[i]
            block.block_hash = block_hashes[i]
            self.cached_blocks.setdefault(block.block_hash, {})[block.block_id] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop num_blocks from the free-list head (least recently freed first), evicting their cache entries."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks, only {self.num_free_blocks} are free")
        out = []
        for _ in range(num_blocks):
            _, block = self.free_list.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit with no holder leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_list[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 go to the free-list tail in the given order (first is
        evicted first). The cache keeps their hashes until they are reused."""
        for block in ordered_blocks:
            if block is self.null_block:
                raise ValueError("the null block is never held, so it cannot be freed")
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_list[block.block_id] = block
                self.freed_block_ids.append(block.block_id)

    def take_block_events(self) -> tuple[list[int], list[int]]:
        """(freed, evicted) block ids since the last call, in event order."""
        events = self.freed_block_ids, self.evicted_block_ids
        self.freed_block_ids, self.evicted_block_ids = [], []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no block is held (as in vLLM)."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        same_hash = self.cached_blocks[block.block_hash]
        del same_hash[block.block_id]
        if not same_hash:
            del self.cached_blocks[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1
        self.evicted_block_ids.append(block.block_id)
