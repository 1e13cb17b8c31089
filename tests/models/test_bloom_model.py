"""BLOOM: checkpoint assets, torch reference vs transformers, JAX oracle vs torch, conversion, LoRA targets."""

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
import yaml

jax.config.update("jax_default_matmul_precision", "highest")

from conversion import bloom as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import bloom as jm  # noqa: E402
from jax_oracles.training import lora as jlora  # noqa: E402
from torch_sources.models import bloom as tm  # noqa: E402
from torch_sources.training import lora as tlora  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets" / "checkpoints" / "bloom"
BOS, PAD = 401, 403
TORCH_TOL, JAX_TOL = 1e-5, 2e-5  # max abs logit diff on the real positions
# (name, batch, seq, real lengths, left padding)
BATCHES = [("unpadded", 2, 9, (9, 9), False), ("right", 3, 40, (40, 13, 29), False),
           ("left", 3, 40, (40, 13, 29), True)]
RELEASE_KEYS = {  # bigscience/bloom-560m config.json, minus _name_or_path and transformers_version
    "apply_residual_connection_post_layernorm", "architectures", "attention_dropout", "attention_softmax_in_fp32",
    "bias_dropout_fusion", "bos_token_id", "eos_token_id", "hidden_dropout", "hidden_size", "initializer_range",
    "layer_norm_epsilon", "masked_softmax_fusion", "model_type", "n_head", "n_inner", "n_layer", "offset_alibi",
    "pad_token_id", "pretraining_tp", "skip_bias_add", "skip_bias_add_qkv", "slow_but_exact", "unk_token_id",
    "use_cache", "vocab_size"}


