"""The LLaMA-Factory parity harness (tools/lf_parity): its comparisons can fail, its LF job is the task's config,
and (slow, where `make lf-env` has run) one task per method matches LLaMA-Factory within 1e-5."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tools.lf_parity import compare
from tools.lf_parity.harness import LF_PYTHON, TRL_OVERLAY, lf_arguments, make_job
from tools.lf_parity.table import failing_cells, render

ROOT = Path(__file__).resolve().parents[2]


def test_token_comparison_names_the_first_difference_and_refusals():
    rows = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]}]
    same = compare.compare_tokens({"default": {"train": rows}}, {"default": {"train": rows}})
    assert same["error"] is None and same["rows"] == 2
    changed = [rows[0], {"input_ids": [4, 6], "labels": [-100, 5]}]
    diff = compare.compare_tokens({"default": {"train": changed}}, {"default": {"train": rows}})
    assert "row 1 input_ids[1]" in diff["error"]
    assert compare.compare_tokens({"default": {"train": rows[:1]}}, {"default": {"train": rows}})["error"]
    refused = {"refused": "Current template does not support `train_on_prompt`."}
    both = compare.compare_tokens({"top": refused}, {"top": refused})
    assert both["error"] is None and both["refused"] == ["top"]
    assert "refused by LF only" in compare.compare_tokens({"top": refused}, {"top": {"train": rows}})["error"]


def test_value_comparisons_never_hide_a_nan_or_a_shape():
    assert compare.compare_values([1.0, 2.0], [1.0, 2.0 + 1e-6])["max_abs"] == pytest.approx(1e-6)
    # 1e-5 absolute up to magnitude 1, relative beyond (float32 spacing near 70 is 7.6e-6)
    assert compare.within(compare.compare_values([70.0], [70.0 + 3e-4]))
    assert not compare.within(compare.compare_values([70.0], [70.0 + 3e-3]))
    assert not compare.within(compare.compare_values([0.5], [0.5 + 2e-5]))
    assert compare.compare_values([1.0, float("nan")], [1.0, 2.0])["error"] == "a non-finite value"
    assert "shapes differ" in compare.compare_values([1.0], [1.0, 2.0])["error"]
    a = {"x.lora_A.weight": np.ones((2, 2), np.float32)}
    assert compare.compare_adapters(a, {"x.lora_A.weight": np.ones((2, 2))})["max_abs"] == 0
    assert "names differ" in compare.compare_adapters(a, {"y.lora_A.weight": np.ones((2, 2))})["error"]
    assert compare.compare_adapters(None, a)["error"]


def test_a_cell_past_the_tolerance_fails_and_a_documented_one_does_not():
    ok = {"max_abs": 1e-6, "n": 3, "error": None}
    record = {"task": "t", "cells": {"tokens": {"rows": 2, "error": None}, "losses": ok,
                                     "adapter": {"max_abs": 2e-5, "n": 3, "error": None},
                                     "sdpa.metrics": {"max_abs": 0.02, "n": 3, "error": None, "reason": "why"},
                                     "reference": {"max_abs": 1.0, "n": 3, "error": None}}}
    assert failing_cells(record) == ["adapter"]
    text = render([record])
    assert "> 1e-5" in text and "[1] why" in text


def test_the_lf_job_is_the_task_config(tmp_path):
    job = make_job("llama3-dpo", tmp_path)
    args = lf_arguments(job)
    assert args["stage"] == "dpo" and args["template"] == "llama3" and args["lora_target"] == "all"
    assert args["learning_rate"] == job.args.learning_rate and args["pref_beta"] == job.args.pref_beta
    assert args["cutoff_len"] == job.args.cutoff_len and args["flash_attn"] == "disabled"
    info = json.loads((tmp_path / "data" / "dataset_info.json").read_text())
    assert info["t2j_train"]["ranking"] is True and info["t2j_train"]["columns"]["chosen"] == "chosen"
    assert (tmp_path / "model" / "tokenizer.json").exists() and (tmp_path / "model" / "config.json").exists()
    ppo = lf_arguments(make_job("llama3-ppo", tmp_path / "ppo"))
    assert ppo["reward_model_type"] == "full" and (Path(ppo["reward_model"]) / "value_head.safetensors").exists()
    with pytest.raises(ValueError, match="serving task"):
        make_job("llama3-core", tmp_path)


def test_the_torchaudio_stand_in_imports_and_refuses_use():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from lf_child import install_torchaudio_standin as s; "
            "assert s(); import torchaudio, importlib.util; assert importlib.util.find_spec('torchaudio'); "
            "assert not hasattr(torchaudio, 'load'); print('ok')")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "tools" / "lf_parity")], capture_output=True,
                         text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.slow
@pytest.mark.skipif(not (LF_PYTHON.exists() and TRL_OVERLAY.exists()), reason="no .venv-lf: run `make lf-env`")
@pytest.mark.parametrize("task", ["llama3-sft", "llama3-dpo", "llama3-ppo"])
def test_llamafactory_parity_one_task_per_method(task, tmp_path):
    from tools.lf_parity.parity import task_parity

    record = task_parity(task, tmp_path, train_variants=task == "llama3-sft", ppo_effects=False)
    assert failing_cells(record) == [], {k: v for k, v in record["cells"].items() if k in failing_cells(record)}
    assert {"tokens", "losses", "adapter"} <= set(record["cells"])
