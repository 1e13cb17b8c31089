"""Paged KV cache of the JAX serving engine, and the two operations on it.

Twin of torch_sources/serving/paged_attention.py. The cache is an explicit value (STYLE P4): a
registered dataclass pytree that every step takes as an argument and returns updated; the step
function donates it, so XLA writes the new K/V in place. Layer i owns `k[i]`, `v[i]` of shape
f32[P, S, K_i, H_i] (P pages of S = block_size slots; Gemma 4 full-attention layers have a larger
head_dim than its sliding ones). A KV-shared layer (Gemma 4's last `num_kv_shared_layers`) owns no
cache: its entry is None and it reads the cache of `config.kv_source_layer(i)`.

`write_to_kv_cache` and `ragged_paged_attention` keep the kernel's signature and delegate to
serving_engine/kernels: the compiled Pallas kernel on a GPU backend, the kernel's schedule as dense jnp
on CPU (DESIGN section 11); `impl=` overrides the choice (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from serving_engine import kernels

__all__ = ["PagedKVCache", "AttentionMetadata", "allocate_kv_cache", "layer_kv_shapes", "write_to_kv_cache",
           "ragged_paged_attention"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=["block_size"])
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    k: tuple[jax.Array | None, ...]  # per layer f32[P,S,K,H]; None = KV-shared layer (no cache)
    v: tuple[jax.Array | None, ...]
    block_size: int

    def replace_layer(self, i: int, k_pages, v_pages) -> "PagedKVCache":
        """A new cache whose layer i holds (k_pages, v_pages); the others are shared."""
        k, v = list(self.k), list(self.v)
        k[i], v[i] = k_pages, v_pages
        return dataclasses.replace(self, k=tuple(k), v=tuple(v))


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot_mapping", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"],
                   meta_fields=["impl", "max_q_len"])
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """What every layer's paged attention needs for one step (vLLM's FlashAttentionMetadata)."""
    slot_mapping: jax.Array  # i32[T] cache slot of each new token, -1 = padding
    kv_lens: jax.Array  # i32[max_seqs] cached + new tokens per sequence (0 for padding rows)
    page_indices: jax.Array  # i32[max_seqs, pages_per_seq] block table
    cu_q_lens: jax.Array  # i32[max_seqs+1] first flat token of each sequence
    num_seqs: jax.Array  # i32[1] live sequences
    impl: str = "auto"  # attention implementation, see ragged_paged_attention
    # Static: a bound on any sequence's new tokens this step (1 = pure decode; None = the token bucket).
    # vLLM's max_query_len; it sizes the CPU path's query blocks.
    max_q_len: int | None = None


def layer_kv_shapes(model_config) -> list[tuple[int, int] | None]:
    """(num_kv_heads, head_dim) of every layer's cache, None for a layer that owns none.
    Gemma 4's config answers per layer (`layer_num_kv_heads`, `layer_head_dim`, `is_kv_shared`);
    a uniform model (Llama) has one shape for all layers."""
    c = model_config
    if hasattr(c, "is_kv_shared"):
        return [None if c.is_kv_shared(i) else (c.layer_num_kv_heads(i), c.layer_head_dim(i))
                for i in range(c.num_hidden_layers)]
    return [(c.num_key_value_heads, c.head_dim)] * c.num_hidden_layers


def allocate_kv_cache(model_config, engine_config) -> PagedKVCache:
    """Zero-filled cache of `engine_config.num_blocks` pages of `engine_config.block_size` slots."""
    P, S = engine_config.num_blocks, engine_config.block_size
    pages = [None if s is None else jnp.zeros((P, S, *s), jnp.float32)
             for s in layer_kv_shapes(model_config)]
    # Separate buffers for k and v: both are donated and updated in place, so they must not alias.
    return PagedKVCache(k=tuple(pages), v=tuple(None if p is None else jnp.zeros_like(p) for p in pages),
                        block_size=S)


def write_to_kv_cache(k_pages, v_pages, k_new, v_new, slot_mapping):
    """k_pages, v_pages f32[P,S,K,H]; k_new, v_new f32[T,K,H]; slot_mapping i32[T]
    (page * S + offset, -1 = padding, not written) -> (k_pages, v_pages) updated."""
    return kernels.write_to_kv_cache(k_pages, v_pages, k_new, v_new, slot_mapping)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: float, sliding_window: int | None = None,
                           soft_cap: float | None = None, sinks=None, impl: str = "auto",
                           max_q_len: int | None = None):
    """q f32[T,N,H] (flat new tokens of all sequences); k_pages, v_pages f32[P,S,K,H] already
    holding them; kv_lens i32[max_seqs] (new tokens included); page_indices
    i32[max_seqs, pages_per_seq]; cu_q_lens i32[max_seqs+1]; num_seqs i32[1] -> f32[T,N,H].
    Bottom-right causal, optional sliding window (W keys including self), soft cap and attention sinks
    (sinks f32[N]: one logit per query head in the softmax normaliser only, GPT-OSS).
    impl: "auto" (Pallas kernel on GPU, blocked jnp elsewhere), "kernel", "interpret", "blocked",
    "reference"; max_q_len: see AttentionMetadata."""
    return kernels.paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks,
                                   sm_scale=sm_scale, sliding_window=sliding_window,
                                   soft_cap=soft_cap, impl=impl, max_q_len=max_q_len)