def load_generator():
    # tools/ is not a package: load the generator by path, so plain `pytest` works too.
    spec = importlib.util.spec_from_file_location("checkpoints_bloom", ROOT / "tools" / "checkpoints_bloom.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def batch(spec, seed=0):
    """(ids, mask, HF positions = mask cumsum - 1) int32; pads at the right or, for generation, the left."""
    _, B, T, lengths, left = spec
    ids = np.random.default_rng(seed).integers(0, 400, size=(B, T))
    lengths = np.array(lengths)[:, None]
    mask = (np.arange(T)[None] >= T - lengths) if left else (np.arange(T)[None] < lengths)
    mask = mask.astype(np.int32)
    ids[np.arange(B), np.argmax(mask, axis=1)] = BOS
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return np.where(mask == 1, ids, PAD).astype(np.int32), mask, positions


def valid(x, mask):  # the real (unpadded) positions, flattened: [n, V]
    return np.asarray(x)[np.asarray(mask) == 1]


def max_diff(a, b, mask) -> float:
    return float(np.abs(valid(a, mask) - valid(b, mask)).max())


@pytest.fixture(scope="module")
def torch_model():
    return tm.BloomForCausalLM.from_pretrained(CKPT)


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    return transformers.BloomForCausalLM.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def jax_model():
    return jm.BloomForCausalLM(conv.load_config(CKPT)), conv.load_params(CKPT)


def torch_logits(model, ids, mask, positions=None):
    with torch.no_grad():
        pos = None if positions is None else torch.tensor(positions)
        return model(torch.tensor(ids), torch.tensor(mask), pos).numpy()


_apply = jax.jit(lambda model, variables, ids, mask, pos: model.apply(variables, ids, mask, pos), static_argnums=0)


def jax_logits(jax_model, ids, mask, positions=None, lora=None):
    model, params = jax_model
    variables = {"params": params} if lora is None else {"params": params, "lora": lora}
    pos = None if positions is None else jnp.asarray(positions)
    return np.asarray(_apply(model, variables, jnp.asarray(ids), jnp.asarray(mask), pos))


# ---- checkpoint assets -----------------------------------------------------------------------

def test_checkpoint_regenerates_byte_identical(tmp_path):
    out = load_generator().make_bloom(tmp_path / "bloom")
    names = sorted(p.name for p in CKPT.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (CKPT / name).read_bytes(), name


def test_config_has_the_release_keys_and_special_ids():
    config = json.loads((CKPT / "config.json").read_text())
    assert set(config) == RELEASE_KEYS
    assert (config["n_head"], config["hidden_size"] // config["n_head"], config["n_layer"]) == (6, 16, 2)
    assert [config[k] for k in ("unk_token_id", "bos_token_id", "eos_token_id", "pad_token_id")] == [400, 401, 402, 403]
    generation = json.loads((CKPT / "generation_config.json").read_text())
    assert [generation[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [401, 402, 403]


def test_transformers_loads_every_tensor_and_no_other():
    transformers = pytest.importorskip("transformers")
    _, info = transformers.BloomForCausalLM.from_pretrained(CKPT, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = safetensors_io.load_state_dict(CKPT)
    assert "lm_head.weight" not in state and all(k.startswith("transformer.") for k in state)
    assert state["transformer.h.0.self_attention.query_key_value.weight"].shape == (288, 96)
    for name, w in state.items():  # norms and biases far enough from identity / zero that dropping one shows
        if "layernorm" in name or "ln_f" in name:
            assert np.abs(w - (1.0 if name.endswith("weight") else 0.0)).max() > 0.05, name
        elif name.endswith("bias"):
            assert np.abs(w).max() > 0.01, name


def test_family_yaml():
    fam = yaml.safe_load((ROOT / "configs" / "family" / "bloom.yaml").read_text())
    assert (fam["model_prefix"], fam["layers"], fam["attention"], fam["template"]) == (
        "Bloom", "transformer.h", "self_attention", "default")
    assert set(fam["features"]) == {"norm:layer", "pos:alibi", "qkv:fused", "mlp:plain", "attn:qkv_bias",
                                    "embed:layernorm", "data:train_on_prompt"}


# ---- config and operators --------------------------------------------------------------------

def test_config_neutral_names():
    for mod in (tm, jm):
        c = mod.BloomConfig.from_pretrained(CKPT)
        assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.num_hidden_layers) == (6, 6, 16, 2)
        assert (c.hidden_size, c.intermediate_size, c.vocab_size, c.norm_eps) == (96, 384, 512, 1e-5)
        assert c.tie_word_embeddings and hash(c) == hash(mod.BloomConfig.from_pretrained(CKPT))


@pytest.mark.parametrize("heads", [6, 8, 12, 16, 5])
def test_alibi_slopes_match_transformers(heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    ref = _get_alibi_slopes(heads, torch.device("cpu"))
    assert torch.equal(tm.alibi_slopes(heads), ref)
    np.testing.assert_allclose(np.asarray(jm.alibi_slopes(heads)), ref.numpy(), rtol=1e-6)


def test_alibi_extra_slopes_and_bias():
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    # 6 heads: b = 2^-2 for the first 4 (0.25 .. 0.25^4), then the odd powers of 8 heads' base 2^-1.
    np.testing.assert_allclose(tm.alibi_slopes(6).numpy(), [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 0.5, 0.125])
    _, mask, _ = batch(BATCHES[2])
    ref = build_alibi_tensor(torch.tensor(mask), 6, torch.float32).view(3, 6, 1, 40)
    ours = tm.alibi_bias(tm.alibi_slopes(6), torch.tensor(mask))
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    np.testing.assert_allclose(np.asarray(jm.alibi_bias(jm.alibi_slopes(6), jnp.asarray(mask))), ref.numpy(), rtol=1e-6)


def test_split_qkv_is_interleaved_per_head():
    c = jm.BloomConfig.from_pretrained(CKPT)
    fused = np.arange(2 * 3 * 288, dtype=np.float32).reshape(2, 3, 288)
    head = fused.reshape(2, 3, 6, 3, 16)  # per head: [q | k | v] rows
    for split in (tm.split_qkv(c, torch.tensor(fused)), jm.split_qkv(c, jnp.asarray(fused))):
        for got, j in zip(split, range(3)):
            np.testing.assert_array_equal(np.asarray(got), head[..., j, :])
    q, k, _ = tm.split_qkv(c, torch.tensor(fused))
    assert q[0, 0, 1, 0] == 48 and k[0, 0, 0, 0] == 16  # head 1's query starts after head 0's q, k, v


def test_operators_match_torch():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 96)).astype(np.float32) * 3
    w, b = rng.standard_normal(96).astype(np.float32), rng.standard_normal(96).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jm.layer_norm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), 1e-5)),
                               tm.layer_norm(torch.tensor(x), torch.tensor(w), torch.tensor(b), 1e-5).numpy(),
                               atol=1e-5)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], np.int32)
    q, k, v = (rng.standard_normal((2, 5, 6, 16)).astype(np.float32) for _ in range(3))
    tmask = tm.causal_mask(torch.tensor(mask))
    np.testing.assert_array_equal(np.asarray(jm.causal_mask(jnp.asarray(mask))), tmask.numpy())
    tbias = tm.alibi_bias(tm.alibi_slopes(6), torch.tensor(mask))
    ref = tm.eager_attention(torch.tensor(q), torch.tensor(k), torch.tensor(v), tmask, 0.25, tbias).numpy()
    ours = jm.eager_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tmask.numpy()), 0.25,
                              jnp.asarray(tbias.numpy()))
    np.testing.assert_allclose(valid(ours, mask), valid(ref, mask), atol=1e-6)


