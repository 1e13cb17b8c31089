"""A checkpoint layout ({HF tensor name: shape}) as fixed-shape arrays, the same on both sides of L0/param_tree.

The recorder builds the layout from the checkpoint the torch source loads; the child from the
candidate's `conversion.<family>.hf_layout(params)`. The spec measure compares every array exactly.
Numpy only: the recorder and the sandboxed child both import it.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = ["layout_arrays"]


def layout_arrays(layout: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
    """{name: shape} -> names str[N] (sorted), shapes i64[N, max_rank] (padded with -1), ranks i64[N],
    numel_sorted i64[N] and total i64[]."""
    names = sorted(layout)
    shapes = [tuple(int(d) for d in layout[name]) for name in names]
    padded = np.full((len(names), max((len(s) for s in shapes), default=0)), -1, np.int64)
    for i, s in enumerate(shapes):
        padded[i, :len(s)] = s
    numels = [math.prod(s) for s in shapes]
    return {"names": np.array(names, dtype=str), "shapes": padded,
            "ranks": np.array([len(s) for s in shapes], np.int64),
            "numel_sorted": np.array(sorted(numels), np.int64), "total": np.array(sum(numels), np.int64)}
