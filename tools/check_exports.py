"""`python -m tools.check_exports [task=all|a,b] [out=reports/exports]`: each task exported, then its verifier run from
the exported directory alone on the exported solution (`make export-check`).

For each task: `recorder.export` writes the bundle; its tests/ and solution/ are copied to a fresh temp directory and
tests/test.sh runs there with a cleared environment (env -i: PATH and HOME only), the verifier venv as its
interpreter (.venv-verifier, the versions of verifier.lock) and the solution as the candidate. One line per task
(reward, strict level, seconds); out/summary.json with every report. Exit 1 when a reward is under 0.999.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from catalog.provenance import ROOT
from catalog.tasks import known_tasks
from recorder.export import export_task

VERIFIER = ROOT / ".venv-verifier"
REWARD_FLOOR = 0.999


def grade_alone(bundle: Path, work: Path) -> dict:
    """The bundle's verifier, copied alone to work/, on its own solution: -> the report test.sh wrote."""
    for half in ("tests", "solution"):
        shutil.copytree(bundle / half, work / half)
    logs = work / "logs"
    env = {"PATH": os.environ["PATH"], "HOME": str(work), "T2J_PYTHON": str(VERIFIER / "bin" / "python"),
           "T2J_VERIFIER": str(VERIFIER), "T2J_CANDIDATE": str(work / "solution" / "jax_repo"),
           "T2J_LOGS": str(logs)}
    subprocess.run(["bash", str(work / "tests" / "test.sh")], cwd=work, env=env, check=True, timeout=3600,
                   capture_output=True)
    report = json.loads((logs / "report.json").read_text())
    log = (logs / "grader.log").read_text(errors="replace") if (logs / "grader.log").exists() else ""
    strict = re.findall(r"strict_level=(\S+)", log)
    return {**report, "strict_level": strict[-1] if strict else None}


def main(argv: list[str]) -> int:
    options = {"task": "all", "out": "reports/exports"}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in options:
            raise SystemExit(f"unknown argument {item!r}; usage: {__doc__.splitlines()[0]}")
        options[key] = value
    if not (VERIFIER / "bin" / "python").exists():
        raise SystemExit(f"{VERIFIER} is missing: make verifier")
    tasks = known_tasks() if options["task"] == "all" else options["task"].split(",")
    out = ROOT / options["out"]
    out.mkdir(parents=True, exist_ok=True)
    summary, failed = {}, []
    with tempfile.TemporaryDirectory(prefix="t2j-exports-") as tmp:
        for task in tasks:
            start = time.perf_counter()
            bundle = export_task(task, Path(tmp) / "bundles")
            report = grade_alone(bundle, Path(tmp) / "runs" / task)
            seconds = time.perf_counter() - start
            summary[task] = {"reward": report["reward"], "strict_level": report["strict_level"],
                             "gated": report.get("gated"), "reason": report.get("reason"), "seconds": seconds}
            if report["reward"] < REWARD_FLOOR:
                failed.append(task)
            print(f"{task}: reward={report['reward']:.4f} strict={report['strict_level']} ({seconds:.0f} s)"
                  + (f" {report.get('gated') or report.get('reason')}" if report["reward"] < REWARD_FLOOR else ""),
                  flush=True)
            shutil.rmtree(bundle)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"exports_graded={len(tasks) - len(failed)}/{len(tasks)} at reward >= {REWARD_FLOOR}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
