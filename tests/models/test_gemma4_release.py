"""Gemma 4 as released: the multimodal checkpoint layout (Gemma4ForConditionalGeneration, config.json
`model_type` "gemma4" with `text_config`, language weights under `model.language_model.*`, a vision tower
beside), the release's `global_head_dim` / `num_global_key_value_heads` keys, no per-layer inputs, K = V on
full layers. The torch source, the torch-free conversion + JAX oracle, and both serving runners against
transformers' Gemma4ForConditionalGeneration logits; config keys the sources cannot honour are refused."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")

from conversion import gemma4 as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import gemma4 as jm  # noqa: E402
from torch_sources.models import gemma4 as tm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets" / "checkpoints" / "gemma4-release"
TEXT_CKPT = ROOT / "assets" / "checkpoints" / "gemma4"
ATOL = 1e-5  # max |logit diff| for the torch source (it is 0 against transformers)
# XLA's f32 tanh / GELU / dot differ from torch's by an ulp or so; over 4 layers the drift reaches 1.3e-5 here
# (1.5e-5 on the text-only gemma4 checkpoint, same shapes), so the JAX side gets 2e-5.
JAX_ATOL = 2e-5
# (batch, seq, real lengths), right padding; sliding_window is 8, so most rows run past it.
SHAPES = [(1, 6, (6,)), (3, 19, (19, 11, 4))]


def load_generator():
    spec = importlib.util.spec_from_file_location("checkpoints_gemma4", ROOT / "tools" / "checkpoints_gemma4.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def batch(shape, seed=0):
    B, T, lengths = shape
    ids = np.random.default_rng(seed).integers(3, 512, size=(B, T))
    ids[:, 0] = 2  # <bos>
    mask = (np.arange(T)[None] < np.array(lengths)[:, None]).astype(np.int32)
    return np.where(mask == 1, ids, 0).astype(np.int32), mask


def valid(x, mask):  # the real (unpadded) positions, flattened: [n, V]
    return np.asarray(x)[np.asarray(mask) == 1]


def max_diff(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


@pytest.fixture(scope="module")
def torch_model():
    return tm.Gemma4ForCausalLM.from_pretrained(CKPT)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(CKPT, attn_implementation="eager",
                                                                        dtype=torch.float32).eval()
    for p in model.parameters():  # from_pretrained leaves params unaligned: another BLAS path (hf-tiny-models.md)
        p.data = p.data.clone()
    return model


@pytest.fixture(scope="module")
def jax_model():
    return jm.Gemma4ForCausalLM(conv.load_config(CKPT)), conv.load_params(CKPT)


def hf_logits(hf_model, ids, mask):
    with torch.no_grad():
        return hf_model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()


def torch_logits(model, ids, mask):
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(mask)).numpy()


# ---- the checkpoint --------------------------------------------------------------------------

def test_checkpoint_regenerates_byte_identical(tmp_path):
    load_generator().make_gemma4_release(tmp_path)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name


def test_transformers_loads_every_tensor_and_no_other():
    transformers = pytest.importorskip("transformers")
    _, info = transformers.Gemma4ForConditionalGeneration.from_pretrained(CKPT, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_config_resolves_like_transformers_in_both_key_forms(tmp_path):
    """The release's global_* keys and the per_layer_config that transformers 5.24 saves instead give one config,
    and the per-layer head shapes transformers builds."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.from_pretrained(CKPT)
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "per_layer_config" in saved["text_config"] and "global_head_dim" not in saved["text_config"]
    for mod in (tm, jm):
        ours = mod.Gemma4TextConfig.from_hf(json.loads((CKPT / "config.json").read_text()))
        assert mod.Gemma4TextConfig.from_hf(saved) == ours
        assert mod.Gemma4TextConfig.from_hf(saved["text_config"]) == ours
        layers = hf.text_config.per_layer_config
        assert [(ours.layer_head_dim(i), ours.layer_num_kv_heads(i)) for i in range(4)] == \
               [(layers[i].head_dim, layers[i].num_key_value_heads) for i in range(4)] == [(16, 2), (32, 1)] * 2
    assert ours.hidden_size_per_layer_input == 0 and ours.attention_k_eq_v and ours.num_kv_shared_layers == 0


def test_towers_are_skipped_by_name():
    state = safetensors_io.load_state_dict(CKPT)
    assert any(k.startswith("model.vision_tower.") for k in state) and any(k.startswith("model.embed_vision.")
                                                                           for k in state)
    audio = {"model.audio_tower.output_proj.weight": np.zeros((2, 2), np.float32),
             "model.embed_audio.embedding_projection.weight": np.zeros((2, 2), np.float32)}
    config = tm.Gemma4TextConfig.from_pretrained(CKPT)
    kept = tm.text_state_dict(config, state | audio)
    assert sorted(kept) == sorted("model." + k[len("model.language_model."):] for k in state
                                  if k.startswith("model.language_model."))
    assert sorted(conv._text_state(state | audio)) == sorted(kept)
    for mod, fn in ((tm, lambda s: tm.text_state_dict(config, s)), (conv, conv._text_state)):
        with pytest.raises(ValueError, match="belongs to no known part"):
            fn(state | {"multi_modal_projector.weight": np.zeros(1, np.float32)})


def test_hf_layout_names_the_release_tensors(jax_model):
    state = safetensors_io.load_state_dict(CKPT)
    assert conv.hf_layout(jax_model[1], release=True) == {k: v.shape for k, v in state.items()
                                                          if k.startswith("model.language_model.")}


