"""Verdict stability (grader/timing/stability.py): the oracle at its ceiling and the too-slow defects failing on time,
idle, beside CPU-bound processes, two gradings at once, and on one core."""
from __future__ import annotations

import json

import pytest

from grader.timing import stability

pytestmark = pytest.mark.e2e


def _report(scores, reasons=None, levels=("L1", "L5")) -> dict:
    reasons = reasons or {}
    return {"reward": min(scores), "earned_levels": 6, "checks": [
        {"level": lv, "name": f"c{i}", "score": s, "bar": 0.999, "reason": reasons.get(i)}
        for i, (lv, s) in enumerate(zip(levels, scores))]}


def test_the_verdicts_read_the_grader_reasons():
    assert stability._verdict(_report([1.0, 1.0]), None) == (True, "at its ceiling")
    ok, why = stability._verdict(_report([1.0, 0.0], {1: "timeout: the child ..."}), None)
    assert not ok and "L5/c1" in why
    assert stability._verdict(_report([1.0, 0.0], {1: "timeout: past"}), "d")[0]
    ok, why = stability._verdict(_report([1.0, 0.0], {1: "crash: boom"}), "d")  # wrong, but not on time
    assert not ok and why == "NOT caught on time"
    assert not stability._verdict(_report([0.2, 1.0], {0: "timeout: x"}), "d")[0]  # L1 is no timed level


def test_unknown_conditions_are_refused(capsys):
    with pytest.raises(SystemExit):
        stability.main(["conditions=idle,overclocked"])
    assert "unknown conditions" in capsys.readouterr().err


@pytest.mark.slow
def test_verdicts_hold_idle_loaded_paired_and_on_one_core(tmp_path):
    """`make stability`: every oracle grading strict L6 with reward >= 0.999, every too-slow defect failing on
    time, in all four conditions (about 40 minutes on 2 cores)."""
    code = stability.main([f"out={tmp_path}"])
    rows = json.loads((tmp_path / "stability.json").read_text())
    bad = [r for r in rows if not r["ok"]]
    assert code == 0 and not bad, bad
    assert {r["condition"] for r in rows} == set(stability.CONDITIONS)
    assert all(r["strict_level"] == 6 for r in rows if not r["defect"]), rows
    assert {r["defect"] for r in rows if r["defect"]} == set(stability.TOO_SLOW)
