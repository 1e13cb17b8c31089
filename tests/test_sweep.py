"""The seeded-defect catalog and sweep: every edit applies, the lattice is covered, and a real sweep
of two defects catches both with the checks one expects."""
import json
from pathlib import Path

import pytest

from grader import sweep
from grader.sweep import LEVELS, Defect, apply_defect, load_catalog, make_mutant

ROOT = Path(__file__).resolve().parents[1]
CATALOG = load_catalog()
DEFECTS = {d.id: d for d in CATALOG.defects}


def test_catalog_has_enough_defects_with_unique_ids():
    assert len(CATALOG.defects) >= 40
    assert len(DEFECTS) == len(CATALOG.defects)  # load_catalog also refuses duplicates
    for cls in sweep.CLASSES:
        assert sum(d.task_class == cls for d in CATALOG.defects) >= 15, cls


@pytest.mark.parametrize("did", sorted(DEFECTS))
def test_every_edit_occurs_exactly_once_and_still_compiles(did):
    d = DEFECTS[did]
    text = (ROOT / d.file).read_text()
    assert text.count(d.old) == 1, f"{did}: edit target occurs {text.count(d.old)} times in {d.file}"
    assert d.old != d.new and d.description
    # A defect models a wrong port, not a file that does not parse.
    compile(text.replace(d.old, d.new), d.file, "exec")


@pytest.mark.parametrize("cls", sweep.CLASSES)
def test_every_lattice_level_of_both_classes_is_covered(cls):
    covered = {lv for d in CATALOG.defects if d.task_class == cls for lv in d.levels}
    assert covered == set(LEVELS), sorted(set(LEVELS) - covered)


def test_every_defect_applies_to_some_task():
    from recorder.app import compose_task, known_tasks
    cfgs = [compose_task(t) for t in known_tasks()]
    dead = [d.id for d in CATALOG.defects if not any(sweep.applicable([d], cfg) for cfg in cfgs)]
    assert not dead, dead


def test_applicability_follows_class_family_and_mode():
    d = Defect("x", "serving", ("gemma4",), ("chunked",), ("L5",), "serving_engine/engine.py", "a", "b", "bug")
    assert d.applies_to("serving", "gemma4", "chunked")
    assert not d.applies_to("serving", "gemma4", "core")
    assert not d.applies_to("serving", "llama3", "chunked")
    assert not d.applies_to("training", "gemma4", None)
    assert Defect("y", "training", (), (), ("L1",), "f", "a", "b", "bug").applies_to("training", "llama3", None)
    dpo_only = Defect("z", "training", (), (), ("L4",), "f", "a", "b", "bug", methods=("dpo",))
    assert dpo_only.applies_to("training", "llama3", None, "dpo")
    assert not dpo_only.applies_to("training", "llama3", None, "sft")


def test_method_defects_apply_to_their_method_only():
    from recorder.app import compose_task
    sft, dpo = (sweep.applicable(CATALOG.defects, compose_task(t)) for t in ("llama3-sft", "llama3-dpo"))
    assert not any(d.id.startswith("dpo-") for d in sft)
    assert {d.id for d in dpo if d.id.startswith("dpo-")} == {d.id for d in CATALOG.defects if d.id.startswith("dpo-")}
    assert "train-ga-mean-per-micro-batch" not in {d.id for d in dpo}  # sft.py's accumulation: SFT's code path


def test_an_ambiguous_or_missing_edit_target_is_refused(tmp_path):
    (tmp_path / "m.py").write_text("x = 1\nx = 1\n")
    with pytest.raises(ValueError, match="2 times"):
        apply_defect(tmp_path, Defect("dup", "training", (), (), ("L1",), "m.py", "x = 1", "x = 2", "bug"))
    with pytest.raises(ValueError, match="0 times"):
        apply_defect(tmp_path, Defect("gone", "training", (), (), ("L1",), "m.py", "y = 1", "y = 2", "bug"))


def test_a_mutant_differs_from_the_oracle_only_in_the_edited_file(tmp_path):
    d = DEFECTS["train-labels-not-shifted"]
    mutant = make_mutant(d, tmp_path / "m")
    assert (mutant / d.file).read_text() == (ROOT / d.file).read_text().replace(d.old, d.new)
    assert (mutant / "jax_oracles/models/llama3.py").read_text() == (ROOT / "jax_oracles/models/llama3.py").read_text()
    assert not list(mutant.rglob("__pycache__"))


