"""The L5/L6 time budget: too slow is wrong, at a bar relative to the machine that grades.

Per level, one budget shared by the level's checks (one child runs them all), in CPU seconds of the child's
whole process tree on the grader's own clock (grader/clock.py):

    budget = speed x (headroom x O + factor x T)

O is the CPU seconds the repo's JAX oracle needs for the level's child (interpreter start, imports, checkpoint
conversion, tracing, compilation and the run itself), measured by `make calibrate` (`python -m grader.budget`)
on the grader's clock and kept in grader/budgets.yaml with the calibration machine's speed-probe figure. T is
the torch source's recorded seconds of the level's checks (each check's `seconds` attr in the reference,
recorded on that same kind of machine). speed is this machine's speed-probe CPU seconds over the calibration
machine's (grader/speed.py). In words: a candidate may take twice what the oracle takes plus one more run of
the PyTorch original, here. Past compilation a jitted step beats the torch engine's eager one, while an engine
dispatching op by op runs ~14x slower than torch over L5 long_decode's thousand steps: that is the tell.

CPU seconds, because other processes' load does not inflate them (a child waiting for a core accrues none) and
a machine with fewer cores runs the same work in about the same CPU time; a wall-clock limit of
wall_factor x budget + startup backs it up against a child that sleeps or blocks. The child is killed at
budget + grace (the time to write what it finished); the child's own copy of the budget (grader/probes/
common.py) only lets an honest child stop in time and keep the checks it finished.
"""
from __future__ import annotations

import argparse
import math
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
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
    uncalibrated_cpu_s: float = 120.0  # O where grader/budgets.yaml has no entry for the task
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
    machine's against the calibration one (grader/speed.py; measured when None and policy.scale)."""
    cal = load_calibration() if calibration is None else calibration
    calibrated = cal.oracle_cpu_s.get(task, {}).get(level)
    o = policy.uncalibrated_cpu_s if calibrated is None else calibrated
    t = torch_seconds(ref, level)
    if speed is None:
        from grader.speed import machine_speed
        speed = machine_speed(cal.probe_cpu_s) if policy.scale else (1.0, {"speed": 1.0, "note": "unscaled"})
    ratio, how = speed
    seconds = ratio * (policy.headroom * o + policy.factor * t)
    kill = policy.kill_at(seconds)
    return seconds, {"budget_cpu_s": seconds, "kill_at_cpu_s": kill, "oracle_cpu_s": o, "torch_s": t,
                     "headroom": policy.headroom, "factor": policy.factor, "calibrated": calibrated is not None,
                     "calibrated_on": cal.measured_on, **how,
                     "rule": f"{ratio:.3f} x ({policy.headroom:g} x oracle {o:.1f} CPU-s + {policy.factor:g} x torch "
                             f"{t:.1f} s) = {seconds:.1f} CPU-s"}


# ---- calibration -----------------------------------------------------------------------------------------

def calibrate(tasks: list[str], runs: int = 2, quiet: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    """Grade the repo's oracle at L5/L6 `runs` times per task (each child starts and compiles from cold) ->
    {"oracle_cpu_s": the largest CPU seconds of each level's child on the grader's clock, "compile_s": the
    largest compile seconds}, per task and level."""
    from grader.app import grade
    from recorder.app import compose_task
    import tempfile

    out = {"oracle_cpu_s": {}, "compile_s": {}}
    unbounded = BudgetPolicy(uncalibrated_cpu_s=3600.0, scale=False)
    for task in tasks:
        cfg = compose_task(task)
        cpu: dict[str, float] = {}
        comp: dict[str, float] = {}
        for _ in range(runs):
            with tempfile.TemporaryDirectory(prefix="t2j-calibrate-") as tmp:
                report = grade(cfg, ROOT, ROOT / "references", Path(tmp), quiet=True, levels=TIMED_LEVELS,
                               measure_compile=True, budget=unbounded, calibration=Calibration({}, None))
            failed = [c["name"] for c in report["checks"] if c["level"] in TIMED_LEVELS and c["score"] < c["bar"]]
            if failed:
                raise RuntimeError(f"{task}: the oracle fails {failed} while calibrating: fix that first")
            for level, b in report["budgets"].items():
                if b.get("used_cpu_s") is not None:
                    cpu[level] = max(cpu.get(level, 0.0), b["used_cpu_s"])
            for level, s in report["compile_seconds"].items():
                comp[level] = max(comp.get(level, 0.0), s)
        out["oracle_cpu_s"][task] = {lv: round(s, 2) for lv, s in sorted(cpu.items())}
        out["compile_s"][task] = {lv: round(s, 2) for lv, s in sorted(comp.items())}
        if not quiet:
            print(f"{task}: oracle CPU seconds {out['oracle_cpu_s'][task]}, compile {out['compile_s'][task]}",
                  flush=True)
    return out


def write_budgets(tables: dict[str, dict[str, dict[str, float]]], probe_cpu_s: float, path: Path = BUDGETS) -> None:
    old = load_calibration(path)
    if set(old.oracle_cpu_s) <= set(tables["oracle_cpu_s"]):  # every task measured here: a new machine's table
        old = Calibration({}, None, None, {})
    if old.probe_cpu_s is not None and abs(old.probe_cpu_s - probe_cpu_s) > 0.25 * old.probe_cpu_s:
        raise RuntimeError(f"the speed probe here ({probe_cpu_s:.2f} CPU-s) is not the one the table's other tasks "
                           f"were calibrated beside ({old.probe_cpu_s:.2f}): calibrate every task here at once")
    merged_cpu = {**old.oracle_cpu_s, **tables["oracle_cpu_s"]}
    merged_compile = {**(old.compile_s or {}), **tables["compile_s"]}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    header = ("# The L5/L6 calibration (grader/budget.py), measured by `make calibrate` on the kind of machine that\n"
              "# records the references; rerun it after changing what the oracle runs or compiles.\n"
              "# oracle_cpu_s: CPU seconds of the oracle's level child, its whole process tree, on the grader's\n"
              "# clock (grader/clock.py); speed_probe_cpu_s: grader/speed.py's probe on the same machine, which\n"
              "# every budget is scaled against at grade time; compile_s: the oracle's compile seconds (informative).\n")
    body = {"measured_on": _machine(), "commit": rev.strip() or None,
            "speed_probe_cpu_s": round(probe_cpu_s if old.probe_cpu_s is None else old.probe_cpu_s, 3),
            "oracle_cpu_s": {t: merged_cpu[t] for t in sorted(merged_cpu)},
            "compile_s": {t: merged_compile[t] for t in sorted(merged_compile)}}
    path.write_text(header + yaml.safe_dump(body, sort_keys=False))


def _machine() -> str:
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{platform.machine()}, {_cpu_count()} cores{', ' + model if model else ''}"


def _cpu_count() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(argv: list[str] | None = None) -> None:
    from grader.sweep import recorded_tasks

    p = argparse.ArgumentParser(prog="python -m grader.budget", description="calibrate the L5/L6 budgets")
    p.add_argument("tasks", nargs="*", help="tasks to calibrate (default: every recorded task)")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    from grader.speed import probe_cpu_seconds
    probe = min(probe_cpu_seconds(5))  # as grader/speed.py reads it: the quickest run
    print(f"speed probe: {probe:.3f} CPU-s", flush=True)
    tables = calibrate(args.tasks or recorded_tasks(), runs=args.runs)
    write_budgets(tables, probe)
    print(f"wrote {BUDGETS.relative_to(ROOT)} ({len(tables['oracle_cpu_s'])} tasks)")


if __name__ == "__main__":
    sys.exit(main())