# ---- full model ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", BATCHES, ids=lambda s: s[0])
def test_torch_matches_transformers(torch_model, hf_model, spec):
    ids, mask, positions = batch(spec)
    ours = torch_logits(torch_model, ids, mask, positions if spec[4] else None)  # left: HF positions passed
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    diff = max_diff(ours, ref, mask)
    print(f"{spec[0]}: max |torch - transformers| = {diff:.3g}")
    assert diff <= TORCH_TOL


def test_left_padding_needs_no_positions(torch_model):
    """ALiBi counts positions over the real keys: a left-padded row equals the same row unpadded."""
    ids, mask, positions = batch(BATCHES[2])
    padded = torch_logits(torch_model, ids, mask, positions)
    assert np.array_equal(padded, torch_logits(torch_model, ids, mask))  # position_ids are ignored
    for row in range(ids.shape[0]):
        real = ids[row][mask[row] == 1][None]
        alone = torch_logits(torch_model, real, np.ones_like(real))
        assert np.abs(padded[row][mask[row] == 1] - alone[0]).max() <= TORCH_TOL


@pytest.mark.parametrize("spec", BATCHES, ids=lambda s: s[0])
def test_jax_matches_torch(torch_model, jax_model, spec):
    ids, mask, positions = batch(spec, seed=1)
    ours, ref = jax_logits(jax_model, ids, mask, positions), torch_logits(torch_model, ids, mask, positions)
    diff = max_diff(ours, ref, mask)
    print(f"{spec[0]}: max |jax - torch| = {diff:.3g}")
    assert diff <= JAX_TOL


def test_decoder_layer_matches_torch(torch_model, jax_model):
    config, params = jax_model[0].config, jax_model[1]
    ids, mask, positions = batch(BATCHES[2], seed=2)
    hidden = np.random.default_rng(3).standard_normal((*ids.shape, 96)).astype(np.float32)
    with torch.no_grad():
        inputs = tm.layer_inputs(torch_model.config, torch.tensor(mask), torch.tensor(positions))
        ref = torch_model.transformer.h[1](torch.tensor(hidden), inputs).numpy()
    jinputs = jm.layer_inputs(config, jnp.asarray(mask), jnp.asarray(positions))
    ours = jax.jit(jm.BloomDecoderLayer(config).apply)({"params": params["transformer"]["h_1"]},
                                                        jnp.asarray(hidden), jinputs)
    assert max_diff(ours, ref, mask) <= JAX_TOL


