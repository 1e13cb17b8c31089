"""The config-key audit (issue 29): every key of each family's transformers config class, and every key the
family's releases write beside them, is listed once by the sources as honored, ignored (with why it cannot
change the numbers) or refused (with the accepted values), identically on the torch and the JAX side; a key
in no list, or a refused key at another value, stops loading with the key's name."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
# family file -> (transformers config class, keys real releases write that the class does not save)
RELEASE_ONLY_ROPE = {"rope_theta", "rope_scaling", "torch_dtype"}  # transformers < 5's RoPE form, and the dtype
FAMILIES = {
    "llama3": ("LlamaConfig", RELEASE_ONLY_ROPE),
    "mistral": ("MistralConfig", RELEASE_ONLY_ROPE),
    "qwen2": ("Qwen2Config", RELEASE_ONLY_ROPE | {"use_mrope", "head_dim"}),
    "qwen3": ("Qwen3Config", RELEASE_ONLY_ROPE),
    "phi4": ("Phi3Config", RELEASE_ONLY_ROPE | {"partial_rotary_factor", "attention_bias", "head_dim"}),
    "starcoder2": ("Starcoder2Config", RELEASE_ONLY_ROPE | {"mlp_type", "head_dim"}),
    "falcon": ("FalconConfig", RELEASE_ONLY_ROPE | {"apply_residual_connection_post_layernorm"}),
    "bloom": ("BloomConfig", {"torch_dtype", "attention_softmax_in_fp32", "bias_dropout_fusion",
                              "masked_softmax_fusion", "offset_alibi", "skip_bias_add", "skip_bias_add_qkv", "n_inner",
                              "unk_token_id", "n_embed", "num_hidden_layers", "num_attention_heads"}),
    "gpt_oss": ("GptOssConfig", RELEASE_ONLY_ROPE | {"experts_per_token", "initial_context_length",
                                                     "quantization_config", "num_experts"}),
}


def _module(side: str, fam: str):
    return importlib.import_module(f"{'torch_sources' if side == 'torch' else 'jax_oracles'}.models.{fam}")


def _hf_keys(cls_name: str) -> set[str]:
    return set(getattr(transformers, cls_name)().to_dict())


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_every_transformers_and_release_key_is_listed(fam):
    cls_name, release_only = FAMILIES[fam]
    audit = _module("torch", fam).CONFIG_KEYS
    want = _hf_keys(cls_name) | release_only
    assert want - audit.keys == set(), f"{fam}: keys neither honored, ignored nor refused"
    assert audit.keys - want == set(), f"{fam}: listed keys that neither transformers nor a release writes"
    for key, why in audit.ignored.items():
        assert why.strip(), f"{fam}: {key} ignored without a reason"


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_the_twins_audit_alike(fam):
    t, j = _module("torch", fam).CONFIG_KEYS, _module("jax", fam).CONFIG_KEYS
    assert (t.family, set(t.honored), dict(t.ignored)) == (j.family, set(j.honored), dict(j.ignored))
    assert {k: (tuple(map(repr, a)), w) for k, (a, w) in t.refused.items()} == \
        {k: (tuple(map(repr, a)), w) for k, (a, w) in j.refused.items()}


def _checkpoint_config(fam: str) -> dict:
    return json.loads((ROOT / "assets" / "checkpoints" / fam / "config.json").read_text())


def _config_class(module):
    return next(getattr(module, n) for n in module.__all__ if n.endswith("Config") and n != "CONFIG_KEYS")


@pytest.mark.parametrize("side", ["torch", "jax"])
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_an_unknown_key_stops_loading_by_name(fam, side):
    cls = _config_class(_module(side, fam))
    d = _checkpoint_config(fam)
    cls.from_hf(dict(d))  # the shipped checkpoint loads
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rope_scaling_v2'\]"):
        cls.from_hf({**d, "rope_scaling_v2": {"factor": 2.0}})


@pytest.mark.parametrize("side", ["torch", "jax"])
@pytest.mark.parametrize("fam", list(FAMILIES))
def test_every_refused_key_stops_loading_at_another_value(fam, side):
    module = _module(side, fam)
    cls, d = _config_class(module), _checkpoint_config(fam)
    for key, (accepted, _) in module.CONFIG_KEYS.refused.items():
        other = "__not_accepted__" if not any(isinstance(a, bool) for a in accepted) else not accepted[0]
        with pytest.raises(ValueError, match=key):
            cls.from_hf({**d, key: other})


def test_gemma4_lists_every_key_of_its_config_class():
    """Gemma 4 keeps its own lists (torch_sources/models/gemma4.py): fields, head-shape keys, no-math keys."""
    from torch_sources.models import gemma4 as tm
    from dataclasses import fields
    listed = {f.name for f in fields(tm.Gemma4TextConfig)} | tm.HEAD_SHAPE_KEYS | tm.NO_MATH_KEYS
    assert _hf_keys("Gemma4TextConfig") - listed == set()


# The staged vision-language families (docs/FAMILIES.md): each audit against the transformers config class whose keys
# it reads, (module, audit name, transformers config class path)
VL_AUDITS = [
    ("qwen2_vl", "TEXT_KEYS", "models.qwen2_vl.configuration_qwen2_vl.Qwen2VLTextConfig"),
    ("qwen2_vl", "CONFIG_KEYS", "models.qwen2_vl.configuration_qwen2_vl.Qwen2VLConfig"),
    ("vision", "QWEN2_VL_KEYS", "models.qwen2_vl.configuration_qwen2_vl.Qwen2VLVisionConfig"),
    ("qwen3_vl", "TEXT_KEYS", "models.qwen3_vl.configuration_qwen3_vl.Qwen3VLTextConfig"),
    ("qwen3_vl", "CONFIG_KEYS", "models.qwen3_vl.configuration_qwen3_vl.Qwen3VLConfig"),
    ("vision", "QWEN3_VL_KEYS", "models.qwen3_vl.configuration_qwen3_vl.Qwen3VLVisionConfig"),
    ("vision", "QWEN2_5_VL_KEYS", "models.qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLVisionConfig"),
    ("qwen2_5_vl", "TEXT_KEYS", "models.qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLTextConfig"),
    ("qwen2_5_vl", "CONFIG_KEYS", "models.qwen2_5_vl.configuration_qwen2_5_vl.Qwen2_5_VLConfig"),
    ("vision", "QWEN2_5_VL_KEYS", "models.qwen2_5_omni.configuration_qwen2_5_omni.Qwen2_5OmniVisionEncoderConfig"),
    ("qwen2_omni", "TEXT_KEYS", "models.qwen2_5_omni.configuration_qwen2_5_omni.Qwen2_5OmniTextConfig"),
    ("qwen2_omni", "CONFIG_KEYS", "models.qwen2_5_omni.configuration_qwen2_5_omni.Qwen2_5OmniThinkerConfig"),
    ("qwen2_omni", "WRAPPER_KEYS", "models.qwen2_5_omni.configuration_qwen2_5_omni.Qwen2_5OmniConfig"),
    ("audio", "AUDIO_KEYS", "models.qwen2_5_omni.configuration_qwen2_5_omni.Qwen2_5OmniAudioEncoderConfig"),
    ("gemma3", "TEXT_KEYS", "models.gemma3.configuration_gemma3.Gemma3TextConfig"),
    ("gemma3", "CONFIG_KEYS", "models.gemma3.configuration_gemma3.Gemma3Config"),
    ("siglip", "VISION_KEYS", "models.siglip.configuration_siglip.SiglipVisionConfig"),
    ("paligemma", "TEXT_KEYS", "models.gemma.configuration_gemma.GemmaConfig"),
    ("paligemma", "CONFIG_KEYS", "models.paligemma.configuration_paligemma.PaliGemmaConfig"),
    ("internvl", "CONFIG_KEYS", "models.internvl.configuration_internvl.InternVLConfig"),
    ("intern_vit", "VISION_KEYS", "models.internvl.configuration_internvl.InternVLVisionConfig"),
    ("llava_next", "CONFIG_KEYS", "models.llava_next.configuration_llava_next.LlavaNextConfig"),
    ("llava_next", "TEXT_KEYS", "models.llama.configuration_llama.LlamaConfig"),
    ("clip", "CLIP_VISION_KEYS", "models.clip.configuration_clip.CLIPVisionConfig"),
]


@pytest.mark.parametrize("module, audit, config_class", VL_AUDITS, ids=[f"{m}.{a}:{c.rsplit('.', 1)[1]}" for m, a, c in VL_AUDITS])
def test_vision_language_audits_cover_transformers(module, audit, config_class):
    """Every key transformers' config class saves is in the audit (honored, ignored with why, or refused), and the
    torch and JAX audits are the same lists."""
    mod_path, cls_name = config_class.rsplit(".", 1)
    cls = getattr(importlib.import_module(f"transformers.{mod_path}"), cls_name)
    t, j = (getattr(_module(side, module), audit) for side in ("torch", "jax"))
    assert (t.family, set(t.honored), dict(t.ignored)) == (j.family, set(j.honored), dict(j.ignored))
    assert {k: (tuple(map(repr, a)), w) for k, (a, w) in t.refused.items()} == \
        {k: (tuple(map(repr, a)), w) for k, (a, w) in j.refused.items()}
    assert set(cls().to_dict()) - t.keys == set(), f"{audit}: keys neither honored, ignored nor refused"
    for key, why in t.ignored.items():
        assert why.strip(), f"{audit}: {key} ignored without a reason"
