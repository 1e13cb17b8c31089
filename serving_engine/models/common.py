"""What the family files share: the model value handed to forward_paged / compute_logits."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

__all__ = ["PagedModel"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"], meta_fields=["config"])
@dataclasses.dataclass(frozen=True)
class PagedModel:
    """A family's frozen (hashable) config and its Linen `params` tree as one pytree: the JAX
    counterpart of the torch twin's nn.Module. The config is static under jit, the params are data."""
    config: Any
    params: dict
