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
from tools.lf_parity.harness import (LF_PYTHON, RELEASE_PREPROCESSOR, RELEASE_VIDEO_PREPROCESSOR, TRL_OVERLAY,
                                     lf_arguments, make_job, text_hidden_size)
from tools.lf_parity.table import failing_cells, render, write_table

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


def test_batch_comparison_is_exact_on_integers_and_reads_lf_positions_row_zero():
    pos = np.arange(2 * 3 * 5).reshape(3, 2, 5)
    ours = {"input_ids": np.ones((2, 5), np.int64), "image_grid_thw": np.array([[1, 4, 4]]), "position_ids": pos,
            "pixel_values": np.zeros((16, 4), np.float32)}
    lf = {**ours, "position_ids": np.concatenate([pos[:1], pos])}  # LF prepends the temporal row (text positions)
    same = compare.compare_batches([lf], [ours])
    assert same["error"] is None and same["max_abs"] == 0 and compare.within(same)
    near = compare.compare_batches([{**lf, "pixel_values": lf["pixel_values"] + 5e-7}], [ours])
    assert near["error"] is None and compare.within(near)
    far = compare.compare_batches([{**lf, "pixel_values": lf["pixel_values"] + 2e-6}], [ours])
    assert not compare.within(far) and compare.within(far, 1e-5)  # the cell's own tolerance (1e-6) judges it
    grid = compare.compare_batches([{**lf, "image_grid_thw": np.array([[1, 4, 6]])}], [ours])
    assert "batch 0 image_grid_thw[0, 2]" in grid["error"]
    wrong_row0 = compare.compare_batches([{**lf, "position_ids": np.concatenate([pos[:1] + 1, pos])}], [ours])
    assert "row 0" in wrong_row0["error"]
    assert "keys differ" in compare.compare_batches([{**lf, "rope_deltas": np.zeros((2, 1))}], [ours])["error"]
    assert "2 batches from LF" in compare.compare_batches([lf, lf], [ours])["error"]
    assert compare.compare_batches(None, [ours])["error"]


def test_audio_frames_padded_differently_are_an_error_that_still_compares_the_rest():
    """Qwen2.5-Omni: LF's extractor pads every audio to the release's 300 s, the source's to 30 s: an error naming
    both frame counts, the common frames compared, the longer side's extra frames required masked out, every
    batch still compared."""
    mask = np.zeros((1, 30), np.int64)
    mask[0, :10] = 1
    features = np.full((1, 4, 30), -1.5, np.float32)
    ours = {"input_ids": np.ones((1, 5), np.int64), "input_features": features[..., :3 * 4],
            "feature_attention_mask": mask[:, :12]}
    lf = {**ours, "input_features": features, "feature_attention_mask": mask}
    cell = compare.compare_batches([lf, lf], [ours, ours])
    assert cell["error"].startswith("audio frames: feature_attention_mask LF 30, source 12")
    assert "batch" not in cell["error"] and cell["max_abs"] == 0 and not compare.within(cell)
    unmasked = compare.compare_batches([{**lf, "feature_attention_mask": np.ones((1, 30), np.int64)}], [ours])
    assert "frames past 12 are not masked out" in unmasked["error"]
    changed = compare.compare_batches([lf, {**lf, "input_ids": np.zeros((1, 5), np.int64)}], [ours, ours])
    assert "batch 1 input_ids" in changed["error"]  # the later batches are still compared


def test_the_qwen3_vl_and_omni_jobs_stage_the_release_files(tmp_path):
    """Qwen3-VL: the release's preprocessor_config.json (size dict, patch 16, mean/std 0.5), the source's settings;
    the video processor's settings travel to the child (its stand-in). Omni: the release's one file for the image
    processor and the Whisper extractor, the tokenizer config's multimodal token names, an empty spk_dict.pt."""
    from torch_sources.models.vision_processing import QwenImageProcessorConfig

    job = make_job("qwen3-vl-sft", tmp_path / "q3")
    lf_arguments(job)
    config = json.loads((tmp_path / "q3" / "model" / "preprocessor_config.json").read_text())
    assert config == RELEASE_PREPROCESSOR["qwen3_vl"] and config["processor_class"] == "Qwen3VLProcessor"
    assert QwenImageProcessorConfig.from_hf(config) == QwenImageProcessorConfig.qwen3_vl()
    assert RELEASE_VIDEO_PREPROCESSOR["qwen3_vl"]["merge_size"] == config["merge_size"]
    omni = make_job("qwen2-omni-sft", tmp_path / "omni")
    assert omni.model_type == "qwen2_5_omni" and text_hidden_size(omni.checkpoint) == 64
    lf_arguments(omni)
    model = tmp_path / "omni" / "model"
    config = json.loads((model / "preprocessor_config.json").read_text())
    assert config["feature_extractor_type"] == "WhisperFeatureExtractor" and config["chunk_length"] == 300
    assert QwenImageProcessorConfig.from_hf(config) == QwenImageProcessorConfig.qwen2_vl()
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    assert tokenizer_config["image_token"] == "<|IMAGE|>" and not (model / "tokenizer_config.json").is_symlink()
    assert (model / "spk_dict.pt").exists()
    shipped = json.loads((omni.tokenizer / "tokenizer_config.json").read_text())
    assert "image_token" not in shipped  # the tiny tokenizer's own file is untouched


