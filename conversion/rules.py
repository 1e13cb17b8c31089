"""The one engine behind every family's declarative table: apply (pattern, target, fn) rows, checked both ways."""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from flax import traverse_util

Rule = tuple[str, str, Callable[[np.ndarray], np.ndarray]]


def apply_rules(state: dict[str, np.ndarray], rules: Sequence[Rule], expected: dict[str, tuple]) -> dict:
    """HF-named numpy tensors -> nested Linen params (f32 jax arrays).

    Fails unless every source tensor is used, every expected param (flat "a/b/c" path -> shape) is
    written exactly once with its shape, and nothing else is written.
    """
    flat, used = {}, set()
    for name, w in state.items():
        for pattern, target, fn in rules:
            m = re.fullmatch(pattern, name)
            if m:
                path = target.format(*m.groups())
                if path in flat:
                    raise ValueError(f"{name}: param {path} written twice")
                flat[path] = np.asarray(fn(np.asarray(w).astype(np.float32)))
                used.add(name)
                break
    unused, unwritten = sorted(set(state) - used), sorted(expected.keys() - flat.keys())
    extra = sorted(flat.keys() - expected.keys())
    if unused or unwritten or extra:
        raise ValueError(
            f"checkpoint/model mismatch: unused source tensors {unused}, params never written {unwritten}, "
            f"params the model does not declare {extra}")
    bad = {p: (flat[p].shape, s) for p, s in expected.items() if flat[p].shape != s}
    if bad:
        raise ValueError(f"shape mismatch (got, expected): {bad}")
    return traverse_util.unflatten_dict({p: jnp.asarray(w) for p, w in flat.items()}, sep="/")
