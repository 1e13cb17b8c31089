"""The L5/L6 time budget: too slow is wrong, at a bar the oracle clears and an engine without jit does not.

Per level, one budget shared by the level's checks (one child runs them all):

    budget = floor_s + compile_margin x C + factor x T

T is the torch source's recorded wall-clock of the level's checks (each check's `seconds` attr in the
reference), C the seconds the JAX oracle spends tracing and compiling at that level, measured by
`make calibrate` (`python -m grader.budget`) through jax.monitoring's compile events and kept in
grader/budgets.yaml. Compilation is a one-time cost torch does not pay; past it, a jitted step beats the
torch engine's eager one, while an engine dispatching op by op runs ~14x slower than torch (L5 long_decode
makes that tell: over a thousand engine steps). Both figures are this machine's (the references are
recorded on it, CI runs on one like it); a task with no calibration gets `uncalibrated_compile_s`.
"""
from __future__ import annotations

import argparse
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
    factor: float = 1.0  # x the recorded torch seconds (past compilation the oracle outruns torch)
    compile_margin: float = 1.5  # x the oracle's calibrated compile seconds
    floor_s: float = 5.0  # process jitter, the child's own setup
    uncalibrated_compile_s: float = 60.0  # C where grader/budgets.yaml has no entry for the task

    @classmethod
    def from_cfg(cls, node) -> "BudgetPolicy":
        return cls(**{k: float(v) for k, v in dict(node).items()})


def load_compile_seconds(path: Path = BUDGETS) -> dict[str, dict[str, float]]:
    """{task: {level: oracle compile seconds}}; {} when the file is missing."""
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text()) or {}
    table = data.get("compile_s") or {}
    if not isinstance(table, dict):
        raise ValueError(f"{path}: compile_s must map task -> {{level: seconds}}")
    return {str(t): {str(lv): float(s) for lv, s in (levels or {}).items()} for t, levels in table.items()}


def torch_seconds(ref, level: str) -> float:
    """The recorded torch wall-clock of a level's checks (0 for a reference without per-check seconds)."""
    return sum(float(rec.attrs.get("seconds", 0.0)) for rec in ref.checks.values() if rec.level == level)


def level_budget(ref, task: str, level: str, policy: BudgetPolicy,
                 compile_s: dict[str, dict[str, float]] | None = None) -> tuple[float, dict]:
    """-> (seconds, how they were derived) for `level` of `task`."""
    table = load_compile_seconds() if compile_s is None else compile_s
    calibrated = table.get(task, {}).get(level)
    c = policy.uncalibrated_compile_s if calibrated is None else calibrated
    t = torch_seconds(ref, level)
    seconds = policy.floor_s + policy.compile_margin * c + policy.factor * t
    return seconds, {"budget_s": seconds, "torch_s": t, "oracle_compile_s": c, "calibrated": calibrated is not None}


# ---- calibration -----------------------------------------------------------------------------------------

def calibrate(tasks: list[str], runs: int = 2, quiet: bool = False) -> dict[str, dict[str, float]]:
    """Grade the repo's oracle at L5/L6 `runs` times per task (each child compiles from cold) -> the largest
    compile seconds per level."""
    from grader.app import grade
    from recorder.app import compose_task
    import tempfile

    out = {}
    for task in tasks:
        cfg = compose_task(task)
        worst: dict[str, float] = {}
        for _ in range(runs):
            with tempfile.TemporaryDirectory(prefix="t2j-calibrate-") as tmp:
                report = grade(cfg, ROOT, ROOT / "references", Path(tmp), quiet=True, levels=TIMED_LEVELS,
                               measure_compile=True, budget=BudgetPolicy(uncalibrated_compile_s=600.0))
            failed = [c["name"] for c in report["checks"] if c["level"] in TIMED_LEVELS and c["score"] < c["bar"]]
            if failed:
                raise RuntimeError(f"{task}: the oracle fails {failed} while calibrating: fix that first")
            for level, s in report["compile_seconds"].items():
                worst[level] = max(worst.get(level, 0.0), s)
        out[task] = {lv: round(s, 2) for lv, s in sorted(worst.items())}
        if not quiet:
            print(f"{task}: oracle compile seconds {out[task]}", flush=True)
    return out


def write_budgets(table: dict[str, dict[str, float]], path: Path = BUDGETS) -> None:
    merged = {**load_compile_seconds(path), **table}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    header = ("# The JAX oracle's compile seconds per task and timed level (grader/budget.py), measured by\n"
              "# `make calibrate` on the machine that records the references; rerun it there after changing\n"
              "# what the oracle compiles.\n")
    body = {"measured_on": f"{platform.machine()}, {_cpu_count()} cores", "commit": rev.strip() or None,
            "compile_s": {t: merged[t] for t in sorted(merged)}}
    path.write_text(header + yaml.safe_dump(body, sort_keys=False))


def _cpu_count() -> int:
    import os
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(argv: list[str] | None = None) -> None:
    from grader.sweep import recorded_tasks

    p = argparse.ArgumentParser(prog="python -m grader.budget", description="calibrate the L5/L6 budgets")
    p.add_argument("tasks", nargs="*", help="tasks to calibrate (default: every recorded task)")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    table = calibrate(args.tasks or recorded_tasks(), runs=args.runs)
    write_budgets(table)
    print(f"wrote {BUDGETS.relative_to(ROOT)} ({len(table)} tasks)")


if __name__ == "__main__":
    sys.exit(main())
