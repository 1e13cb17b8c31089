"""Phi-4 (model_type "phi3"): torch reference vs transformers, JAX oracle vs torch, conversion, LoRA targets.

The tiny checkpoint turns on partial rotary (factor 0.75: rotary dim 12 of head_dim 16) with the default
RoPE, GQA 4/2, the fused qkv_proj and gate_up_proj, and an untied head.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")

from conversion import phi4 as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import phi4 as jm  # noqa: E402
from jax_oracles.training import lora as jlora  # noqa: E402
from torch_sources.models import phi4 as tm  # noqa: E402
from torch_sources.training import lora as tlora  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets" / "checkpoints" / "phi4"
TORCH_TOL, JAX_TOL = 1e-5, 2e-5  # max abs logit diff: torch vs transformers, JAX vs torch
# (batch, seq, real lengths): unpadded, right padding, ragged right padding
SHAPES = [(1, 7, (7,)), (2, 16, (16, 11)), (3, 33, (33, 20, 5))]


def load_generator():
    # tools/ is not a package: load the generator by path, so plain `pytest` works too.
    spec = importlib.util.spec_from_file_location("checkpoints_phi4", ROOT / "tools" / "checkpoints_phi4.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def batch(shape, seed=0, left=False):
    """Token ids (bos first), the attention mask and HF's positions (mask cumsum - 1, 0 on pads)."""
    B, T, lengths = shape
    ids = np.random.default_rng(seed).integers(0, 400, size=(B, T))
    real = np.arange(T)[None] < np.array(lengths)[:, None]
    if left:
        real = real[:, ::-1]
    mask = real.astype(np.int32)
    ids[np.arange(B), real.argmax(1)] = 400  # <|endoftext|> as bos on each row's first real token
    pos = np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32)
    return np.where(real, ids, 404).astype(np.int32), mask, pos


def max_diff(a, b, mask):  # over the real (unpadded) positions only
    m = np.asarray(mask) == 1
    return float(np.abs(np.asarray(a)[m] - np.asarray(b)[m]).max())


@pytest.fixture(scope="module")
def torch_model():
    return tm.Phi3ForCausalLM.from_pretrained(CKPT)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    return transformers.Phi3ForCausalLM.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def jax_model():
    return jm.Phi3ForCausalLM(conv.load_config(CKPT)), conv.load_params(CKPT)


def torch_logits(model, ids, mask, pos=None):
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(mask), None if pos is None else torch.tensor(pos)).numpy()


_apply = jax.jit(lambda model, variables, ids, mask, pos: model.apply(variables, ids, mask, pos), static_argnums=0)


def jax_logits(jax_model, ids, mask, pos=None, lora=None):
    model, params = jax_model
    variables = {"params": params} if lora is None else {"params": params, "lora": lora}
    return np.asarray(_apply(model, variables, jnp.asarray(ids), jnp.asarray(mask),
                             None if pos is None else jnp.asarray(pos)))


# ---- checkpoint assets -----------------------------------------------------------------------