def test_no_ple_and_k_eq_v_modules(torch_model):
    m = torch_model.model
    assert not hasattr(m, "embed_tokens_per_layer") and not hasattr(m.layers[0], "per_layer_input_gate")
    assert hasattr(m.layers[0].self_attn, "v_proj") and not hasattr(m.layers[1].self_attn, "v_proj")
    assert m.layers[1].self_attn.k_proj.weight.shape == (1 * 32, 64)


# ---- logits against transformers -------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
def test_torch_matches_transformers(torch_model, hf_model, shape):
    ids, mask = batch(shape)
    ours, ref = torch_logits(torch_model, ids, mask), hf_logits(hf_model, ids, mask)
    d = max_diff(valid(ours, mask), valid(ref, mask))
    print(f"{shape}: max |torch - transformers| = {d:.3g}")
    assert d <= ATOL


@pytest.mark.parametrize("shape", SHAPES)
def test_jax_matches_torch(torch_model, jax_model, shape):
    model, params = jax_model
    ids, mask = batch(shape, seed=1)
    ours = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids), jnp.asarray(mask)))
    ref = valid(torch_logits(torch_model, ids, mask), mask)
    print(f"{shape}: max |jax - torch| = {max_diff(valid(ours, mask), ref):.3g}")
    np.testing.assert_allclose(valid(ours, mask), ref, rtol=0, atol=JAX_ATOL)


def test_text_only_checkpoint_unchanged_by_release_support():
    """The gemma4_text checkpoint still loads the same modules (PLE, v_proj everywhere)."""
    m = tm.Gemma4ForCausalLM.from_pretrained(TEXT_CKPT).model
    assert hasattr(m, "embed_tokens_per_layer") and hasattr(m.layers[1].self_attn, "v_proj")


@pytest.mark.parametrize("side", ["torch", "jax"])
def test_serving_prefill_matches_transformers(hf_model, side):
    if side == "torch":
        from torch_sources.serving.config import EngineConfig
        from torch_sources.serving.model_runner import ModelRunner
    else:
        from serving_engine.config import EngineConfig
        from serving_engine.model_runner import ModelRunner
    runner = ModelRunner(str(CKPT), EngineConfig(block_size=4, num_blocks=32, max_model_len=64,
                                                 max_num_batched_tokens=64))
    ids, mask = batch((1, 21, (21,)), seed=3)
    ours, ref = np.asarray(runner.prefill_logits(ids[0].tolist())), hf_logits(hf_model, ids, mask)[0]
    print(f"{side} serving prefill: max |paged - transformers| = {max_diff(ours, ref):.3g}")
    np.testing.assert_allclose(ours, ref, rtol=0, atol=ATOL if side == "torch" else JAX_ATOL)


# ---- what the sources refuse -----------------------------------------------------------------

def _release_config() -> dict:
    return json.loads((CKPT / "config.json").read_text())


def _with_text(**kw) -> dict:
    d = _release_config()
    d["text_config"].update(kw)
    return d


REFUSED = [
    ("unknown text key", _with_text(query_pre_attn_scalar=256), "unknown key"),
    ("unknown top-level key", _release_config() | {"mm_tokens_per_image": 256}, "unknown key"),
    ("MoE block", _with_text(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
     "enable_moe_block"),
    ("bidirectional", _with_text(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    ("activation", _with_text(hidden_activation="silu"), "hidden_activation"),
    ("dropout", _with_text(attention_dropout=0.1), "attention_dropout"),
    ("rope type", _with_text(rope_parameters={"sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                                              "full_attention": {"rope_type": "default", "rope_theta": 1e6}}),
     "rope_parameters"),
    ("per-layer override", _with_text(per_layer_config={"1": {"head_dim": 32, "intermediate_size": 64}}),
     "per_layer_config"),
    ("tie mismatch", _release_config() | {"tie_word_embeddings": False}, "tie_word_embeddings"),
    ("other model", {"model_type": "gemma3_text", "hidden_size": 64}, "model_type"),
]


@pytest.mark.parametrize("mod", [tm, jm], ids=["torch", "jax"])
@pytest.mark.parametrize("name,config,match", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_config_is_refused(mod, name, config, match):
    with pytest.raises(ValueError, match=match):
        mod.Gemma4TextConfig.from_hf(copy.deepcopy(config))


def test_checkpoint_with_unknown_key_is_refused_by_every_loader(tmp_path):
    shutil.copy(CKPT / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(_with_text(attn_logit_softcapping=50.0)))
    for load in (tm.Gemma4ForCausalLM.from_pretrained, conv.load_config):
        with pytest.raises(ValueError, match=r"unknown key\(s\) \['attn_logit_softcapping'\]"):
            load(tmp_path)


def test_num_global_kv_heads_needs_k_eq_v_as_in_transformers():
    """transformers applies num_global_key_value_heads only with attention_k_eq_v; so do the sources."""
    transformers = pytest.importorskip("transformers")
    text = _release_config()["text_config"] | {"attention_k_eq_v": False}
    hf = transformers.Gemma4TextConfig(**{k: v for k, v in text.items() if k != "model_type"})
    for mod in (tm, jm):
        c = mod.Gemma4TextConfig.from_hf(text)
        assert [(c.layer_head_dim(i), c.layer_num_kv_heads(i)) for i in range(4)] == \
               [(hf.per_layer_config[i].head_dim, hf.per_layer_config[i].num_key_value_heads) for i in range(4)] == \
               [(16, 2), (32, 2)] * 2