# ---- conversion ------------------------------------------------------------------------------

def test_hf_layout_is_the_checkpoint(jax_model):
    state = safetensors_io.load_state_dict(CKPT)
    assert conv.hf_layout(jax_model[1]) == {k: v.shape for k, v in state.items()}


def test_conversion_is_checked_both_ways():
    state = safetensors_io.load_state_dict(CKPT)
    config = conv.load_config(CKPT)
    missing = {k: v for k, v in state.items() if k != "transformer.word_embeddings_layernorm.bias"}
    with pytest.raises(ValueError, match=r"never written \['transformer/word_embeddings_layernorm/bias'\]"):
        conv.convert_state_dict(missing, config)
    extra = {**state, "transformer.h.0.self_attention.rotary_emb.inv_freq": np.ones(8, np.float32)}
    with pytest.raises(ValueError, match=r"unused source tensors \['transformer.h.0.self_attention.rotary_emb"):
        conv.convert_state_dict(extra, config)
    with pytest.raises(ValueError, match="shape mismatch"):
        conv.convert_state_dict({**state, "transformer.ln_f.bias": np.ones(32, np.float32)}, config)
    # a save that keeps the tied head's shared copy converts to the same params
    tied = conv.convert_state_dict({**state, "lm_head.weight": state["transformer.word_embeddings.weight"]}, config)
    assert jax.tree_util.tree_structure(tied) == jax.tree_util.tree_structure(conv.convert_state_dict(state, config))


# ---- LoRA targets ----------------------------------------------------------------------------

def test_lora_targets_are_peft_names(torch_model, hf_model, jax_model):
    # LF's find_all_linear_modules on the transformers model: every nn.Linear but the output head.
    want = sorted((tlora.PEFT_PREFIX + name, m.in_features, m.out_features) for name, m in hf_model.named_modules()
                  if isinstance(m, torch.nn.Linear) and name != "lm_head")
    specs = tlora.lora_target_specs(torch_model, tlora.LoraConfig())
    assert sorted(specs) == want and len(specs) == 8
    assert specs[:4] == [(f"{tlora.PEFT_PREFIX}transformer.h.0.{n}", i, o) for n, i, o in [
        ("self_attention.query_key_value", 96, 288), ("self_attention.dense", 96, 96),
        ("mlp.dense_h_to_4h", 96, 384), ("mlp.dense_4h_to_h", 384, 96)]]
    assert jlora.lora_target_specs(jax_model[1], jlora.LoraConfig()) == specs


def test_lora_adapter_matches_torch(jax_model):
    config = tlora.LoraConfig()
    model = tm.BloomForCausalLM.from_pretrained(CKPT)
    tlora.inject_lora(model, config, seed=0)
    rng = np.random.default_rng(6)  # a nonzero B, so every adapter moves the logits
    weights = {k: (v if ".lora_A." in k else rng.standard_normal(v.shape).astype(np.float32) * 0.05)
               for k, v in tlora.lora_state_dict(model).items()}
    tlora.load_lora_state_dict(model, weights)
    ids, mask, positions = batch(BATCHES[2], seed=7)
    ref = torch_logits(model, ids, mask, positions)
    ours = jax_logits(jax_model, ids, mask, positions, lora=jlora.lora_tree_from_state_dict(weights))
    assert max_diff(ref, jax_logits(jax_model, ids, mask, positions), mask) > 1e-2  # the adapter matters
    assert max_diff(ours, ref, mask) <= JAX_TOL


# ---- torch-free JAX side ---------------------------------------------------------------------

def test_jax_side_imports_without_torch():
    code = ("import sys\n"
            "for m in ('torch', 'transformers', 'torch_sources'): sys.modules[m] = None\n"
            "import conversion.bloom, jax_oracles.models.bloom\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
