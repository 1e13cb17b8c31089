"""Write the new tokens' K/V into the paged cache by flat slot (vLLM's reshape_and_cache)."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["write_to_kv_cache"]


def write_to_kv_cache(k_pages, v_pages, k_new, v_new, slot_mapping):
    """Scatter one step's K/V into the cache.

    Args:
      k_pages, v_pages: f32[P, S, K, H] paged cache.
      k_new, v_new: f32[T, K, H] the step's keys and values, flat tokens.
      slot_mapping: i32[T] `page * S + offset` per token; -1 (vLLM's PAD_SLOT_ID) for padding.

    Returns:
      (k_pages, v_pages) updated. Pure: call it inside the step's jit with the cache donated
      (`donate_argnums`) and XLA updates the buffers in place.
    """
    num_pages, page_size, num_kv_heads, head_dim = k_pages.shape
    num_slots = num_pages * page_size
    # Negative indices wrap (NumPy style) even with mode="drop", so send padding past the end.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)

    def write(pages, new):
        flat = pages.reshape(num_slots, num_kv_heads, head_dim)
        return flat.at[slots].set(new.astype(pages.dtype), mode="drop").reshape(pages.shape)

    return write(k_pages, k_new), write(v_pages, v_new)
