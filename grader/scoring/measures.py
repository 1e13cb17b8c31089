"""The five similarity measures of DESIGN section 6. Each returns a float in [0, 1]; 1 = identical.

Shared rules:
- both operands are promoted to float32 first (agreement compares integral operands as int64),
  so a float64 candidate gains nothing over a float32 one; the arithmetic on the promoted values
  then runs in float64 so that long reductions add no rounding error of their own;
- NaN, +-inf or a shape mismatch scores 0 (the distributional measure reads -inf logits as
  probability 0, see there); so does an operand that is not numeric at all;
- EPS guards divisions only, it never shifts a score;
- operands that are exactly equal after promotion score 1, including empty ones: nothing in the
  formulas forces 0 on them (an all-zero LoRA-A gradient at step 0 is right, not wrong);
- a score is never NaN.

`score(measure, candidate, reference, **kw)` dispatches on a check's measure name; for "banded",
`reference` is the band `(lo, hi)` (the reference's run-to-run spread, `/L6/band` in the HDF5).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

__all__ = ["DIGITS_CAP", "EPS", "MEASURES", "agreement_score", "banded_scalar_score", "distributional_score",
           "error_figures", "scalar_score", "score", "tensor_score"]

EPS = 1e-12
_LN2 = math.log(2.0)


def _f32(x) -> np.ndarray | None:
    """Promote to float32, then widen to float64 for the arithmetic; None when not numeric."""
    try:
        with np.errstate(over="ignore"):  # float64 past float32's range becomes inf -> scored 0
            return np.asarray(x, dtype=np.float32).astype(np.float64)
    except (TypeError, ValueError):
        return None


def _pair(a, b) -> tuple[np.ndarray, np.ndarray] | None:
    """Both operands promoted, same shape and all finite; None when the pair must score 0."""
    a, b = _f32(a), _f32(b)
    if a is None or b is None or a.shape != b.shape:
        return None
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return None
    return a, b


def _unit(x: float) -> float:
    x = float(x)
    return 0.0 if math.isnan(x) else min(1.0, max(0.0, x))


def tensor_score(a, b) -> float:
    """sqrt(max(0, cos(a, b)) * min(|a|, |b|) / max(|a|, |b|)) over all elements.

    The norm ratio is what makes a uniform scaling bug (a dropped LoRA scaling, a wrong softmax
    scale downstream) cost score, which a cosine alone would miss.
    """
    pair = _pair(a, b)
    if pair is None:
        return 0.0
    a, b = pair
    if a.size == 0 or np.array_equal(a, b):
        return 1.0
    a, b = a.ravel(), b.ravel()
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    cos = float(a @ b) / (max(na, EPS) * max(nb, EPS))
    ratio = min(na, nb) / max(na, nb, EPS)
    return _unit(math.sqrt(min(1.0, max(0.0, cos)) * ratio))


def _scalar_elementwise(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.maximum(0.0, 1.0 - 2.0 * np.abs(a - b) / (np.abs(a) + np.abs(b) + EPS))


def scalar_score(a, b) -> float:
    """max(0, 1 - 2|a - b| / (|a| + |b| + eps)), elementwise, then the plain mean for arrays.

    0 once two values differ by their own mean magnitude; exactly equal values (zeros too) score 1.
    """
    pair = _pair(a, b)
    if pair is None:
        return 0.0
    a, b = pair
    if a.size == 0:
        return 1.0
    return _unit(_scalar_elementwise(a, b).mean())


def _log_softmax(x: np.ndarray) -> np.ndarray:  # f64[P,V], every row with a finite entry
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


def _kl_to_mixture(logp: np.ndarray, logm: np.ndarray) -> np.ndarray:  # f64[P,V] -> f64[P]
    p = np.exp(logp)
    with np.errstate(invalid="ignore"):  # 0 * (-inf) on zero-probability entries; 0 log 0 = 0
        terms = np.where(p > 0, p * (logp - logm), 0.0)
    return terms.sum(axis=-1)


def distributional_score(a, b, axis: int = -1, mask=None) -> float:
    """1 - sqrt(JSD(softmax(a), softmax(b)) / ln 2) per position, averaged over positions.

    a, b: logits, f32[..., V] with the vocabulary on `axis`; every other axis indexes positions.
    mask: optional bool of the positions' shape (a.shape without `axis`), True = scored; masked
    positions are ignored entirely, so padding may hold anything. A -inf logit is probability 0
    (sampler transforms write -inf on purpose); NaN, +inf or a position with no finite logit
    scores 0. Blind to a per-position additive constant, not to temperature.
    """
    a, b = _f32(a), _f32(b)
    if a is None or b is None or a.shape != b.shape:
        return 0.0
    if a.ndim == 0:
        raise ValueError("distributional_score needs logits with a vocabulary axis, got a scalar")
    a, b = np.moveaxis(a, axis, -1), np.moveaxis(b, axis, -1)
    positions = a.shape[:-1]
    if mask is None:
        valid = np.ones(positions, dtype=bool)
    else:
        valid = np.asarray(mask, dtype=bool)
        if valid.shape != positions:
            raise ValueError(f"mask shape {valid.shape} != positions shape {positions}")
    a, b = a[valid], b[valid]  # f64[P,V]
    if a.size == 0:
        return 1.0
    for x in (a, b):
        if np.isnan(x).any() or np.isposinf(x).any() or not np.isfinite(x).any(axis=-1).all():
            return 0.0
    if np.array_equal(a, b):
        return 1.0
    logp, logq = _log_softmax(a), _log_softmax(b)
    logm = np.logaddexp(logp, logq) - _LN2
    jsd = 0.5 * (_kl_to_mixture(logp, logm) + _kl_to_mixture(logq, logm))  # nats, f64[P]
    per_position = 1.0 - np.sqrt(np.clip(jsd / _LN2, 0.0, 1.0))
    return _unit(per_position.mean())


def banded_scalar_score(a, lo, hi) -> float:
    """1 inside [lo, hi]; outside, the scalar measure of `a` against the nearest band edge.

    The band is the reference's own run-to-run spread (seed-varied runs), so any value the
    reference itself could have produced scores 1. Arrays: elementwise, then the plain mean;
    lo and hi are scalars or arrays of `a`'s shape (a candidate of another shape scores 0).
    """
    a = _f32(a)
    lo, hi = _f32(lo), _f32(hi)
    if lo is None or hi is None or not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        raise ValueError(f"band edges must be finite numbers, got lo={lo!r} hi={hi!r}")
    if (lo > hi).any():
        raise ValueError(f"empty band: lo={lo} > hi={hi}")
    if a is None or not np.isfinite(a).all():
        return 0.0
    band_shape = np.broadcast_shapes(lo.shape, hi.shape)
    if band_shape and a.shape != band_shape:
        return 0.0
    if a.size == 0:
        return 1.0
    lo, hi = np.broadcast_to(lo, a.shape), np.broadcast_to(hi, a.shape)
    edge = np.where(a < lo, lo, np.where(a > hi, hi, a))  # the nearest edge; `a` itself inside
    return _unit(_scalar_elementwise(a, edge).mean())


def agreement_score(a, b) -> float:
    """The fraction of equal elements, for discrete outputs (token ids, label masks, block tables).

    Integral or bool operands compare as int64, anything else as float32. A shape mismatch
    scores 0; two empty arrays of the same shape score 1.
    """
    try:
        a, b = np.asarray(a), np.asarray(b)
    except (TypeError, ValueError):
        return 0.0
    if a.shape != b.shape:
        return 0.0
    if a.size == 0:
        return 1.0
    if a.dtype.kind in "biu" and b.dtype.kind in "biu":
        return _unit(np.mean(a.astype(np.int64) == b.astype(np.int64)))
    pair = _pair(a, b)
    if pair is None:
        return 0.0
    a, b = pair
    return _unit(np.mean(a == b))


def _banded(candidate, reference, **kw) -> float:
    lo, hi = reference  # the band: [lo, hi], scalars or arrays of the candidate's shape
    return banded_scalar_score(candidate, lo, hi, **kw)


MEASURES: dict[str, Callable[..., float]] = {
    "tensor": tensor_score,
    "scalar": scalar_score,
    "distributional": distributional_score,
    "banded": banded_scalar_score,
    "agreement": agreement_score,
}

_DISPATCH: dict[str, Callable[..., float]] = {**MEASURES, "banded": _banded}


DIGITS_CAP = 15.0  # the most digits float64 arithmetic can certify (NIST StRD caps its LRE the same way)


def error_figures(pairs) -> dict[str, float] | None:
    """max |a - b|, ||a - b|| / ||b|| and agreeing digits over every (candidate, reference) pair of a check.

    Digits are the log relative error of NIST's StRD: -log10(||a - b|| / ||b||) (-log10 ||a - b|| when the
    reference is all zero), clipped to [0, DIGITS_CAP]; identical operands have DIGITS_CAP digits.
    Entries where both sides hold the same infinity (-inf logits of a masked sampler row) count as equal;
    any other non-finite entry or a shape mismatch gives inf error and 0 digits. None when no pair is
    numeric (nothing to report).
    """
    diffs, refs = [], []
    for a, b in pairs:
        a, b = _f32(a), _f32(b)
        if a is None or b is None:
            continue
        if a.shape != b.shape:
            return {"max_abs_diff": math.inf, "rel_l2": math.inf, "digits": 0.0}
        same = a == b  # equal infinities included
        if not (np.isfinite(a) | same).all() or not (np.isfinite(b) | same).all():
            return {"max_abs_diff": math.inf, "rel_l2": math.inf, "digits": 0.0}
        with np.errstate(invalid="ignore"):  # inf - inf where both are equal: replaced by 0
            diffs.append(np.where(same, 0.0, a - b).ravel())
        refs.append(np.where(np.isfinite(b), b, 0.0).ravel())
    if not diffs:
        return None
    d, r = np.concatenate(diffs), np.concatenate(refs)
    if d.size == 0:
        return {"max_abs_diff": 0.0, "rel_l2": 0.0, "digits": DIGITS_CAP}
    err, norm = float(np.linalg.norm(d)), float(np.linalg.norm(r))
    rel = err / norm if norm > 0 else err
    digits = DIGITS_CAP if rel == 0 else float(np.clip(-math.log10(rel), 0.0, DIGITS_CAP))
    return {"max_abs_diff": float(np.abs(d).max()), "rel_l2": rel, "digits": digits}


def score(measure: str, candidate, reference, **kw) -> float:
    """Score `candidate` against `reference` with the named measure (a key of MEASURES).

    For "banded", `reference` is the band (lo, hi). Extra keywords go to the measure
    (`axis`, `mask` for "distributional").
    """
    try:
        fn = _DISPATCH[measure]
    except KeyError:
        raise ValueError(f"unknown measure {measure!r}; known: {sorted(MEASURES)}") from None
    return fn(candidate, reference, **kw)
