"""Training L6 is computed by the grader: the candidate's logits with its own L5 adapter, the loss in
the grader's numpy (catalog/heldout.py), never the eval_loss_after the candidate reports.

- the numpy loss is the torch source's evaluate_loss on the same batches and adapter, and the
  recorded batches reproduce the recorded torch loss;
- a candidate whose train_sft reports the band midpoint but hands back a garbage adapter is
  scored on the grader's number (in process, and once through a full grade);
- L5 and L6 run in separate children; L6's inputs carry the adapter the L5 child produced, and
  without one (an L5 crash) L6 scores 0 with the reason.
"""
from __future__ import annotations

import shutil
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from catalog import heldout
from catalog.checks import checks_for
from catalog.h5schema import read_reference
from catalog.tasks import compose_task
from grader.app import LEVEL_GROUPS, _score_heldout, _task_meta, grade
from torch_sources.training import lora as t_lora, sft as t_sft

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "assets" / "checkpoints" / "llama3"
TOKENIZER = ROOT / "assets" / "tokenizer" / "llama3"
DATA = ROOT / "assets" / "data" / "sft"
TASK = "llama3-sft"


@pytest.fixture(scope="module")
def ref():
    return read_reference(ROOT / "references" / f"{TASK}.h5")


@pytest.fixture(scope="module")
def l6_spec():
    return next(s for s in checks_for("training")[1] if s.key == heldout.HELDOUT_KEY)


def _garbage_adapter(ref) -> dict[str, np.ndarray]:
    r = np.random.default_rng(7)
    return {k: (r.standard_normal(v.shape) * 0.5).astype(np.float32)
            for k, v in ref.checks[heldout.ADAPTER_KEY].outputs.items()}


@torch.no_grad()
def _torch_logits(batches, adapter) -> list[np.ndarray]:
    model = t_sft.load_model(MODEL, t_sft.lora_config(t_sft.TrainArgs()), seed=0)
    t_lora.load_lora_state_dict(model, adapter)
    return [model(torch.as_tensor(b["input_ids"]).long(), torch.as_tensor(b["attention_mask"]).long()).numpy()
            for b in batches]


def test_l5_and_l6_run_in_separate_children():
    groups = LEVEL_GROUPS["training"]
    assert ("L5",) in groups and ("L6",) in groups
    assert not any("L5" in g and "L6" in g for g in groups)


def test_eval_loss_weighs_every_batch_the_same_and_shifts_the_labels():
    V = 4
    one = np.zeros((1, 3, V))
    one[0, 0, 2] = np.log(3.0)  # position 0 predicts label 1 (token 2): p = 3/6
    labels_one = np.array([[-100, 2, -100]])
    three = np.zeros((1, 4, V))  # uniform: every labelled token costs log 4
    labels_three = np.array([[5, 0, 1, 3]])  # label 0 is never predicted (the shift drops it) ...
    a, b = np.log(2.0), np.log(4.0)
    assert heldout.batch_loss(one, labels_one) == pytest.approx(a, abs=1e-12)
    # ... but counts in the denominator: transformers 5.6 (LF 0.9.5's) divides by every labelled position
    assert heldout.batch_loss(three, labels_three) == pytest.approx(3 * b / 4, abs=1e-12)
    # the mean of per-batch losses, not the pooled mean of the whole set
    assert heldout.eval_loss([one, three], [labels_one, labels_three], 4) == pytest.approx((a + 3 * b / 4) / 2,
                                                                                           abs=1e-12)
    # a batch with no label at all is NaN (0 / 0) and dropped, as logging_nan_inf_filter does; one whose only
    # label is at position 0 is 0 / 1
    unlabelled = np.array([[-100, -100, -100]])
    assert np.isnan(heldout.batch_loss(one, unlabelled))
    assert heldout.eval_loss([one, one], [labels_one, unlabelled], 4) == pytest.approx(a, abs=1e-12)
    assert heldout.batch_loss(one, np.array([[7, -100, -100]])) == 0.0
    # stable: logits far past exp's range
    assert heldout.batch_loss(one + 1e4, labels_one) == pytest.approx(a, abs=1e-9)


@pytest.mark.parametrize("eval_batch_size", [4, 5])  # 5: a short last batch of 4 weighs as much as a full one
def test_numpy_loss_is_the_torch_sources_evaluate_loss(ref, eval_batch_size):
    args = replace(t_sft.TrainArgs(), per_device_eval_batch_size=eval_batch_size)
    held_out = t_sft.load_processed_dataset(TOKENIZER, DATA, "eval", args)
    adapter = ref.checks[heldout.ADAPTER_KEY].outputs  # the trained one: it moves the loss
    collate = t_sft.make_collator(args)  # pad id 0, a multiple of 8: the source's _evaluate
    batches = [{k: v.numpy() for k, v in collate(held_out[s:s + eval_batch_size]).items()}
               for s in range(0, len(held_out), eval_batch_size)]
    ours = heldout.eval_loss(_torch_logits(batches, adapter), [b["labels"] for b in batches], eval_batch_size)
    theirs = t_sft.evaluate_loss(MODEL, adapter, held_out, args)
    assert abs(ours - theirs) <= 1e-6 * abs(theirs), (ours, theirs)
    assert abs(theirs - t_sft.evaluate_loss(MODEL, None, held_out, args)) > 1.0


