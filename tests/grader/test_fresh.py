"""The grader's fresh pass (grader/fresh.py): the same checks on inputs drawn from a seed, the torch source run
live. A candidate planted to be exact on the recorded prompts only passes the frozen levels and fails the fresh
ones; the recorder keeps the fresh draws out of references/."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from catalog.h5schema import read_reference
from catalog.tasks import compose_task
from grader.app import ROOT, GradeOptions, grade
from grader.fresh import FreshUnavailable, fresh_pass, record_fresh

TASK = "llama3-core"
PREFILLS = ("prefill_t5", "prefill_t17", "prefill_t40")


def _oracle_copy(dst):
    for name in ("jax_oracles", "serving_engine", "conversion"):
        shutil.copytree(ROOT / name, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _plant_prompt_cheat(root, recorded_prompts):
    """Exact wherever the first three prompt tokens are a recorded prompt's, logits off by 0.5 elsewhere: a
    candidate that special-cases the frozen inputs (the literal below is what it would carry, never a file read)."""
    path = root / "serving_engine/model_runner.py"
    src = path.read_text()
    old = "        return self._run_single(token_ids, 0)\n\n    def teacher_forced_decode"
    assert src.count(old) == 1
    seen = sorted({tuple(int(t) for t in p[:3]) for p in recorded_prompts})
    new = (f"        logits = self._run_single(token_ids, 0)\n"
           f"        if tuple(int(t) for t in token_ids[:3]) not in {seen!r}:\n"
           f"            logits = logits + 0.5\n"
           f"        return logits\n\n    def teacher_forced_decode")
    path.write_text(src.replace(old, new))


def test_fresh_inputs_differ_from_the_frozen_ones_and_stay_out_of_references(tmp_path):
    cfg = compose_task(TASK)
    fresh = read_reference(record_fresh(cfg, 11, tmp_path, levels=("L3",)))
    frozen = read_reference(ROOT / "references" / f"{TASK}.h5")
    assert fresh.attrs["fresh_seed"] == 11 and "fresh_seed" not in frozen.attrs
    for name in PREFILLS:
        a, b = fresh.checks[f"L3/{name}"].inputs["token_ids"], frozen.checks[f"L3/{name}"].inputs["token_ids"]
        assert a.shape == b.shape and not np.array_equal(a, b)  # same check, other draw
    again = read_reference(record_fresh(cfg, 11, tmp_path / "again", levels=("L3",)))
    assert np.array_equal(again.checks["L3/prefill_t5"].outputs["logits"], fresh.checks["L3/prefill_t5"].outputs["logits"])
    proc = subprocess.run([sys.executable, "-m", "recorder", f"task={TASK}", "fresh=3", "levels=[L3]"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 1 and "references/ keeps the frozen draws" in proc.stderr


def test_fresh_pass_needs_the_torch_source(tmp_path, monkeypatch):
    monkeypatch.setattr("grader.fresh.ROOT", tmp_path)  # an exported runtime: no recorder/, no torch_sources/
    with pytest.raises(FreshUnavailable, match="runs the torch source live"):
        record_fresh(compose_task(TASK), 1, tmp_path / "refs")


@pytest.mark.sandbox
def test_a_candidate_tuned_to_the_recorded_prompts_passes_frozen_and_fails_fresh(tmp_path):
    cfg = compose_task(TASK)
    frozen = read_reference(ROOT / "references" / f"{TASK}.h5")
    prompts = [frozen.checks[f"L3/{n}"].inputs["token_ids"] for n in PREFILLS]
    cheat = _oracle_copy(tmp_path / "cheat")
    _plant_prompt_cheat(cheat, prompts)
    options = GradeOptions(quiet=True)

    report = grade(cfg, cheat, ROOT / "references", tmp_path / "reports", options, levels=("L3",))
    assert report["reward"] >= 0.999 and all(c["score"] >= c["bar"] for c in report["checks"])

    fresh = fresh_pass(cfg, cheat, 5, options, levels=("L3",))
    prefill = [c for c in fresh["checks"] if c["name"] in PREFILLS]
    assert len(prefill) == 3 and all(c["score"] < c["bar"] for c in prefill), prefill
    assert fresh["reward"] < 0.9

    honest = fresh_pass(cfg, _oracle_copy(tmp_path / "honest"), 5, options, levels=("L3",))
    assert honest["reward"] >= 0.999 and all(c["score"] >= c["bar"] for c in honest["checks"])
