"""Causal-LM loss of HF transformers (ForCausalLMLoss), twin of torch_sources/training/loss.py.

Labels shift left (the last position gets -100), CE over labelled tokens, summed and divided
by `num_items_in_batch` (the labelled positions of the whole accumulation step, before the shift,
as LF 0.9.5's transformers counts them), else the token mean of the shifted labels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "count_label_tokens"]

IGNORE_INDEX = -100


def causal_lm_loss(logits, labels, num_items_in_batch=None):
    """logits f32[B,T,V], labels i32[B,T] -> f32 scalar."""
    # A barrier meant to keep XLA:CPU from fusing the softmax's row max into the head's matmul (~1.6x slower fused).
    # jaxlib 0.10's XLA:CPU removes barriers before it fuses, so the two are fused again there (docs/PERFORMANCE.md).
    logits = jax.lax.optimization_barrier(logits.astype(jnp.float32))
    shift_labels = jnp.pad(labels[:, 1:], ((0, 0), (0, 1)), constant_values=IGNORE_INDEX)  # i32[B,T]
    logp = jax.nn.log_softmax(logits, axis=-1)
    # one_hot of -100 is a zero row, so ignored positions add exactly 0; a one-hot product (rather
    # than take_along_axis) keeps the backward pass a dense multiply instead of a scatter
    nll = -jnp.sum(logp * jax.nn.one_hot(shift_labels, logits.shape[-1], dtype=logp.dtype), axis=-1)  # f32[B,T]
    total = jnp.sum(nll)
    if num_items_in_batch is None:
        return total / jnp.sum(shift_labels != IGNORE_INDEX)
    return total / num_items_in_batch


def count_label_tokens(labels) -> int:
    """Labelled positions, before the shift (transformers 5.6's Trainer._get_num_items_in_batch)."""
    return int((np.asarray(labels) != IGNORE_INDEX).sum())
