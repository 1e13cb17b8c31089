"""Attention kernels of the JAX serving engine: a Pallas ragged paged-attention kernel, its
schedule as dense jnp (the CPU path), its plain-jnp reference, and the paged KV-cache write."""

from serving_engine.kernels.blocked_attention import ragged_paged_attention_blocked
from serving_engine.kernels.dispatch import paged_attention
from serving_engine.kernels.ragged_paged_attention import (
    BlockSizes,
    kernel_supports,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)
from serving_engine.kernels.write_kv import write_to_kv_cache

__all__ = [
    "BlockSizes",
    "kernel_supports",
    "paged_attention",
    "ragged_paged_attention",
    "ragged_paged_attention_blocked",
    "ragged_paged_attention_reference",
    "write_to_kv_cache",
]