def test_a_finding_marks_a_cell_and_still_fails_it():
    record = {"task": "t", "cells": {"tokens": {"rows": 2, "error": None},
                                     "losses": {"max_abs": 0.02, "n": 3, "error": None, "finding": "LF's own rule"}}}
    assert failing_cells(record) == ["losses"]
    assert "2.0e-02 **> 1e-5** [1]" in render([record]) and "[1] LF's own rule" in render([record])


def test_writing_some_tasks_keeps_the_other_rows_and_their_notes(tmp_path):
    doc = tmp_path / "PARITY.md"
    old = {"task": "a-sft", "cells": {"tokens": {"rows": 2, "error": None},
                                      "metrics": {"max_abs": None, "n": 0, "error": None, "reason": "old note"},
                                      "sdpa.losses": {"max_abs": 3e-6, "n": 1, "error": None, "reason": "sdpa note"}}}
    write_table([old], doc)
    doc.write_text("intro\n" + doc.read_text())
    new = {"task": "b-sft", "cells": {"tokens": {"rows": 4, "error": None},
                                      "metrics": {"max_abs": None, "n": 0, "error": None, "reason": "new note"}}}
    write_table([new], doc)
    text = doc.read_text()
    assert text.startswith("intro\n") and text.count("parity-table:begin") == 1
    rows = {}  # each task's parity row (its first; the effects table's comes after)
    for line in text.splitlines():
        if line.startswith("| "):
            rows.setdefault(line.split("|")[1].strip(), line)
    assert "identical (2 rows)" in rows["a-sft"] and "identical (4 rows)" in rows["b-sft"]
    notes = {line.split("] ", 1)[1].strip(): line.split("]")[0] + "]" for line in text.splitlines()
             if line.startswith("[")}
    assert notes.keys() == {"old note", "sdpa note", "new note"}
    assert f"n/a {notes['old note']}" in rows["a-sft"] and f"n/a {notes['new note']}" in rows["b-sft"]
    assert f"3.0e-06 {notes['sdpa note']}" in text
    write_table([{**old, "cells": {**old["cells"], "tokens": {"rows": 3, "error": None}}}], doc)  # a task redone
    assert "identical (3 rows)" in doc.read_text() and "identical (2 rows)" not in doc.read_text()


def test_the_lf_job_of_a_vl_task_carries_its_images(tmp_path):
    job = make_job("qwen2-vl-sft", tmp_path)
    assert job.mm and job.media_dir == job.data and job.model_type == "qwen2_vl"
    args = lf_arguments(job)
    assert args["media_dir"] == str(job.data) and args["template"] == "qwen2_vl" and args["cutoff_len"] == 128
    columns = json.loads((tmp_path / "data" / "dataset_info.json").read_text())["t2j_train"]["columns"]
    assert columns["images"] == "images" and "history" not in columns  # the VL data has no history column
    config = json.loads((tmp_path / "model" / "preprocessor_config.json").read_text())
    assert config == RELEASE_PREPROCESSOR["qwen2_vl"] and config["processor_class"] == "Qwen2VLProcessor"
    # the release's settings are the source's plugin's (tests/models/test_vision_processing.py holds both to HF)
    from torch_sources.models.vision_processing import QwenImageProcessorConfig
    assert QwenImageProcessorConfig.from_hf(config) == QwenImageProcessorConfig.qwen2_vl()
    text = make_job("llama3-sft", tmp_path / "text")
    assert not text.mm and "media_dir" not in lf_arguments(text)
    assert not (tmp_path / "text" / "model" / "preprocessor_config.json").exists()


def test_the_torchaudio_stand_in_imports_and_refuses_use():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from lf_child import install_torchaudio_standin as s; "
            "assert s(); import torchaudio, importlib.util; assert importlib.util.find_spec('torchaudio'); "
            "assert not hasattr(torchaudio, 'load'); print('ok')")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "tools" / "lf_parity")], capture_output=True,
                         text=True)
    assert out.stdout.strip() == "ok", out.stderr


# Cells known to differ from LLaMA-Factory, each with the finding that explains it: none (the VL SFT loss, LF's
# per-micro-batch normalization under a processor, is the source's too since it was found here).
KNOWN_DIFFERENCES: dict[str, list[str]] = {}


@pytest.mark.slow
@pytest.mark.skipif(not (LF_PYTHON.exists() and TRL_OVERLAY.exists()), reason="no .venv-lf: run `make lf-env`")
@pytest.mark.parametrize("task", ["llama3-sft", "llama3-dpo", "llama3-ppo", "qwen2-vl-sft"])
def test_llamafactory_parity_one_task_per_method(task, tmp_path):
    from tools.lf_parity.parity import HF_LOSS_KWARGS, MM_LOSS, task_parity

    record = task_parity(task, tmp_path, train_variants=task == "llama3-sft", ppo_effects=False)
    cells = record["cells"]
    known = KNOWN_DIFFERENCES.get(task, [])
    assert failing_cells(record) == known, {k: v for k, v in cells.items() if k in failing_cells(record)}
    assert {"tokens", "losses", "adapter"} <= set(cells)
    if task.startswith("qwen2-vl"):  # LF with HF's own loss rule restored: measured, and it does move the loss
        assert cells[f"{HF_LOSS_KWARGS}.losses"]["reason"] == MM_LOSS
        assert not compare.within(cells[f"{HF_LOSS_KWARGS}.losses"])
    if task.startswith("qwen2-vl"):  # LF's collator and the source's, batch for batch: pixels, grids, positions
        assert cells["batches"]["error"] is None and cells["batches"]["max_abs"] == 0 and cells["batches"]["batches"]
