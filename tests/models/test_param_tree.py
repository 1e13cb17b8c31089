"""L0/param_tree: `conversion.<family>.hf_layout` runs the conversion table backwards, and the check it feeds
compares every HF tensor name and shape, so a tensor swapped with one of equal size, a kernel left in
the wrong layout or a tensor forgotten fails L0 (sorted element counts alone let the first two through).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

from flax import traverse_util
import numpy as np
import pytest

from catalog.layout import layout_arrays
from conversion import gemma4, llama3, safetensors_io as st_io

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {"llama3": ROOT / "assets/checkpoints/llama3", "gemma4": ROOT / "assets/checkpoints/gemma4"}
CONVERSIONS = {"llama3": llama3, "gemma4": gemma4}


def _checkpoint_layout(family) -> dict[str, tuple[int, ...]]:
    return {name: w.shape for name, w in st_io.load_state_dict(FAMILIES[family]).items()}


def _differs(produced: dict, reference: dict) -> list[str]:
    """The output arrays on which the spec measure ("pass": exact equality) fails, as grader/app.py scores it."""
    return [k for k, ref in reference.items()
            if k not in produced or np.shape(produced[k]) != np.shape(ref) or not np.array_equal(produced[k], ref)]


def _tampered_params(monkeypatch, family, edit):
    """load_params with `edit(flat)` applied to the converted tree: a conversion bug the table check misses."""
    conv = CONVERSIONS[family]
    apply_rules = conv.apply_rules

    def tampered(state, rules, expected):
        flat = traverse_util.flatten_dict(apply_rules(state, rules, expected), sep="/")
        edit(flat)
        return traverse_util.unflatten_dict(flat, sep="/")

    monkeypatch.setattr(conv, "apply_rules", tampered)
    return conv.load_params(FAMILIES[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_layout_of_the_converted_tree_is_the_checkpoint_layout(family):
    conv = CONVERSIONS[family]
    assert conv.hf_layout(conv.load_params(FAMILIES[family])) == _checkpoint_layout(family)


@pytest.mark.parametrize("family", FAMILIES)
def test_recorder_and_grader_probes_give_identical_arrays(family):
    from grader.probes import serving as grader_serving
    from grader.probes import training as grader_training
    from recorder.probes import serving as recorder_serving
    from recorder.probes import training as recorder_training

    conv, ckpt = CONVERSIONS[family], FAMILIES[family]
    _, reference = recorder_training.probe_param_tree(SimpleNamespace(ckpt=ckpt))
    from torch_sources.models import gemma4 as torch_gemma4
    from torch_sources.models import llama3 as torch_llama3

    # the recorder's serving ctx: the torch family module and its config (a release's text_state_dict needs both)
    torch_family, config_cls = {"llama3": (torch_llama3, torch_llama3.LlamaConfig),
                                "gemma4": (torch_gemma4, torch_gemma4.Gemma4TextConfig)}[family]
    serving_ctx = SimpleNamespace(ckpt=ckpt, family=torch_family, config=config_cls.from_pretrained(ckpt))
    _, reference_serving = recorder_serving.probe_param_tree(serving_ctx)
    assert set(reference) == {"names", "shapes", "ranks", "numel_sorted", "total"}
    assert not _differs(reference_serving, reference)
    produced = grader_serving.probe_param_tree(SimpleNamespace(ckpt=ckpt, conversion=conv), {})
    assert not _differs(produced, reference)
    produced = grader_training.probe_param_tree(SimpleNamespace(params=conv.load_params(ckpt), conversion=conv), {})
    assert not _differs(produced, reference)
    assert reference["shapes"].shape == (len(reference["names"]), 2) and (reference["shapes"] >= -1).all()


def test_layout_arrays_sort_names_and_pad_shapes_with_minus_one():
    out = layout_arrays({"b.weight": (3, 4), "a.layer_scalar": (1,), "c.scalar": ()})
    assert out["names"].tolist() == ["a.layer_scalar", "b.weight", "c.scalar"]
    np.testing.assert_array_equal(out["shapes"], [[1, -1], [3, 4], [-1, -1]])
    np.testing.assert_array_equal(out["ranks"], [1, 2, 0])
    np.testing.assert_array_equal(out["numel_sorted"], [1, 1, 12])
    assert out["total"] == 14


def test_two_equal_size_tensors_swapped_fail_although_the_element_counts_agree(monkeypatch):
    def swap(flat):  # gate_proj [64, 128] <-> down_proj [128, 64]: 8192 elements each
        a, b = "model/layers_0/mlp/gate_proj/kernel", "model/layers_0/mlp/down_proj/kernel"
        flat[a], flat[b] = flat[b], flat[a]

    params = _tampered_params(monkeypatch, "llama3", swap)
    reference = layout_arrays(_checkpoint_layout("llama3"))
    assert _differs(layout_arrays(llama3.hf_layout(params)), reference) == ["shapes"]


@pytest.mark.parametrize("family, path", [("llama3", "model/layers_1/self_attn/k_proj/kernel"),
                                          ("gemma4", "model/layers_0/per_layer_input_gate/kernel")])
def test_a_kernel_left_in_the_torch_layout_fails(monkeypatch, family, path):
    def transpose(flat):
        flat[path] = flat[path].T

    params = _tampered_params(monkeypatch, family, transpose)
    layout = CONVERSIONS[family].hf_layout(params)
    expected = _checkpoint_layout(family)
    name = next(n for n in expected if layout[n] != expected[n])
    assert layout[name] == expected[name][::-1]
    assert _differs(layout_arrays(layout), layout_arrays(expected)) == ["shapes"]


def test_a_tensor_left_out_fails(monkeypatch):
    params = _tampered_params(monkeypatch, "gemma4", lambda flat: flat.pop("model/layers_3/self_attn/q_norm/weight"))
    assert "model.layers.3.self_attn.q_norm.weight" not in gemma4.hf_layout(params)
    produced, reference = layout_arrays(gemma4.hf_layout(params)), layout_arrays(_checkpoint_layout("gemma4"))
    assert {"names", "shapes", "ranks", "numel_sorted", "total"} == set(_differs(produced, reference))


def test_a_param_no_rule_writes_is_refused(monkeypatch):
    def rename(flat):
        flat["model/layers_0/mlp/fused_gate_up/kernel"] = flat.pop("model/layers_0/mlp/gate_proj/kernel")

    params = _tampered_params(monkeypatch, "llama3", rename)
    with pytest.raises(ValueError, match="fused_gate_up"):
        llama3.hf_layout(params)


def test_a_tied_head_reports_only_the_embedding_the_release_stores():
    state = st_io.load_state_dict(FAMILIES["llama3"])
    config = dataclasses.replace(llama3.load_config(FAMILIES["llama3"]), tie_word_embeddings=True)
    layout = llama3.hf_layout(llama3.convert_state_dict(state, config))
    assert layout == {k: v for k, v in _checkpoint_layout("llama3").items() if k != "lm_head.weight"}
