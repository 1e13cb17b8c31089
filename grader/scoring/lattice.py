"""Check results and the strict level lattice of DESIGN section 5: a task earns a prefix of levels.

Each check has a strict bar: 1 for spec checks, 1 - max(1e-3, 10 x the check's measured noise) for
the others (`strict_bar`). A check passes strictly at or above its bar. A level passes when it has at
least one check and every check in it passes strictly; the earned level is the highest L such that
every level <= L passes. A level with no results (not run, or not recorded) is not earned, so an
interrupted grading run can never claim the levels it skipped. The continuous reward
(grader/scoring/reward.py) is untouched by any bar.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable

__all__ = ["ASPECTS", "Check", "LEVELS", "NOISE_FACTOR", "STRICT_FLOOR", "earned_levels", "level_passes",
           "strict_bar", "summarise"]

LEVELS = ("L0", "L1", "L2", "L3", "L4", "L5", "L6")
ASPECTS = ("spec", "numeric", "behavioral")
# A faithful fp32 migration scores about 0.999 at worst (the paper's noise ceiling); a check whose score
# moves from run to run gets a bar ten times its noise below 1.
STRICT_FLOOR = 1e-3
NOISE_FACTOR = 10.0


def strict_bar(aspect: str, noise: float | None = None) -> float:
    """1 for spec checks; 1 - max(STRICT_FLOOR, NOISE_FACTOR * noise) for numeric and behavioral ones."""
    if aspect == "spec":
        return 1.0
    noise = float(noise or 0.0)
    if not 0.0 <= noise < 0.1:  # NaN fails too: a noise that large would make the bar meaningless
        raise ValueError(f"check noise {noise!r} not in [0, 0.1)")
    return 1.0 - max(STRICT_FLOOR, NOISE_FACTOR * noise)


@dataclass(frozen=True)
class Check:
    """One graded check: its place in the lattice, its score in [0, 1], and why it failed."""

    level: str                 # "L0".."L6"
    name: str                  # e.g. "logits_b2_t16_pad"
    aspect: str                # "spec" | "numeric" | "behavioral"
    measure: str               # a grader.scoring.measures.MEASURES key, or "pass" for spec checks
    score: float               # in [0, 1]; a crash, torch import, NaN or timeout is 0 with a reason
    reason: str | None = None  # why the score is not 1 (None when nothing went wrong)
    seconds: float = 0.0       # wall-clock the check took
    bar: float | None = None   # strict bar; None = strict_bar(aspect) (no measured noise)
    # What a numerics person reads first (grader.scoring.measures.error_figures; None where they do not apply):
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    digits: float | None = None  # agreeing digits, the log relative error of NIST StRD

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
        bar = strict_bar(self.aspect) if self.bar is None else float(self.bar)
        if not 0.0 < bar <= 1.0 or (self.aspect == "spec" and bar != 1.0):
            raise ValueError(f"{self.name}: strict bar {self.bar!r} not in (0, 1] (spec checks: exactly 1)")
        object.__setattr__(self, "bar", bar)

    @classmethod
    def from_report(cls, entry: dict) -> "Check":
        """A check back from its report entry, which carries more than the check (a timed check's `budget`)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in entry.items() if k in names})

    @classmethod
    def failed(cls, level: str, name: str, aspect: str, measure: str, reason: str,
               seconds: float = 0.0) -> "Check":
        """A check that could not be scored (crash, torch import, NaN, timeout): score 0."""
        return cls(level, name, aspect, measure, 0.0, reason, seconds)

    @property
    def key(self) -> str:
        return f"{self.level}/{self.name}"

    @property
    def passed(self) -> bool:
        """Strict pass: the score reaches the check's bar."""
        return self.score >= self.bar


def level_passes(results: Iterable[Check], level: str) -> bool:
    checks = [c for c in results if c.level == level]
    return bool(checks) and all(c.passed for c in checks)


def earned_levels(results: Iterable[Check]) -> int:
    """The highest level index L (0..6) such that every level <= L passes strictly; -1 when L0 fails."""
    results = list(results)
    earned = -1
    for i, level in enumerate(LEVELS):
        if not level_passes(results, level):
            break
        earned = i
    return earned


def summarise(results: Iterable[Check]) -> dict[str, float]:
    """The plain mean score of each level that has results, in level order."""
    by_level: dict[str, list[float]] = {}
    for c in results:
        by_level.setdefault(c.level, []).append(c.score)
    return {lv: sum(by_level[lv]) / len(by_level[lv]) for lv in LEVELS if lv in by_level}
