"""The candidate's half of the twin, run as the grader runs a candidate: grader.isolation.gate.run_sandboxed
(bubblewrap around the torch-free verifier interpreter, the guard, the grader's clock and caps), with the twin's
own child package staged where the grader's would be. The child sees the candidate, the twin's candidate-side
probes, the grader's exchange (the one file it writes back) and an inputs directory: never the check catalog, the
grader's probes or a reference."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from grader.isolation import gate
from grader.isolation.exchange import UntrustedOutput, read_outputs
from twin.child import write_inputs

__all__ = ["CHILD_FILES", "run_candidate", "stage_twin_packages"]

ROOT = Path(__file__).resolve().parents[1]
# what the child imports of this repo besides the candidate: the twin's driver and candidate-side probes, and the
# grader's exchange (standard library + numpy) with its two import-free package files
CHILD_FILES = ("twin/__init__.py", "twin/child.py", "twin/properties.py", "twin/shared.py", "twin/candidate_side",
               "grader/__init__.py", "grader/isolation/__init__.py", "grader/isolation/exchange.py")


def stage_twin_packages(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for rel in CHILD_FILES:
        src, target = ROOT / rel, dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=ignore)
        else:
            shutil.copy2(src, target)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def run_candidate(candidate: Path, task_class: str, meta: dict, assets: dict[str, Path],
                  inputs: dict[str, dict], timeout_s: float, trusted: bool = False
                  ) -> tuple[dict, dict[str, str], dict[str, float], str | None]:
    """Run every property of `meta["properties"]` on the candidate in one sealed child -> (outputs, errors,
    seconds, why the child failed as a whole or None). What comes back is read as untrusted data."""
    keys = list(meta["properties"])
    with tempfile.TemporaryDirectory(prefix="t2j-twin-") as tmp:
        inputs_dir, out_dir = Path(tmp, "inputs"), Path(tmp, "out")
        inputs_dir.mkdir()
        out_dir.mkdir()
        for name, path in assets.items():  # copies: the child never sees the repo
            shutil.copytree(path, inputs_dir / name, copy_function=_link_or_copy)
        write_inputs(inputs_dir / "inputs.npz", {**meta, "task_class": task_class}, inputs)
        res = gate.run_sandboxed(candidate, "twin.child:main", inputs_dir, out_dir, timeout_s,
                                 inputs_name="inputs.npz", trusted=trusted, stage_packages=stage_twin_packages)
        if not res.ok or res.outputs is None:
            why = res.timeout_detail or res.reason or "no outputs written"
            return {}, {k: why for k in keys}, {}, f"{why}\n{res.stderr_tail}".strip()
        try:
            outputs, errors, seconds = read_outputs(res.outputs, keys)
        except UntrustedOutput as e:
            return {}, {k: f"untrusted output: {e}" for k in keys}, {}, str(e)
    return outputs, errors, seconds, None