def test_recorded_batches_reproduce_the_recorded_torch_loss(ref):
    rec = ref.checks[heldout.HELDOUT_KEY]
    batches = [{f: rec.inputs[f"b{i}.{f}"] for f in ("input_ids", "attention_mask", "labels")}
               for i in range(len([k for k in rec.inputs if k.endswith(".labels")]))]
    logits = _torch_logits(batches, ref.checks[heldout.ADAPTER_KEY].outputs)  # the torch seed run's adapter
    loss, shapes = heldout.heldout_loss(rec.inputs, {f"b{i}.logits": x for i, x in enumerate(logits)})
    assert abs(loss - float(rec.outputs["loss"])) <= 1e-6 * float(rec.outputs["loss"])
    assert ref.band[0] <= np.float32(loss) <= ref.band[1] and len(shapes) == len(batches)
    assert int(rec.inputs["eval_batch_size"]) == t_sft.TrainArgs().per_device_eval_batch_size


def test_child_gets_no_labels_and_only_the_produced_adapter(ref):
    produced = _garbage_adapter(ref)
    inputs = heldout.child_inputs(ref.checks[heldout.HELDOUT_KEY].inputs,
                                  heldout.adapter_inputs(ref.checks[heldout.ADAPTER_KEY].outputs, produced))
    assert not any(k.endswith(".labels") or k == "eval_batch_size" for k in inputs)
    for k, v in produced.items():
        np.testing.assert_array_equal(inputs[f"adapter.{k}"], v)
    recorded, first = ref.checks[heldout.ADAPTER_KEY].outputs, next(iter(produced))
    with pytest.raises(heldout.HeldoutError, match="lacks 1"):
        heldout.adapter_inputs(recorded, {k: v for k, v in produced.items() if k != first})
    with pytest.raises(heldout.HeldoutError, match="wrong shape"):
        heldout.adapter_inputs(recorded, {**produced, first: produced[first].T})


def _grade_with_fake_children(tmp_path, monkeypatch, l5_result) -> tuple[dict, list]:
    """grade(levels=("L6",)) with every child replaced: the L5 one returns l5_result, the L6 one a crash."""
    import grader.app as app

    calls = []

    def fake_run_group(candidate, cfg, ref_dir, specs, inputs, *args, **kwargs):
        calls.append(([s.key for s in specs], inputs))
        if heldout.ADAPTER_KEY in inputs:
            return (*l5_result, None)  # outputs, errors, seconds, the grader's clock usage
        return {}, {s.key: "crash: L6 child" for s in specs}, {}, None

    monkeypatch.setattr(app, "_run_group", fake_run_group)
    report = grade(compose_task(TASK), ROOT, ROOT / "references", tmp_path / "reports", quiet=True, levels=("L6",),
                   trusted=True)
    return report, calls


def test_l6_runs_on_the_adapter_l5_produced_and_scores_zero_without_one(ref, tmp_path, monkeypatch):
    produced = _garbage_adapter(ref)
    report, calls = _grade_with_fake_children(tmp_path, monkeypatch, ({heldout.ADAPTER_KEY: produced}, {}, {}))
    # L6 alone still runs the L5 adapter check first, in its own child, unscored
    assert [keys for keys, _ in calls] == [[heldout.ADAPTER_KEY], [heldout.HELDOUT_KEY]]
    assert [c["level"] for c in report["checks"]] == ["L0", "L6"]
    l6_inputs = calls[1][1][heldout.HELDOUT_KEY]
    assert set(l6_inputs) == set(heldout.child_inputs(ref.checks[heldout.HELDOUT_KEY].inputs,
                                                      {f"adapter.{k}": v for k, v in produced.items()}))
    for k, v in produced.items():  # the produced adapter, not the reference's
        np.testing.assert_array_equal(l6_inputs[f"adapter.{k}"], v)

    report, calls = _grade_with_fake_children(tmp_path, monkeypatch, ({}, {heldout.ADAPTER_KEY: "crash: boom"}, {}))
    l6 = report["checks"][-1]
    assert len(calls) == 1 and l6["name"] == "heldout_loss" and l6["score"] == 0.0
    assert "no adapter from L5/e2e_adapter: crash: boom" in l6["reason"]


