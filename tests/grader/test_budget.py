"""The L5/L6 time budget (grader/timing/budget.py): derived, calibrated for every task, and binding."""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from catalog.h5schema import CheckRecord, Reference, read_reference
from catalog.tasks import compose_task, known_tasks
from grader.app import grade
from grader.isolation.exchange import UntrustedOutput, read_compile_seconds, write_outputs
from grader.timing.budget import BudgetPolicy, Calibration, level_budget, load_calibration, torch_seconds

ROOT = Path(__file__).resolve().parents[2]


def _ref(seconds: dict[str, float]) -> Reference:
    checks = {k: CheckRecord(k.split("/")[0], k.split("/")[1], "behavioral", "agreement", attrs={"seconds": s})
              for k, s in seconds.items()}
    return Reference({}, checks, None)


def test_budget_is_speed_times_headroom_over_the_oracle_plus_torch_time():
    ref = _ref({"L5/a": 1.0, "L5/b": 2.5, "L6/c": 0.5, "L4/d": 99.0})
    policy = BudgetPolicy(headroom=2.0, factor=1.5, uncalibrated_cpu_s=60.0, grace_frac=0.1, grace_s=1.0)
    cal = Calibration({"t": {"L5": 4.0}}, probe_cpu_s=3.0, measured_on="here")
    assert torch_seconds(ref, "L5") == 3.5
    speed = (1.5, {"speed": 1.5})  # this machine 1.5x slower than the calibration one
    seconds, why = level_budget(ref, "t", "L5", policy, cal, speed)
    assert seconds == pytest.approx(1.5 * (2.0 * 4.0 + 1.5 * 3.5)) and why["calibrated"] and why["speed"] == 1.5
    assert why["kill_at_cpu_s"] == pytest.approx(seconds * 1.1 + 1.0) and "oracle 4.0 CPU-s" in why["rule"]
    seconds, why = level_budget(ref, "t", "L6", policy, cal, speed)  # no L6 entry: uncalibrated
    assert seconds == pytest.approx(1.5 * (2.0 * 60.0 + 1.5 * 0.5)) and not why["calibrated"]


def test_the_speed_probe_scales_budgets_to_this_machine():
    """Measured here against a calibration figure half of what this machine takes: the budget doubles; the
    probe counts CPU seconds on the grader's clock, repeatably."""
    from grader.timing import speed
    figures = speed.measured(fresh=True)
    assert len(figures) == speed._RUNS and all(f > 0.5 for f in figures), figures
    assert max(figures) / min(figures) < 1.6, figures
    here = min(figures)
    ratio, how = speed.machine_speed(here / 2)
    assert ratio == pytest.approx(2.0) and how["probe_cpu_s"] == figures
    with pytest.raises(speed.SpeedError, match="too far off"):
        speed.machine_speed(here / 50)
    assert speed.machine_speed(None)[0] == 1.0


def test_every_task_is_calibrated_and_every_reference_times_its_timed_checks():
    cal = load_calibration()
    assert cal.probe_cpu_s and cal.probe_cpu_s > 0 and cal.measured_on
    for task in known_tasks():
        assert set(cal.oracle_cpu_s.get(task, {})) == {"L5", "L6"}, f"{task}: run `make calibrate`"
        assert all(0 < s < 600 for s in cal.oracle_cpu_s[task].values()), cal.oracle_cpu_s[task]
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
    """The same oracle run, graded under a budget a tenth of torch's time: the grader's clock kills the
    child and the check fails as 'timeout' while its tokens would be right (the default budget passes it:
    tests/test_grade_*)."""
    tight = BudgetPolicy(headroom=0.0, factor=0.1, grace_s=0.0, grace_frac=0.0, scale=False)
    report = grade(compose_task("llama3-core"), ROOT, ROOT / "references", tmp_path, quiet=True, levels=("L5",),
                   only_checks=("long_decode",), budget=tight)
    (check,) = [c for c in report["checks"] if c["name"] == "long_decode"]
    assert check["score"] == 0.0 and check["reason"].startswith("timeout"), check
    b = report["budgets"]["L5"]
    assert b["budget_cpu_s"] == pytest.approx(0.1 * b["torch_s"])
    assert b["used_cpu_s"] >= b["kill_at_cpu_s"] * 0.9 and b["meter"] in ("cgroup2", "cgroup1", "procfs"), b


def test_a_partial_calibration_beside_another_probe_figure_is_scaled_to_the_tables(tmp_path):
    """Seconds measured where the speed probe reads 2.0 go into a table calibrated beside 4.0 doubled, as a grade
    would scale them; tasks measured earlier keep their seconds and the table keeps its probe."""
    from grader.timing.calibrate import write_budgets
    path = tmp_path / "budgets.yaml"
    write_budgets({"oracle_cpu_s": {"a": {"L5": 10.0}, "b": {"L5": 3.0}}, "compile_s": {"a": {"L5": 1.0}}}, 4.0, path)
    write_budgets({"oracle_cpu_s": {"b": {"L5": 5.0}}, "compile_s": {"b": {"L5": 0.5}}}, 2.0, path)
    cal = load_calibration(path)
    assert cal.probe_cpu_s == 4.0
    assert cal.oracle_cpu_s == {"a": {"L5": 10.0}, "b": {"L5": 10.0}}
    assert cal.compile_s["b"] == {"L5": 1.0}
