"""Tensor by tensor, in the order the torch probe returned them: the first tensor that disagrees is the one
reported. The twin's own figures (it never reads the grader's measures): max |d|, max |d| over the torch tensor's
scale, and agreeing digits, -log10(||d|| / ||torch||) capped at 16. NaN is never equal: a non-finite entry that the
torch side does not hold at the same place is a disagreement."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from twin.properties import Property

__all__ = ["DIGITS_CAP", "TensorDiff", "compare_outputs", "diff"]

DIGITS_CAP = 16.0


@dataclass(frozen=True)
class TensorDiff:
    name: str
    shape: tuple[int, ...]           # the torch side's
    candidate_shape: tuple[int, ...] | None
    max_abs: float
    max_rel: float                   # max |d| / max(max |torch|, 1)
    digits: float
    agrees: bool
    why: str | None = None           # shape, dtype or missing: what made it disagree outright

    def row(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


def _exact(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype.kind in "biuUSO" or b.dtype.kind in "biuUSO"


def diff(name: str, got, want, rtol: float) -> TensorDiff:
    """One tensor: `got` the candidate's, `want` the torch source's."""
    want = np.asarray(want)
    if got is None:
        return TensorDiff(name, want.shape, None, math.inf, math.inf, 0.0, False, "missing from the candidate")
    got = np.asarray(got)
    if got.shape != want.shape:
        return TensorDiff(name, want.shape, got.shape, math.inf, math.inf, 0.0, False,
                          f"shape {got.shape} != {want.shape}")
    if _exact(got, want):
        comparable = (got.dtype.kind in "US") == (want.dtype.kind in "US")
        wrong = int(np.sum(got != want)) if comparable else got.size
        return TensorDiff(name, want.shape, got.shape, 0.0 if not wrong else math.inf, 0.0 if not wrong else math.inf,
                          DIGITS_CAP if not wrong else 0.0, not wrong,
                          f"{wrong} of {want.size} entries differ (compared exactly)" if wrong else None)
    a, b = got.astype(np.float64), want.astype(np.float64)
    same = a == b  # equal infinities agree (a masked logit); NaN never does
    if not (np.isfinite(a) | same).all() or not (np.isfinite(b) | same).all():
        return TensorDiff(name, want.shape, got.shape, math.inf, math.inf, 0.0, False, "non-finite entries")
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, a - b)
    scale = max(float(np.abs(np.where(np.isfinite(b), b, 0.0)).max(initial=0.0)), 1.0)
    max_abs = float(np.abs(d).max(initial=0.0))
    norm, err = float(np.linalg.norm(np.where(np.isfinite(b), b, 0.0))), float(np.linalg.norm(d))
    rel = err / norm if norm > 0 else err
    digits = DIGITS_CAP if rel == 0 else float(np.clip(-math.log10(rel), 0.0, DIGITS_CAP))
    return TensorDiff(name, want.shape, got.shape, max_abs, max_abs / scale, digits, max_abs <= rtol * scale)


def compare_outputs(prop: Property, got: dict, want: dict) -> tuple[list[TensorDiff], TensorDiff | None]:
    """Every tensor of the property, and the first that disagrees (None: all agree). A tensor the candidate
    returns that torch does not is ignored; one it lacks disagrees."""
    diffs = [diff(name, got.get(name), value, prop.rtol) for name, value in want.items()]
    return diffs, next((d for d in diffs if not d.agrees), None)
