"""The grade-all summary: built from synthetic report dicts (no grading), and grade_all's loop with
a grade function that raises for one task."""
import json
import re

import pytest

from grader import grade_all
from grader.scoring.report import mean_reward, score_class, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def check(level, name, score, aspect="numeric", reason=None):
    measure = "pass" if aspect == "spec" else "tensor"
    return {"level": level, "name": name, "aspect": aspect, "measure": measure, "score": score,
            "reason": reason, "seconds": 0.5}


def good_report():  # a training task at the ceiling, with both loss series
    checks = [check("L0", "torch_free", 1.0, "spec"), check("L1", "rms_norm", 0.9999999),
              *(check(lv, f"{lv.lower()}_check", 0.99995) for lv in ("L2", "L3", "L4", "L5", "L6"))]
    series = {"L5/e2e_step_losses/step_losses": {"reference": [3.0, 2.5, 2.1, 1.9],
                                                 "candidate": [3.0, 2.5000001, 2.1000003, 1.9]},
              "L4/fixed_steps_loss/losses": {"reference": [3.0, 2.9, 2.8], "candidate": [3.0, 2.9, 2.8]},
              "L1/rope/inv_freq": {"reference": [1.0, 0.5], "candidate": [1.0, 0.5]}}  # not a loss: no plot
    return {"task": "train-good", "candidate": "/tmp/cand", "reward": 0.9999, "earned_levels": 6, "gated": None,
            "stale_reference": [], "checks": checks, "series": series, "wall_s": 42.0}


def mixed_report():  # a serving task: L1 amber (below the strict bar), L3 red with a reason, no loss series
    checks = [check("L0", "layout", 1.0, "spec"), check("L1", "rope", 0.995),
              check("L2", "decoder_layer", 0.9995), check("L3", "logits", 0.42, reason="max abs err 3e-2")]
    return {"task": "serve-mixed", "candidate": "/tmp/cand", "reward": 0.6, "earned_levels": 0, "gated": None,
            "stale_reference": [], "checks": checks, "series": {}}


def error_report():
    return {"task": "broken", "error": "ValueError: unknown task 'broken'", "reward": 0.0, "earned_levels": -1,
            "checks": [], "series": {}}


def test_score_class_bars():
    assert [score_class(s) for s in (1.0, 0.999, 0.9989, 0.99, 0.9899, 0.0, None)] == \
        ["green", "green", "amber", "amber", "red", "red", "na"]


def test_summary_files_rows_colours_and_pngs(tmp_path):
    reports = [good_report(), mixed_report(), error_report()]
    summary = write_report(reports, tmp_path)

    for name in ("summary.md", "summary.html", "summary.json", "levels.png", "loss_train-good.png"):
        assert (tmp_path / name).is_file(), name
    assert not (tmp_path / "loss_serve-mixed.png").exists()  # no loss series, no plot
    for png in tmp_path.glob("*.png"):
        data = png.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), png.name

    md = (tmp_path / "summary.md").read_text()
    table = md.split("## Checks per task")[0]
    for task in ("train-good", "serve-mixed", "broken"):
        assert len(re.findall(rf"^\| {re.escape(task)} \|", table, re.M)) == 1, task
    assert "| broken | ERROR |" in table
    assert "**0.420000**" in md and "_0.995000_" in md  # red bold, amber italic
    assert "max abs err 3e-2" in md  # the reason of a score below 1
    assert "ValueError: unknown task 'broken'" in md

    html = (tmp_path / "summary.html").read_text()
    cell = lambda cls, text: re.search(rf'<td class="num {cls}">{re.escape(text)}</td>', html)
    assert cell("red", "0.420000") and cell("amber", "0.995000") and cell("green", "0.999500")
    assert '<td class="error">ERROR</td>' in html and "grading raised" in html
    assert html.count("data:image/png;base64,") == 2  # levels + one loss plot, embedded

    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["tasks"] == 3 and [r["task"] for r in data["rows"]] == ["train-good", "serve-mixed", "broken"]
    assert data["mean_reward"] == pytest.approx((0.9999 + 0.6 + 0.0) / 3) == summary["mean_reward"]
    mixed = data["rows"][1]
    assert mixed["levels"]["L3"] == 0.42 and mixed["levels"]["L4"] is None and mixed["failing"] == ["L1/rope", "L3/logits"]


def test_scores_are_truncated_not_rounded(tmp_path):
    r = mixed_report()
    r["checks"][1]["score"] = 0.98999999  # rounds to 0.990000, which would read as amber
    write_report([r], tmp_path)
    html = (tmp_path / "summary.html").read_text()
    assert '<td class="num red">0.989999</td>' in html and "0.990000" not in html


def test_grade_all_loop_turns_a_raising_task_into_an_error_row(tmp_path, monkeypatch, capsys):
    graded = []

    def fake_grade(cfg, candidate, references, report_dir, quiet=False, coverage=False):
        graded.append(cfg.task_name)
        if cfg.task_name == "gemma4-core":
            raise RuntimeError("probe exploded")
        return {"task": cfg.task_name, "candidate": str(candidate), "reward": 1.0, "earned_levels": 6,
                "gated": None, "stale_reference": [],
                "checks": [check("L0", "torch_free", 1.0, "spec")], "series": {}}

    monkeypatch.setattr(grade_all, "grade", fake_grade)
    tasks = ["llama3-sft", "gemma4-core", "llama3-core"]
    rc = grade_all.main([f"out={tmp_path}", f"tasks={','.join(tasks)}"])

    assert graded == tasks and rc == 1  # the failure neither stopped the run nor went unreported
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[-1] == "mean_reward=0.6667 tasks=3"
    assert "| gemma4-core | ERROR |" in stdout and "| llama3-sft | 1.000000 |" in stdout
    error = json.loads((tmp_path / "gemma4-core.json").read_text())
    assert error["error"] == "RuntimeError: probe exploded" and "Traceback" in error["traceback"]
    assert mean_reward(json.loads((tmp_path / "summary.json").read_text())["reports"]) == pytest.approx(2 / 3)


def test_grade_all_rejects_unknown_arguments():
    with pytest.raises(SystemExit) as e:
        grade_all.main(["candiate=/tmp/x"])
    assert e.value.code == 2
