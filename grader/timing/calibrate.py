"""`make calibrate` (`python -m grader.timing.calibrate [TASK ...]`): grade the repo's oracle at L5/L6 from cold, and write each level child's CPU seconds and this machine's speed-probe figure to grader/timing/budgets.yaml (grader/timing/budget.py says how a budget is made of them)."""
from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path

import yaml

from catalog.tasks import compose_task, recorded_tasks
from grader.app import grade
from grader.timing.budget import BudgetPolicy, BUDGETS, Calibration, ROOT, TIMED_LEVELS, load_calibration
from grader.timing.speed import probe_cpu_seconds


def calibrate(tasks: list[str], runs: int = 2, quiet: bool = False) -> dict[str, dict[str, dict[str, float]]]:
    """Grade the repo's oracle at L5/L6 `runs` times per task (each child starts and compiles from cold) ->
    {"oracle_cpu_s": the largest CPU seconds of each level's child on the grader's clock, "compile_s": the
    largest compile seconds}, per task and level."""
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
        # A budget is scaled by the probe at grade time (budget.py): seconds measured beside another probe figure go
        # into the table as they would read beside the table's own, the same scaling a grade applies.
        factor = old.probe_cpu_s / probe_cpu_s
        print(f"the speed probe here ({probe_cpu_s:.2f} CPU-s) differs from the table's ({old.probe_cpu_s:.2f}): "
              f"the new tasks' seconds are scaled by {factor:.3f}", file=sys.stderr)
        tables = {kind: {task: {lv: round(s * factor, 2) for lv, s in levels.items()} for task, levels in t.items()}
                  for kind, t in tables.items()}
    merged_cpu = {**old.oracle_cpu_s, **tables["oracle_cpu_s"]}
    merged_compile = {**(old.compile_s or {}), **tables["compile_s"]}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    header = ("# The L5/L6 calibration (grader/timing/budget.py), measured by `make calibrate` on the kind of machine that\n"
              "# records the references; rerun it after changing what the oracle runs or compiles.\n"
              "# oracle_cpu_s: CPU seconds of the oracle's level child, its whole process tree, on the grader's\n"
              "# clock (grader/isolation/clock.py); speed_probe_cpu_s: grader/timing/speed.py's probe on the same machine, which\n"
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
    p = argparse.ArgumentParser(prog="python -m grader.timing.calibrate", description="calibrate the L5/L6 budgets")
    p.add_argument("tasks", nargs="*", help="tasks to calibrate (default: every recorded task)")
    p.add_argument("--runs", type=int, default=2)
    args = p.parse_args(argv)
    probe = min(probe_cpu_seconds(5))  # as grader/timing/speed.py reads it: the quickest run
    print(f"speed probe: {probe:.3f} CPU-s", flush=True)
    tables = calibrate(args.tasks or recorded_tasks(), runs=args.runs)
    write_budgets(tables, probe)
    print(f"wrote {BUDGETS.relative_to(ROOT)} ({len(tables['oracle_cpu_s'])} tasks)")


if __name__ == "__main__":
    sys.exit(main())
