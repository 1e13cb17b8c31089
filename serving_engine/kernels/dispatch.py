"""`paged_attention`: one entry point over the three ragged paged-attention implementations."""

from __future__ import annotations

import jax

from serving_engine.kernels.blocked_attention import ragged_paged_attention_blocked
from serving_engine.kernels.ragged_paged_attention import (BlockSizes, kernel_supports, ragged_paged_attention,
                                                           ragged_paged_attention_reference)

__all__ = ["paged_attention"]


def paged_attention(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks=None, *,
    sm_scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    impl: str = "auto", block_sizes: BlockSizes = BlockSizes(), max_q_len: int | None = None,
):
    """`impl`: "kernel" (compiled Pallas), "interpret" (Pallas body as JAX ops), "blocked" (the
    kernel's schedule in dense jnp, blocked_attention.py), "reference" (plain jnp) or "auto": the
    kernel on a GPU backend when `kernel_supports` the shapes, else "blocked". max_q_len: static
    bound on any live sequence's new tokens (1 in a pure decode step; None = T), used by "blocked".
    Same arguments and result as `ragged_paged_attention`."""
    if impl == "auto":
        on_gpu = jax.default_backend() == "gpu"
        fits = kernel_supports(q.shape, k_pages.shape, block_sizes)
        impl = "kernel" if on_gpu and fits else "blocked"
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sinks)
    opts = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if impl == "reference":
        return ragged_paged_attention_reference(*args, **opts)
    if impl == "blocked":
        return ragged_paged_attention_blocked(*args, **opts, max_q_len=max_q_len)
    if impl in ("kernel", "interpret"):
        return ragged_paged_attention(*args, **opts, interpret=impl == "interpret",
                                      block_sizes=block_sizes)
    raise ValueError(f"unknown impl {impl!r}")
