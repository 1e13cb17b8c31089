"""Check results and the level lattice of DESIGN section 5: a task earns a prefix of levels.

A level passes when it has at least one check, every spec check in it scored exactly 1 and every
numeric or behavioral check scored at least the pass bar. The earned level is the highest L such
that every level <= L passes. A level with no results (not run, or not recorded) is not earned,
so an interrupted grading run can never claim the levels it skipped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

__all__ = ["ASPECTS", "Check", "LEVELS", "PASS_BAR", "earned_levels", "level_passes", "summarise"]

LEVELS = ("L0", "L1", "L2", "L3", "L4", "L5", "L6")
ASPECTS = ("spec", "numeric", "behavioral")
PASS_BAR = 0.99  # default bar for numeric/behavioral checks; spec checks need exactly 1


@dataclass(frozen=True)
class Check:
    """One graded check: its place in the lattice, its score in [0, 1], and why it failed."""

    level: str                 # "L0".."L6"
    name: str                  # e.g. "logits_b2_t16_pad"
    aspect: str                # "spec" | "numeric" | "behavioral"
    measure: str               # a grader.measures.MEASURES key, or "pass" for spec checks
    score: float               # in [0, 1]; a crash, torch import, NaN or timeout is 0 with a reason
    reason: str | None = None  # why the score is not 1 (None when nothing went wrong)
    seconds: float = 0.0       # wall-clock the check took

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"{self.name}: level {self.level!r} not in {LEVELS}")
        if self.aspect not in ASPECTS:
            raise ValueError(f"{self.name}: aspect {self.aspect!r} not in {ASPECTS}")
        try:
            score = float(self.score)  # numpy scalars in, plain floats stored
        except (TypeError, ValueError):
            score = math.nan
        if not 0.0 <= score <= 1.0:
            # NaN fails this too: a measure never returns NaN, so one here is a grader bug
            raise ValueError(f"{self.name}: score {self.score!r} is not a number in [0, 1]")
        object.__setattr__(self, "score", score)

    @classmethod
    def failed(cls, level: str, name: str, aspect: str, measure: str, reason: str,
               seconds: float = 0.0) -> "Check":
        """A check that could not be scored (crash, torch import, NaN, timeout): score 0."""
        return cls(level, name, aspect, measure, 0.0, reason, seconds)

    @property
    def key(self) -> str:
        return f"{self.level}/{self.name}"

    def passed(self, pass_bar: float = PASS_BAR) -> bool:
        return self.score == 1.0 if self.aspect == "spec" else self.score >= pass_bar


def level_passes(results: Iterable[Check], level: str, pass_bar: float = PASS_BAR) -> bool:
    checks = [c for c in results if c.level == level]
    return bool(checks) and all(c.passed(pass_bar) for c in checks)


def earned_levels(results: Iterable[Check], pass_bar: float = PASS_BAR) -> int:
    """The highest level index L (0..6) such that every level <= L passes; -1 when L0 fails."""
    if not (0.0 <= pass_bar <= 1.0) or math.isnan(pass_bar):
        raise ValueError(f"pass_bar {pass_bar!r} not in [0, 1]")
    results = list(results)
    earned = -1
    for i, level in enumerate(LEVELS):
        if not level_passes(results, level, pass_bar):
            break
        earned = i
    return earned


def summarise(results: Iterable[Check]) -> dict[str, float]:
    """The plain mean score of each level that has results, in level order."""
    by_level: dict[str, list[float]] = {}
    for c in results:
        by_level.setdefault(c.level, []).append(c.score)
    return {lv: sum(by_level[lv]) / len(by_level[lv]) for lv in LEVELS if lv in by_level}
