"""The L5/L6 time budget: too slow is wrong, at a bar relative to the machine that grades.

Per level, one budget shared by the level's checks (one child runs them all), in CPU seconds of the child's
whole process tree on the grader's own clock (grader/isolation/clock.py):

    budget = speed x (headroom x O + factor x T)

O is the CPU seconds the repo's JAX oracle needs for the level's child (interpreter start, imports, checkpoint
conversion, tracing, compilation and the run itself), measured by `make calibrate` (`python -m grader.timing.calibrate`)
on the grader's clock and kept in grader/timing/budgets.yaml with the calibration machine's speed-probe figure. T is
the torch source's recorded seconds of the level's checks (each check's `seconds` attr in the reference,
recorded on that same kind of machine). speed is this machine's speed-probe CPU seconds over the calibration
machine's (grader/timing/speed.py). In words: a candidate may take twice what the oracle takes plus one more run of
the PyTorch original, here. Past compilation a jitted step beats the torch engine's eager one, while an engine
dispatching op by op runs ~14x slower than torch over L5 long_decode's thousand steps: that is the tell.

CPU seconds, because other processes' load does not inflate them (a child waiting for a core accrues none) and
a machine with fewer cores runs the same work in about the same CPU time; a wall-clock limit of
wall_factor x budget + startup backs it up against a child that sleeps or blocks. The child is killed at
budget + grace (the time to write what it finished); the child's own copy of the budget (grader/probes/
common.py) only lets an honest child stop in time and keep the checks it finished.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from grader.timing.speed import machine_speed


ROOT = Path(__file__).resolve().parents[2]
BUDGETS = Path(__file__).with_name("budgets.yaml")
TIMED_LEVELS = ("L5", "L6")


@dataclass(frozen=True)
class BudgetPolicy:
    headroom: float = 2.0  # x the oracle's calibrated CPU seconds of the level's child
    factor: float = 1.0  # + x the torch source's recorded seconds
    grace_frac: float = 0.05  # the child is killed at budget x (1 + grace_frac) + grace_s: what it needs to
    grace_s: float = 1.0  # write its outputs once its own copy of the budget stops it
    wall_factor: float = 3.0  # wall-clock backstop: wall_factor x budget + wall_slack_s
    wall_slack_s: float = 30.0  # the sealed child's start on a loaded machine
    uncalibrated_cpu_s: float = 120.0  # O where grader/timing/budgets.yaml has no entry for the task
    scale: bool = True  # False: budgets as calibrated, unscaled by this machine's speed (tests)

    @classmethod
    def from_cfg(cls, node) -> "BudgetPolicy":
        d = dict(node)
        return cls(**{k: (bool(v) if k == "scale" else float(v)) for k, v in d.items()})

    def kill_at(self, budget_s: float) -> float:
        return budget_s * (1.0 + self.grace_frac) + self.grace_s

    def wall_limit(self, budget_s: float) -> float:
        return self.wall_factor * budget_s + self.wall_slack_s


@dataclass(frozen=True)
class Calibration:
    oracle_cpu_s: dict[str, dict[str, float]]  # task -> level -> CPU seconds of the oracle's child
    probe_cpu_s: float | None  # the speed probe on the calibration machine
    measured_on: str | None = None
    compile_s: dict[str, dict[str, float]] | None = None  # the oracle's compile seconds (informative)


def load_calibration(path: Path = BUDGETS) -> Calibration:
    if not path.is_file():
        return Calibration({}, None)
    data = yaml.safe_load(path.read_text()) or {}

    def table(key):
        t = data.get(key) or {}
        if not isinstance(t, dict):
            raise ValueError(f"{path}: {key} must map task -> {{level: seconds}}")
        return {str(k): {str(lv): float(s) for lv, s in (levels or {}).items()} for k, levels in t.items()}
    probe = data.get("speed_probe_cpu_s")
    return Calibration(table("oracle_cpu_s"), None if probe is None else float(probe), data.get("measured_on"),
                       table("compile_s"))


def torch_seconds(ref, level: str) -> float:
    """The recorded torch wall-clock of a level's checks (0 for a reference without per-check seconds)."""
    return sum(float(rec.attrs.get("seconds", 0.0)) for rec in ref.checks.values() if rec.level == level)


def level_budget(ref, task: str, level: str, policy: BudgetPolicy, calibration: Calibration | None = None,
                 speed: tuple[float, dict] | None = None) -> tuple[float, dict]:
    """-> (CPU seconds here, how they were derived) for `level` of `task`. `speed` (speed, detail) is this
    machine's against the calibration one (grader/timing/speed.py; measured when None and policy.scale)."""
    cal = load_calibration() if calibration is None else calibration
    calibrated = cal.oracle_cpu_s.get(task, {}).get(level)
    o = policy.uncalibrated_cpu_s if calibrated is None else calibrated
    t = torch_seconds(ref, level)
    if speed is None:
        speed = machine_speed(cal.probe_cpu_s) if policy.scale else (1.0, {"speed": 1.0, "note": "unscaled"})
    ratio, how = speed
    seconds = ratio * (policy.headroom * o + policy.factor * t)
    kill = policy.kill_at(seconds)
    return seconds, {"budget_cpu_s": seconds, "kill_at_cpu_s": kill, "oracle_cpu_s": o, "torch_s": t,
                     "headroom": policy.headroom, "factor": policy.factor, "calibrated": calibrated is not None,
                     "calibrated_on": cal.measured_on, **how,
                     "rule": f"{ratio:.3f} x ({policy.headroom:g} x oracle {o:.1f} CPU-s + {policy.factor:g} x torch "
                             f"{t:.1f} s) = {seconds:.1f} CPU-s"}
