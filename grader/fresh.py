"""The adversarial pass (`python -m grader task=T candidate=PATH fresh=SEED`): the task's own checks once more on
inputs drawn from a seed, beside the frozen-reference levels and never replacing them.

Every graded input of a frozen reference is fixed, so a candidate tuned to those exact inputs (exact on the
recorded prompts, wrong elsewhere) would pass it. Here the torch source runs live on the trusted side, in a process
of its own (`python -m recorder fresh=SEED out_dir=<temporary>`: the grader itself stays torch-free and never
imports the recorder), every probe drawing its inputs from the seed as well as its name; the candidate is then
graded against that temporary reference exactly as against the frozen one (sealed children, the same checks and
measures, the same strict bars). Levels L1-L4 are the ones whose inputs are drawn (L0 is the spec, L5/L6 run the
task's dataset and seed end to end: the frozen pass grades them)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from catalog.scale import scale_name
from grader.app import ROOT, GradeOptions, grade

__all__ = ["FRESH_LEVELS", "FreshUnavailable", "fresh_pass", "record_fresh"]

FRESH_LEVELS = ("L1", "L2", "L3", "L4")
ENV_TORCH_PYTHON = "T2J_TORCH_PYTHON"  # the interpreter that runs the torch source (default: the grader's own)


class FreshUnavailable(RuntimeError):
    """The torch source cannot run here (an exported verifier carries neither torch nor the recorder)."""


def record_fresh(cfg, seed: int, out_dir: Path, levels=FRESH_LEVELS, timeout_s: float = 1800.0) -> Path:
    """The task recorded at `levels` on inputs drawn from `seed` into out_dir (a separate process)."""
    if not (ROOT / "recorder").is_dir() or not (ROOT / "torch_sources").is_dir():
        raise FreshUnavailable("the fresh pass runs the torch source live: this runtime has no recorder/ or "
                               "torch_sources/ (an exported verifier grades against its frozen reference only)")
    python = os.environ.get(ENV_TORCH_PYTHON) or sys.executable
    overrides = [f"task={cfg.task_name}", f"out_dir={out_dir}", f"fresh={int(seed)}", f"levels=[{','.join(levels)}]"]
    if cfg.get("checkpoint"):
        overrides.append(f"checkpoint={cfg.checkpoint}")
    if scale_name(cfg) != "tiny":
        overrides.append(f"scale={scale_name(cfg)}")
    try:
        proc = subprocess.run([python, "-m", "recorder", *overrides], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise FreshUnavailable(f"recording the fresh inputs took over {timeout_s:.0f} s") from None
    path = out_dir / f"{cfg.task_name}.h5"
    if proc.returncode != 0 or not path.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise FreshUnavailable(f"the torch source could not record fresh inputs ({python} -m recorder, exit "
                               f"{proc.returncode}): {tail}")
    return path


def fresh_pass(cfg, candidate: Path, seed: int, options: GradeOptions, levels=FRESH_LEVELS) -> dict:
    """Grade `candidate` on fresh inputs from `seed`: the report's "fresh" section (reward, strict level, checks)."""
    with tempfile.TemporaryDirectory(prefix="t2j-fresh-") as tmp:
        started = time.perf_counter()
        record_fresh(cfg, seed, Path(tmp, "references"), levels)
        recorded_s = time.perf_counter() - started
        report = grade(cfg, candidate, Path(tmp, "references"), Path(tmp, "reports"), options,
                       levels=tuple(levels), quiet=True)
    return {"seed": int(seed), "levels": list(levels), "reward": report["reward"],
            "earned_levels": report["earned_levels"], "mean_digits": report["mean_digits"],
            "gated": report["gated"], "recorded_s": round(recorded_s, 1), "checks": report["checks"]}
