"""On catalog defects (grader/sweep/defects/common.yaml: the test reads the catalog, the twin never does), the
twin's first failing property names the module the defect edits: a migration bug is found where it was made, not
three levels later. On the oracle itself (tests/twin/test_oracle.py) every property is established."""
from __future__ import annotations

import pytest

from grader.sweep.defects import load_catalog, make_mutant
from twin.harness import run_twin

# defect id -> the task it is run on (eleven: the shared conversion rules were added when the twin's param_tree
# pointed only at the family's table); two in the fast suite (one per class), the rest marked slow
DEFECTS = {
    "train-hf-layout-reports-flax-shapes": "llama3-sft",  # conversion/rules.py: the layout every table runs on
    "train-rmsnorm-gemma-offset": "llama3-sft",          # models/layers.py: the shared RMSNorm
    "train-rope-llama3-smoothing-swapped": "llama3-sft",  # models/rope.py
    "train-lora-linear-unscaled": "llama3-sft",           # training/lora.py
    "train-residual-from-normed-input": "llama3-sft",     # models/llama3.py: one layer
    "train-labels-not-shifted": "llama3-sft",             # training/loss.py
    "train-adamw-no-bias-correction": "llama3-sft",       # training/optimizer.py
    "serve-temperature-multiplied": "llama3-core",        # serving_engine/sampler.py
    "serve-kv-write-wrong-slot": "llama3-core",           # the paged KV write kernel
    "serve-decode-position-off-by-one": "llama3-core",    # serving_engine/model_runner.py
    "serve-blocks-leak-on-finish": "llama3-core",         # the engine's block bookkeeping
}
FAST = ("train-lora-linear-unscaled", "serve-temperature-multiplied")


def _cases():
    by_id = {d.id: d for d in load_catalog().defects}
    for did, task in DEFECTS.items():
        marks = [pytest.mark.sandbox] + ([] if did in FAST else [pytest.mark.slow])
        yield pytest.param(by_id[did], task, id=did, marks=marks)


@pytest.mark.parametrize("defect,task", list(_cases()))
def test_the_first_failing_property_is_at_the_edited_module(defect, task, tmp_path):
    mutant = make_mutant(defect, tmp_path / "mutant")
    report = run_twin(task, mutant, seed=1)
    first = report.first_failing
    assert first is not None, f"{defect.id}: every property established on the mutant"
    assert defect.file in first.prop.modules, (
        f"{defect.id} edits {defect.file}; first failing {first.prop.key} ({first.status}) names "
        f"{first.prop.modules}: {first.candidate_error or first.first_divergent}")
