"""The one engine behind every family's declarative table: apply (pattern, target, fn) rows, checked both ways,
and run them backwards to say which HF tensor, in which HF shape, each param came from."""
from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

Rule = tuple[str, str, Callable[[np.ndarray], np.ndarray]]


def keep(w: np.ndarray) -> np.ndarray:
    return w


def linear(w: np.ndarray) -> np.ndarray:  # torch [out, in] -> flax kernel [in, out]
    return w.T


def declared_shapes(module, with_mask: bool = True) -> dict[str, tuple[int, ...]]:
    """{"a/b/c": shape} of every param a Linen causal LM declares (`jax.eval_shape` of its init: nothing is
    allocated), called as module(ids[, mask])."""
    ids = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(module.init, jax.random.key(0), *((ids, ids) if with_mask else (ids,)))["params"]
    return {path: tuple(leaf.shape) for path, leaf in traverse_util.flatten_dict(shapes, sep="/").items()}


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


def _hf_template(pattern: str) -> str:
    # r"model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj)\.weight" -> "model.layers.{0}.mlp.{1}.weight"
    index = itertools.count()
    return re.sub(r"\\(.)", r"\1", re.sub(r"\([^()]*\)", lambda m: f"{{{next(index)}}}", pattern))


def _target_regex(target: str) -> str:
    # "model/layers_{0}/mlp/{1}/kernel" -> r"model/layers_(?P<g0>[^/]+)/mlp/(?P<g1>[^/]+)/kernel"
    parts = re.split(r"\{(\d+)\}", target)
    return "".join(re.escape(p) if i % 2 == 0 else f"(?P<g{p}>[^/]+)" for i, p in enumerate(parts))


def _source_name(path: str, rules: Sequence[Rule]) -> tuple[str, Callable]:
    """The HF tensor apply_rules writes to `path` (the first rule matching it wins, as in the load)."""
    found = []
    for rule in rules:
        pattern, target, fn = rule
        m = re.fullmatch(_target_regex(target), path)
        if m is None:
            continue
        groups = m.groupdict()
        name = _hf_template(pattern).format(*(groups[f"g{i}"] for i in range(len(groups))))
        if next((r for r in rules if re.fullmatch(r[0], name)), None) is rule:
            found.append((name, fn))
    if len(found) != 1:
        raise ValueError(f"param {path}: written by {len(found)} rules ({[n for n, _ in found]}), expected exactly 1")
    return found[0]


def invert_rules(params, rules: Sequence[Rule]) -> dict[str, tuple[int, ...]]:
    """Nested Linen params -> {HF tensor name: HF shape}: apply_rules run backwards on names and shapes.

    Shapes come from the leaves themselves (arrays or jax.ShapeDtypeStruct), so a leaf stored in
    another layout than its rule's transform writes reports a wrong HF shape. The transforms are
    layout permutations (keep, transpose), each its own inverse on shapes; anything else raises.
    """
    layout = {}
    for path, leaf in traverse_util.flatten_dict(params, sep="/").items():
        name, fn = _source_name(path, rules)
        if name in layout:
            raise ValueError(f"{name}: the source of two params")
        shape = tuple(leaf.shape)
        hf_shape = np.shape(fn(np.broadcast_to(np.float32(0), shape)))  # a view: nothing is allocated
        if np.shape(fn(np.broadcast_to(np.float32(0), hf_shape))) != shape:
            raise ValueError(f"{name}: the transform of param {path} is not its own inverse on shapes")
        layout[name] = tuple(int(d) for d in hf_shape)
    return layout
