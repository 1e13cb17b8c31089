"""The spec-gated, threshold-free reward of DESIGN section 7.

    R = spec_pass_fraction * mean(D_numeric, D_behavioral)   over the dimensions that ran

- spec_pass_fraction: the fraction of spec (L0) checks whose score is exactly 1; 1.0 when no
  spec check ran (no gate was applied, so there is nothing to multiply by).
- D_aspect: the plain mean of the scores of that aspect's checks (numeric: L1-L4 single-pass
  checks; behavioral: L4 step loops, L5, L6, invariants). Each check's score is itself the plain
  mean over its elements (see grader.scoring.measures). A dimension with no checks did not run and is
  left out of the mean rather than counted as 0 or 1.
- A crash, a torch import, a NaN or a run past its time budget arrives here as a check with
  score 0 and a reason (grader.scoring.lattice.Check.failed): too slow counts as wrong.
- R = 0.0 when no similarity dimension ran: nothing was measured, so nothing is earned.

Nothing is rounded to pass/fail on the way up: the pass bar of the lattice plays no part here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from grader.scoring.lattice import Check

__all__ = ["DIMENSIONS", "RewardParts", "reward", "reward_parts"]

DIMENSIONS = ("numeric", "behavioral")


@dataclass(frozen=True)
class RewardParts:
    reward: float
    spec_pass_fraction: float
    dimensions: dict[str, float]  # aspect -> plain mean of its checks, only those that ran
    failures: tuple[str, ...]     # "L3/logits_b1_t7: timeout" for every check with a reason


def reward_parts(results: Iterable[Check]) -> RewardParts:
    """The reward together with the numbers it was made of (for reports)."""
    results = list(results)
    spec = [c for c in results if c.aspect == "spec"]
    spec_pass_fraction = sum(c.score == 1.0 for c in spec) / len(spec) if spec else 1.0
    dimensions = {}
    for aspect in DIMENSIONS:
        scores = [c.score for c in results if c.aspect == aspect]
        if scores:
            dimensions[aspect] = sum(scores) / len(scores)
    similarity = sum(dimensions.values()) / len(dimensions) if dimensions else 0.0
    failures = tuple(f"{c.key}: {c.reason}" for c in results if c.reason)
    return RewardParts(spec_pass_fraction * similarity, spec_pass_fraction, dimensions, failures)


def reward(results: Iterable[Check]) -> float:
    """R = spec_pass_fraction * mean(score of each similarity dimension that ran); see module doc."""
    return reward_parts(results).reward
