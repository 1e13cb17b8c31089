"""The L5/L6 time budget (grader/budget.py): derived, calibrated for every task, and binding."""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from grader.app import grade
from grader.budget import BudgetPolicy, level_budget, load_compile_seconds, torch_seconds
from grader.exchange import UntrustedOutput, read_compile_seconds, write_outputs
from grader.h5schema import CheckRecord, Reference, read_reference
from recorder.app import compose_task, known_tasks

ROOT = Path(__file__).resolve().parents[1]


def _ref(seconds: dict[str, float]) -> Reference:
    checks = {k: CheckRecord(k.split("/")[0], k.split("/")[1], "behavioral", "agreement", attrs={"seconds": s})
              for k, s in seconds.items()}
    return Reference({}, checks, None)


def test_budget_is_floor_plus_compile_plus_torch_time():
    ref = _ref({"L5/a": 1.0, "L5/b": 2.5, "L6/c": 0.5, "L4/d": 99.0})
    policy = BudgetPolicy(factor=2.0, compile_margin=1.5, floor_s=5.0, uncalibrated_compile_s=60.0)
    assert torch_seconds(ref, "L5") == 3.5
    seconds, why = level_budget(ref, "t", "L5", policy, {"t": {"L5": 4.0}})
    assert seconds == pytest.approx(5.0 + 1.5 * 4.0 + 2.0 * 3.5) and why["calibrated"]
    seconds, why = level_budget(ref, "t", "L6", policy, {"t": {"L5": 4.0}})  # no L6 entry: uncalibrated
    assert seconds == pytest.approx(5.0 + 1.5 * 60.0 + 2.0 * 0.5) and not why["calibrated"]


def test_every_task_is_calibrated_and_every_reference_times_its_timed_checks():
    table = load_compile_seconds()
    for task in known_tasks():
        assert set(table.get(task, {})) == {"L5", "L6"}, f"{task}: run `make calibrate`"
        assert all(0 < s < 120 for s in table[task].values()), table[task]
        ref = read_reference(ROOT / "references" / f"{task}.h5")
        timed = [c for c in ref.checks.values() if c.level in ("L5", "L6")]
        assert timed and all(float(c.attrs["seconds"]) >= 0 for c in timed)
        assert torch_seconds(ref, "L5") > 0


def test_compile_seconds_are_read_as_untrusted(tmp_path):
    path = tmp_path / "out.zip"
    write_outputs(path, {}, {}, {"L5/a": 1.0}, compile_seconds={"L5/a": 2.5})
    assert read_compile_seconds(path, ["L5/a"]) == {"L5/a": 2.5}
    write_outputs(path, {}, {}, {"L5/a": 1.0})
    assert read_compile_seconds(path, ["L5/a"]) == {}
    for bad in ({"L5/zzz": 1.0}, {"L5/a": -1.0}, {"L5/a": "1"}, {"L5/a": float("nan")}):
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("meta.json", json.dumps({"checks": [], "errors": {}, "seconds": {}}))
            z.writestr("compile.json", json.dumps(bad))
        with pytest.raises(UntrustedOutput):
            read_compile_seconds(path, ["L5/a"])


def test_the_oracle_fails_on_time_under_a_budget_it_cannot_meet(tmp_path):
    """The same oracle run, graded under a budget a tenth of torch's time: the check fails as 'timeout'
    while its tokens are right (the default budget passes it: tests/test_grade_*)."""
    tight = BudgetPolicy(factor=0.1, compile_margin=0.0, floor_s=0.0)
    report = grade(compose_task("llama3-core"), ROOT, ROOT / "references", tmp_path, quiet=True, levels=("L5",),
                   only_checks=("long_decode",), budget=tight)
    (check,) = [c for c in report["checks"] if c["name"] == "long_decode"]
    assert check["score"] == 0.0 and check["reason"].startswith("timeout"), check
    assert report["budgets"]["L5"]["budget_s"] == pytest.approx(0.1 * report["budgets"]["L5"]["torch_s"])
