"""StarCoder2: torch reference vs transformers, JAX oracle vs torch, conversion, LoRA targets.

The tiny checkpoint has biased LayerNorms and projections, GQA 4/2, the gelu_pytorch_tanh MLP, a tied
head and sliding_window 16: the 33-token batches run past the window.
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

from conversion import starcoder2 as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import starcoder2 as jm  # noqa: E402
from jax_oracles.training import lora as jlora  # noqa: E402
from torch_sources.models import starcoder2 as tm  # noqa: E402
from torch_sources.training import lora as tlora  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets" / "checkpoints" / "starcoder2"
TORCH_TOL, JAX_TOL = 1e-5, 2e-5  # max abs logit diff: torch vs transformers, JAX vs torch
# (batch, seq, real lengths): unpadded, right padding, ragged right padding
SHAPES = [(1, 7, (7,)), (2, 16, (16, 11)), (3, 33, (33, 20, 5))]


def load_generator():
    # tools/ is not a package: load the generator by path, so plain `pytest` works too.
    spec = importlib.util.spec_from_file_location("checkpoints_starcoder2", ROOT / "tools" / "checkpoints_starcoder2.py")
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
    return np.where(real, ids, 400).astype(np.int32), mask, pos


def max_diff(a, b, mask):  # over the real (unpadded) positions only
    m = np.asarray(mask) == 1
    return float(np.abs(np.asarray(a)[m] - np.asarray(b)[m]).max())


@pytest.fixture(scope="module")
def torch_model():
    return tm.Starcoder2ForCausalLM.from_pretrained(CKPT)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    return transformers.Starcoder2ForCausalLM.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def jax_model():
    return jm.Starcoder2ForCausalLM(conv.load_config(CKPT)), conv.load_params(CKPT)


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
    load_generator().make_starcoder2(tmp_path)
    names = sorted(p.name for p in CKPT.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    for name in names:
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name


def test_transformers_loads_every_tensor_and_no_other(hf_model):
    transformers = pytest.importorskip("transformers")
    _, info = transformers.Starcoder2ForCausalLM.from_pretrained(CKPT, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = safetensors_io.load_state_dict(CKPT)
    assert "lm_head.weight" not in state and hf_model.config.tie_word_embeddings  # tied, as starcoder2-3b
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    for name, w in state.items():
        if "norm" in name and name.endswith("weight"):
            assert np.abs(w - 1.0).max() > 0.05, name  # a dropped norm weight must show
        elif name.endswith("bias"):
            assert np.abs(w).max() > 0.01, name  # so must a dropped bias


def test_config(torch_model):
    c = torch_model.config
    assert (c.head_dim, c.sliding_window, c.norm_eps, c.use_bias, c.tie_word_embeddings) == (16, 16, 1e-5, True, True)
    d = json.loads((CKPT / "config.json").read_text())  # token ids: bookkeeping (models/config_keys.py)
    assert (d["bos_token_id"], d["eos_token_id"], c.hidden_act) == (400, 400, "gelu_pytorch_tanh")
    assert jm.Starcoder2Config.from_pretrained(CKPT) == conv.load_config(CKPT)


def test_reads_checkpoint_saved_by_transformers(hf_model, torch_model, tmp_path):
    hf_model.save_pretrained(tmp_path)  # transformers 5 writes `rope_parameters`, not rope_theta
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    assert tm.Starcoder2Config.from_pretrained(tmp_path) == torch_model.config
    assert conv.load_config(tmp_path) == conv.load_config(CKPT)


# ---- operators -------------------------------------------------------------------------------

def test_rope_inv_freq_matches_transformers(torch_model, hf_model):
    inv = tm.rope_inv_freq(torch_model.config)
    assert inv.shape == (8,) and torch.equal(inv, hf_model.model.rotary_emb.inv_freq)
    np.testing.assert_allclose(np.asarray(jm.rope_inv_freq(torch_model.config)), inv.numpy(), rtol=1e-6)


def test_sliding_window_mask():
    """Window 16: query t sees keys t-15..t (HF: kv > q - window), and never a padded key."""
    T = 20
    mask = np.ones((2, T), np.int32)
    mask[1, 18:] = 0
    want = (np.arange(T)[None] <= np.arange(T)[:, None]) & (np.arange(T)[:, None] - np.arange(T)[None] < 16)
    for got in (tm.causal_mask(torch.tensor(mask), 16).numpy(), np.asarray(jm.causal_mask(jnp.asarray(mask), 16))):
        np.testing.assert_array_equal(got[0], want)
        np.testing.assert_array_equal(got[1], want & (np.arange(T)[None] < 18))
        assert got[0, 19, 4] and not got[0, 19, 3]


def test_layer_norm_uses_weight_and_bias():
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((3, 64), (64,), (64,)))
    want = torch.nn.functional.layer_norm(torch.tensor(x), (64,), torch.tensor(w), torch.tensor(b), 1e-5).numpy()
    np.testing.assert_allclose(tm.layer_norm(torch.tensor(x), torch.tensor(w), torch.tensor(b), 1e-5).numpy(), want)
    np.testing.assert_allclose(np.asarray(jm.layer_norm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), 1e-5)), want,
                               atol=2e-6)


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
    ours = (jm.Starcoder2MLP(c).apply({"params": p0["mlp"]}, jnp.asarray(x)),
            jm.Starcoder2Attention(c).apply({"params": p0["self_attn"]}, jnp.asarray(x), jin),
            jm.Starcoder2DecoderLayer(c).apply({"params": p0}, jnp.asarray(x), jin))
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
    missing = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.o_proj.bias"}
    with pytest.raises(ValueError, match=r"never written \['model/layers_1/self_attn/o_proj/bias'\]"):
        conv.convert_state_dict(missing, config)
    extra = {**state, "model.layers.0.self_attn.qkv_proj.weight": np.zeros((128, 64), np.float32)}
    with pytest.raises(ValueError, match=r"unused source tensors \['model.layers.0.self_attn.qkv_proj.weight'\]"):
        conv.convert_state_dict(extra, config)


# ---- LoRA ------------------------------------------------------------------------------------

def test_lora_targets_are_every_decoder_linear(hf_model, jax_model):
    want = sorted((f"{tlora.PEFT_PREFIX}{name}", m.in_features, m.out_features)
                  for name, m in hf_model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head")
    specs = tlora.lora_target_specs(tm.Starcoder2ForCausalLM.from_pretrained(CKPT), tlora.LoraConfig())
    assert sorted(specs) == want and len(want) == 2 * 6
    assert jlora.lora_target_specs(jax_model[1], jlora.LoraConfig()) == specs


def test_lora_adapter_matches_torch(jax_model):
    model = tm.Starcoder2ForCausalLM.from_pretrained(CKPT)
    names = tlora.inject_lora(model, tlora.LoraConfig(), seed=0)
    rng = np.random.default_rng(7)
    weights = {n: rng.standard_normal(p.shape).astype(np.float32) * 0.05
               for n, p in tlora._lora_params(model).items()}
    assert sorted(weights) == sorted(names)
    tlora.load_lora_state_dict(model, weights)
    ids, mask, _ = batch(SHAPES[2], seed=4)
    ref = torch_logits(model, ids, mask)
    assert max_diff(ref, torch_logits(tm.Starcoder2ForCausalLM.from_pretrained(CKPT), ids, mask), mask) > 1e-2
    lora = jlora.lora_tree_from_state_dict(tlora.lora_state_dict(model))
    d = max_diff(jax_logits(jax_model, ids, mask, lora=lora), ref, mask)
    print(f"jax vs torch with LoRA: max abs diff {d:.3g}")
    assert d <= JAX_TOL


# ---- torch-free JAX side ---------------------------------------------------------------------

def test_jax_side_imports_without_torch():
    code = ("import sys\n"
            "for m in ('torch', 'transformers', 'torch_sources'): sys.modules[m] = None\n"
            "import conversion.starcoder2, jax_oracles.models.starcoder2\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