def test_reports_list_untripped_checks_with_their_rationale(tmp_path):
    result = {
        "task": "t", "task_class": "training", "clean_reward": 1.0, "clean_earned_levels": 6, "default_noise": 1e-6,
        "levels": list(LEVELS), "seconds": 1.0,
        "defects": [{"id": "d1", "description": "bug", "file": "f", "expected_levels": ["L1"], "reward": 0.5,
                     "reward_drop": 0.5, "gated": False, "caught": True, "tripped": ["L1/rope"],
                     "levels_tripped": ["L1"], "expected_levels_missed": [], "scores": {}, "reasons": {},
                     "seconds": 1.0}],
        "checks": {"L1/rope": {"clean_score": 1.0, "clean_reason": None, "noise": 1e-6, "tripped_by": ["d1"]},
                   "L1/mlp": {"clean_score": 1.0, "clean_reason": None, "noise": 1e-6, "tripped_by": []}},
        "totals": {"defects_caught": 1, "defects": 1, "strict_caught": 1, "checks_tripped": 1, "checks": 2},
    }
    js, md = sweep.write_reports(result, tmp_path, {"L1/mlp": "kept because the MLP is half the FLOPs"})
    text = md.read_text()
    assert "| `d1` |" in text
    assert "**1/1 defects caught, 1/1 strictly (each costs a level), 1/2 checks tripped**" in text
    assert "`L1/mlp`: kept because the MLP is half the FLOPs" in text
    assert json.loads(js.read_text())["untripped"] == {"L1/mlp": "kept because the MLP is half the FLOPs"}


def test_cli_takes_hydra_style_and_dashed_options():
    a = sweep._parse(["task=llama3-sft", "defects=a,b", "limit=2", "levels=L1,L4"])
    assert (a.task, a.defects, a.limit, a.levels) == ("llama3-sft", "a,b", 2, "L1,L4")
    assert sweep._parse(["--all"]).all == "true" and sweep._parse(["all=true"]).all == "true"


@pytest.mark.slow
@pytest.mark.sandbox
def test_a_real_sweep_of_two_defects_catches_both_with_the_expected_checks(tmp_path):
    # Three levels keep it to three short grades (clean + two mutants), about a minute on two cores.
    levels = ("L1", "L3", "L4")
    picked = [DEFECTS["train-rope-theta-default"], DEFECTS["train-labels-not-shifted"]]
    result = sweep.sweep_task("llama3-sft", picked, tmp_path, progress=lambda msg: None, levels=levels)
    by_id = {r["id"]: r for r in result["defects"]}
    assert result["totals"]["defects_caught"] == 2

    rope = set(by_id["train-rope-theta-default"]["tripped"])
    assert {"L1/rope", "L3/logits_b1_t7", "L3/logits_b3_t33_pad", "L4/loss_step0"} <= rope
    assert not rope & {"L0/torch_free", "L1/rms_norm", "L1/mlp", "L1/attention_core", "L1/lora_linear",
                       "L1/data_tokens", "L1/data_labels", "L1/collate"}

    labels = by_id["train-labels-not-shifted"]
    # The loss shift touches the loss only: everything below L4 is bit-identical to the oracle.
    assert set(labels["tripped"]) == {"L4/loss_step0", "L4/lora_grads_step0", "L4/fixed_steps_loss",
                                      "L4/fixed_steps_params"}
    assert labels["reward_drop"] > 1e-3 and result["checks"]["L4/loss_step0"]["tripped_by"] == [
        "train-rope-theta-default", "train-labels-not-shifted"]


@pytest.mark.sandbox
@pytest.mark.parametrize("did, only_trace", [
    ("serve-free-head-first", True),
    pytest.param("serve-no-null-block", False, marks=pytest.mark.slow),  # also tripped by the greedy checks
])
def test_block_pool_defects_are_caught_by_the_pressure_trace(tmp_path, did, only_trace):
    # Freeing head first keeps every token: only the per-step trace under a preempting, evicting pool sees it.
    # Without a null block, padded block-table entries alias a live request's KV: the tokens change as well.
    result = sweep.sweep_task("llama3-chunked", [DEFECTS[did]], tmp_path, progress=lambda msg: None, levels=("L5",))
    (rec,) = result["defects"]
    assert rec["caught"] and "L5/schedule_trace" in rec["tripped"], rec
    assert (rec["tripped"] == ["L5/schedule_trace"]) == only_trace, rec["tripped"]
    assert rec["scores"]["L5/schedule_trace"] < 0.99


@pytest.mark.sandbox
@pytest.mark.parametrize("task, did, check", [
    ("llama3-core", "serve-min-p-before-temperature", "L1/sampler_pipeline"),
    ("llama3-sft", "train-template-eos-not-replaced", "L1/collate"),
])
def test_order_and_eos_defects_are_caught_at_l1(tmp_path, task, did, check):
    # Both were blind spots once: the per-transform sampler checks compose the stages in the probe's
    # order, and an Instruct tokenizer (eos already <|eot_id|>) made replace_eos a no-op.
    result = sweep.sweep_task(task, [DEFECTS[did]], tmp_path, progress=lambda msg: None, levels=("L1",))
    (rec,) = result["defects"]
    assert rec["caught"] and check in rec["tripped"], rec
    assert rec["scores"][check] < 0.99