def _run_l6_child_in_process(ref, adapter, monkeypatch) -> dict:
    """The L6 probe as the child runs it, with the candidate's train_sft and evaluate functions booby-trapped."""
    from grader.probes import training as probes
    from jax_oracles.training import sft as j_sft

    def trap(*a, **k):
        raise AssertionError("the L6 child called the candidate's own training or evaluation")

    for name in ("train_sft", "evaluate_loss", "_evaluate", "mean_of_batch_losses"):
        monkeypatch.setattr(j_sft, name, trap)
    meta = {"task": _task_meta(compose_task(TASK)),
            "assets": {"checkpoint": str(MODEL), "tokenizer": str(TOKENIZER), "data": str(DATA)}}
    inputs = heldout.child_inputs(ref.checks[heldout.HELDOUT_KEY].inputs,
                                  heldout.adapter_inputs(ref.checks[heldout.ADAPTER_KEY].outputs, adapter))
    return probes.probe_heldout_loss(probes.Ctx(meta), inputs)


def test_the_score_is_the_graders_loss_not_the_reported_one(ref, l6_spec, monkeypatch):
    rec, band = ref.checks[heldout.HELDOUT_KEY], ref.band
    # a garbage adapter (its train_sft would report the band midpoint): the grader's loss is far out
    logits = _run_l6_child_in_process(ref, _garbage_adapter(ref), monkeypatch)
    check, detail = _score_heldout(l6_spec, rec, logits, None, band, 1.0)
    assert detail["grader_loss"] > band[1] + 1.0 and check.score < check.bar, (check, detail)
    # the trained adapter the torch seed run produced scores 1, whatever a candidate would report
    logits = _run_l6_child_in_process(ref, ref.checks[heldout.ADAPTER_KEY].outputs, monkeypatch)
    check, detail = _score_heldout(l6_spec, rec, logits, None, band, 1.0)
    assert check.score == 1.0 and abs(detail["grader_loss"] - float(rec.outputs["loss"])) < 1e-4, (check, detail)
    assert detail["logits_shapes"][0] == [*rec.inputs["b0.input_ids"].shape, 512]
    # non-finite or misshapen logits score 0 with the reason
    bad = {**logits, "b1.logits": np.full_like(logits["b1.logits"], np.nan)}
    check, _ = _score_heldout(l6_spec, rec, bad, None, band, 1.0)
    assert check.score == 0.0 and "non-finite" in check.reason
    check, _ = _score_heldout(l6_spec, rec, {**logits, "b0.logits": logits["b0.logits"][:, :-1]}, None, band, 1.0)
    assert check.score == 0.0 and "b0.logits" in check.reason


CHEAT = '''
def train_sft(model_dir, tokenizer_dir, data_dir, args=TrainArgs()):
    """Honest training, then a garbage adapter and the band midpoint reported as the held-out loss."""
    result = _honest_train_sft(model_dir, tokenizer_dir, data_dir, args)
    garbage = {k: np.zeros_like(v) if "lora_B" in k else v * 50.0 for k, v in result.lora_state_dict.items()}
    return SFTResult(result.step_losses, result.eval_loss_before, MIDPOINT, garbage, result.wall_clock_s)
'''


@pytest.mark.sandbox  # the verifier env; trusted, so no namespaces
@pytest.mark.slow  # CI time (~16 s): test_the_score_is_the_graders_loss_not_the_reported_one stays in CI
def test_a_candidate_reporting_the_band_midpoint_gets_the_graders_loss(ref, tmp_path):
    cand = tmp_path / "cand"
    for tree in ("jax_oracles", "serving_engine", "conversion"):
        shutil.copytree(ROOT / tree, cand / tree, ignore=shutil.ignore_patterns("__pycache__"))
    sft = cand / "jax_oracles/training/sft.py"
    text = sft.read_text().replace("def train_sft(", "def _honest_train_sft(")
    midpoint = float(np.mean(ref.band))
    sft.write_text(text + f"\n\nMIDPOINT = {midpoint!r}\n" + textwrap.dedent(CHEAT))
    report = grade(compose_task(TASK), cand, ROOT / "references", tmp_path / "reports", quiet=True,
                   levels=("L5", "L6"), trusted=True)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["e2e_step_losses"]["score"] >= 0.999  # the training itself is honest
    l6, detail = checks["heldout_loss"], report["details"][heldout.HELDOUT_KEY]
    # B = 0: the adapted model is the base model, so the grader's loss is the untrained one
    loss_before = float(ref.checks[heldout.HELDOUT_KEY].attrs["loss_before"])
    assert abs(detail["grader_loss"] - loss_before) < 1e-3 * loss_before, detail
    assert l6["score"] < l6["bar"] and l6["score"] < 0.9, l6