def test_checkpoint_regenerates_byte_identical(tmp_path):
    load_generator().make_phi4(tmp_path)
    names = sorted(p.name for p in CKPT.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    for name in names:
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name


def test_transformers_loads_every_tensor_and_no_other(hf_model):
    transformers = pytest.importorskip("transformers")
    _, info = transformers.Phi3ForCausalLM.from_pretrained(CKPT, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = safetensors_io.load_state_dict(CKPT)
    assert state["model.layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert state["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 128, 64)
    assert "lm_head.weight" in state and not hf_model.config.tie_word_embeddings
    for name, w in state.items():
        if "norm" in name:
            assert np.abs(w - 1.0).max() > 0.05, name  # a dropped norm weight must show


def test_config(torch_model):
    c = torch_model.config
    assert (c.head_dim, c.rotary_dim, c.sliding_window, c.norm_eps) == (16, 12, None, 1e-5)
    d = json.loads((CKPT / "config.json").read_text())  # token ids: bookkeeping (models/config_keys.py)
    assert (d["bos_token_id"], d["eos_token_id"], d["pad_token_id"]) == (400, 402, 404)
    assert jm.Phi3Config.from_pretrained(CKPT) == conv.load_config(CKPT)
    with pytest.raises(ValueError, match="longrope.*long_factor"):  # a longrope block needs both factor lists
        tm.Phi3Config.from_hf({**json.loads((CKPT / "config.json").read_text()),
                               "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 6}})


def test_reads_checkpoint_saved_by_transformers(hf_model, torch_model, tmp_path):
    hf_model.save_pretrained(tmp_path)  # transformers 5 writes `rope_parameters` (with partial_rotary_factor)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    assert tm.Phi3Config.from_pretrained(tmp_path) == torch_model.config
    assert conv.load_config(tmp_path) == conv.load_config(CKPT)


# ---- operators -------------------------------------------------------------------------------

def test_partial_rope_matches_transformers(torch_model, hf_model):
    from transformers.models.phi3 import modeling_phi3

    c = torch_model.config
    inv = tm.rope_inv_freq(c)
    assert inv.shape == (6,) and torch.equal(inv, hf_model.model.rotary_emb.inv_freq)
    np.testing.assert_allclose(np.asarray(jm.rope_inv_freq(c)), inv.numpy(), rtol=1e-6)
    pos = np.array([[0, 1, 2, 3, 4], [7, 30, 63, 128, 255]], np.int32)
    tcos, tsin = tm.rope_cos_sin(inv, torch.tensor(pos))
    x = np.random.default_rng(1).standard_normal((2, 5, 4, 16)).astype(np.float32)
    ours = tm.apply_rope(torch.tensor(x), tcos, tsin)
    ref, _ = modeling_phi3.apply_rotary_pos_emb(torch.tensor(x).transpose(1, 2), torch.tensor(x).transpose(1, 2),
                                                tcos, tsin)
    np.testing.assert_array_equal(ours.numpy(), ref.transpose(1, 2).numpy())
    np.testing.assert_array_equal(ours.numpy()[..., 12:], x[..., 12:])  # the tail channels pass through
    jcos, jsin = jm.rope_cos_sin(jm.rope_inv_freq(c), jnp.asarray(pos))
    np.testing.assert_allclose(np.asarray(jm.apply_rope(jnp.asarray(x), jcos, jsin)), ours.numpy(), atol=1e-5)


def test_split_qkv_is_q_k_v_blocks(torch_model):
    c = torch_model.config
    fused = np.arange(2 * 3 * 128, dtype=np.float32).reshape(2, 3, 128)
    for q, k, v in (tm.split_qkv(c, torch.tensor(fused)), jm.split_qkv(c, jnp.asarray(fused))):
        q, k, v = (np.asarray(a) for a in (q, k, v))
        assert q.shape == (2, 3, 4, 16) and k.shape == v.shape == (2, 3, 2, 16)
        np.testing.assert_array_equal(q.reshape(2, 3, 64), fused[..., :64])
        np.testing.assert_array_equal(k.reshape(2, 3, 32), fused[..., 64:96])
        np.testing.assert_array_equal(v.reshape(2, 3, 32), fused[..., 96:])


def _layer0(jax_model):
    return jax_model[1]["model"]["layers_0"]


def test_blocks_match_torch(torch_model, jax_model):
    """Layer 0's MLP, attention and whole decoder layer, JAX vs torch, on random hidden states."""
    c = jax_model[0].config
    _, mask, pos = batch((2, 9, (9, 6)))
    x = np.random.default_rng(2).standard_normal((2, 9, 64)).astype(np.float32)
    tlayer, p0 = torch_model.model.layers[0], _layer0(jax_model)
    tin = tm.layer_inputs(torch_model.config, torch.tensor(mask), torch.tensor(pos))
    jin = jm.layer_inputs(c, jnp.asarray(mask), jnp.asarray(pos))
    with torch.no_grad():
        refs = (tlayer.mlp(torch.tensor(x)), tlayer.self_attn(torch.tensor(x), tin), tlayer(torch.tensor(x), tin))
    ours = (jm.Phi3MLP(c).apply({"params": p0["mlp"]}, jnp.asarray(x)),
            jm.Phi3Attention(c).apply({"params": p0["self_attn"]}, jnp.asarray(x), jin),
            jm.Phi3DecoderLayer(c).apply({"params": p0}, jnp.asarray(x), jin))
    for name, o, r in zip(("mlp", "attention", "decoder layer"), ours, refs):
        assert max_diff(o, r.numpy(), mask) <= JAX_TOL, name


# ---- full model ------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}T{s[1]}")
def test_torch_matches_transformers(torch_model, hf_model, shape):
    ids, mask, _ = batch(shape)
    ours = torch_logits(torch_model, ids, mask)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    d = max_diff(ours, ref, mask)
    print(f"torch vs transformers {shape[:2]}: max abs diff {d:.3g}")
    assert d <= TORCH_TOL


def test_torch_matches_transformers_left_padded(torch_model, hf_model):
    ids, mask, pos = batch(SHAPES[2], seed=3, left=True)
    ours = torch_logits(torch_model, ids, mask, pos)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                       position_ids=torch.tensor(pos, dtype=torch.long)).logits.numpy()
    d = max_diff(ours, ref, mask)
    print(f"torch vs transformers, left-padded: max abs diff {d:.3g}")
    assert d <= TORCH_TOL


@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}T{s[1]}")
def test_jax_matches_torch(torch_model, jax_model, shape, left):
    ids, mask, pos = batch(shape, seed=1, left=left)
    pos = pos if left else None
    d = max_diff(jax_logits(jax_model, ids, mask, pos), torch_logits(torch_model, ids, mask, pos), mask)
    print(f"jax vs torch {shape[:2]} {'left' if left else 'right'}: max abs diff {d:.3g}")
    assert d <= JAX_TOL


# ---- conversion ------------------------------------------------------------------------------

def test_hf_layout_is_the_checkpoint(jax_model):
    state = safetensors_io.load_state_dict(CKPT)
    assert conv.hf_layout(jax_model[1]) == {k: tuple(v.shape) for k, v in state.items()}


def test_conversion_refuses_missing_or_extra_tensors():
    config, state = conv.load_config(CKPT), safetensors_io.load_state_dict(CKPT)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.gate_up_proj.weight"}
    with pytest.raises(ValueError, match=r"never written \['model/layers_1/mlp/gate_up_proj/kernel'\]"):
        conv.convert_state_dict(missing, config)
    extra = {**state, "model.layers.0.self_attn.q_proj.weight": np.zeros((64, 64), np.float32)}
    with pytest.raises(ValueError, match=r"unused source tensors \['model.layers.0.self_attn.q_proj.weight'\]"):
        conv.convert_state_dict(extra, config)


# ---- LoRA ------------------------------------------------------------------------------------

def test_lora_targets_are_every_decoder_linear(hf_model, jax_model):
    want = sorted((f"{tlora.PEFT_PREFIX}{name}", m.in_features, m.out_features)
                  for name, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head")
    specs = tlora.lora_target_specs(tm.Phi3ForCausalLM.from_pretrained(CKPT), tlora.LoraConfig())
    assert sorted(specs) == want and len(want) == 2 * 4
    assert jlora.lora_target_specs(jax_model[1], jlora.LoraConfig()) == specs


def test_lora_adapter_matches_torch(jax_model):
    model = tm.Phi3ForCausalLM.from_pretrained(CKPT)
    names = tlora.inject_lora(model, tlora.LoraConfig(), seed=0)
    rng = np.random.default_rng(7)
    weights = {n: rng.standard_normal(p.shape).astype(np.float32) * 0.05
               for n, p in tlora._lora_params(model).items()}
    assert sorted(weights) == sorted(names)
    tlora.load_lora_state_dict(model, weights)
    ids, mask, _ = batch(SHAPES[2], seed=4)
    ref = torch_logits(model, ids, mask)
    assert max_diff(ref, torch_logits(tm.Phi3ForCausalLM.from_pretrained(CKPT), ids, mask), mask) > 1e-2
    lora = jlora.lora_tree_from_state_dict(tlora.lora_state_dict(model))
    d = max_diff(jax_logits(jax_model, ids, mask, lora=lora), ref, mask)
    print(f"jax vs torch with LoRA: max abs diff {d:.3g}")
    assert d <= JAX_TOL


# ---- torch-free JAX side ---------------------------------------------------------------------

def test_jax_side_imports_without_torch():
    code = ("import sys\n"
            "for m in ('torch', 'transformers', 'torch_sources'): sys.modules[m] = None\n"
            "import conversion.phi4, jax_oracles.models.phi4\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
