"""Llama 3: torch reference vs transformers, JAX oracle vs torch, checkpoint assets and loaders."""

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

from conversion import llama3 as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import llama3 as jm  # noqa: E402
from torch_sources.models import llama3 as tm  # noqa: E402
from torch_sources.models import loading  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets" / "checkpoints" / "llama3"
BAR = 0.99999
SHAPES = [(2, 7, (7, 4)), (3, 40, (40, 13, 29))]  # (batch, seq, real lengths): right padding


def tensor_score(a, b) -> float:
    """sqrt(max(0, cos) * min(|a|,|b|) / max(|a|,|b|)); 0 on shape mismatch or non-finite."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.shape != b.shape or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return 0.0
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    cos = a @ b / (na * nb + 1e-12)
    return float(np.sqrt(max(0.0, cos) * min(na, nb) / (max(na, nb) + 1e-12)))


def batch(shape, seed=0):
    B, T, lengths = shape
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 400, size=(B, T))
    ids[:, 0] = 400  # <|begin_of_text|>
    mask = (np.arange(T)[None] < np.array(lengths)[:, None]).astype(np.int32)
    return np.where(mask == 1, ids, 0), mask


def load_tools():
    spec = importlib.util.spec_from_file_location("make_checkpoints", ROOT / "tools" / "make_checkpoints.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def torch_model():
    return tm.LlamaForCausalLM.from_pretrained(CKPT)


@pytest.fixture(scope="module")
def jax_model():
    config = conv.load_config(CKPT)
    return jm.LlamaForCausalLM(config), conv.load_params(CKPT)


def torch_logits(model, ids, mask):
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(mask)).numpy()


_apply = jax.jit(lambda model, variables, ids, mask: model.apply(variables, ids, mask), static_argnums=0)


def jax_logits(jax_model, ids, mask, lora=None):
    model, params = jax_model
    variables = {"params": params} if lora is None else {"params": params, "lora": lora}
    return np.asarray(_apply(model, variables, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)))


# ---- (1) torch reference vs transformers ----------------------------------------------------

@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}T{s[1]}")
def test_torch_matches_transformers(torch_model, hf_model, shape):
    ids, mask = batch(shape)
    ours = torch_logits(torch_model, ids, mask)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    print(f"torch vs transformers {shape[:2]}: max abs diff {np.abs(ours - ref).max():.3e}")
    assert tensor_score(ours, ref) >= BAR


def test_rope_inv_freq_matches_transformers(torch_model, hf_model):
    ours = tm.rope_inv_freq(torch_model.config)
    assert torch.equal(ours, hf_model.model.rotary_emb.inv_freq)
    # The tiny config puts one frequency in each llama3 band (kept, blended, divided by factor).
    plain = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
    ratio = (plain / ours).numpy()
    assert ratio[0] == 1.0 and 1.0 < ratio[1] < 8.0 and np.allclose(ratio[2:], 8.0)


def test_reads_checkpoint_saved_by_transformers(hf_model, torch_model, tmp_path):
    hf_model.save_pretrained(tmp_path)  # transformers 5 writes `rope_parameters`, not rope_theta/rope_scaling
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    assert tm.LlamaConfig.from_pretrained(tmp_path) == torch_model.config
    assert conv.load_config(tmp_path) == conv.load_config(CKPT)
    ids, mask = batch(SHAPES[0])
    np.testing.assert_array_equal(torch_logits(tm.LlamaForCausalLM.from_pretrained(tmp_path), ids, mask),
                                  torch_logits(torch_model, ids, mask))


# ---- (2) JAX oracle vs torch reference ------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"B{s[0]}T{s[1]}")
def test_jax_matches_torch(torch_model, jax_model, shape):
    ids, mask = batch(shape, seed=1)
    ours, ref = jax_logits(jax_model, ids, mask), torch_logits(torch_model, ids, mask)
    print(f"jax vs torch {shape[:2]}: max abs diff {np.abs(ours - ref).max():.3e}")
    assert tensor_score(ours, ref) >= BAR


def test_decoder_layer_matches_torch(torch_model, jax_model):
    config, params = jax_model[0].config, jax_model[1]
    ids, mask = batch(SHAPES[1], seed=2)
    rng = np.random.default_rng(3)
    hidden = rng.standard_normal((*ids.shape, config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        inputs = tm.layer_inputs(torch_model.config, torch.tensor(mask))
        ref = torch_model.model.layers[1](torch.tensor(hidden), inputs).numpy()
    layer = jm.LlamaDecoderLayer(config)
    ours = jax.jit(lambda p, h, m: layer.apply(p, h, jm.layer_inputs(config, m)))(
        {"params": params["model"]["layers_1"]}, jnp.asarray(hidden), jnp.asarray(mask))
    assert tensor_score(ours, ref) >= BAR


def test_operators_match_torch(torch_model, jax_model):
    config = jax_model[0].config
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32) * 3
    w = rng.standard_normal(64).astype(np.float32)
    assert tensor_score(jm.rms_norm(jnp.asarray(x), jnp.asarray(w), 1e-5),
                        tm.rms_norm(torch.tensor(x), torch.tensor(w), 1e-5)) >= BAR

    jf, tf = jm.rope_inv_freq(config), tm.rope_inv_freq(torch_model.config)
    np.testing.assert_allclose(np.asarray(jf), tf.numpy(), rtol=1e-6, atol=0)
    pos = np.array([[0, 1, 2, 3, 4], [7, 30, 63, 128, 255]], np.int32)
    jcos, jsin = jm.rope_cos_sin(jf, jnp.asarray(pos))
    tcos, tsin = tm.rope_cos_sin(tf, torch.tensor(pos))
    assert tensor_score(jcos, tcos) >= BAR and tensor_score(jsin, tsin) >= BAR

    q = rng.standard_normal((2, 5, 4, 16)).astype(np.float32)
    assert tensor_score(jm.apply_rope(jnp.asarray(q), jcos, jsin), tm.apply_rope(torch.tensor(q), tcos, tsin)) >= BAR

    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], np.int32)
    np.testing.assert_array_equal(np.asarray(jm.causal_mask(jnp.asarray(mask)))[0],
                                  [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(np.asarray(jm.causal_mask(jnp.asarray(mask))), tm.causal_mask(torch.tensor(mask)).numpy())

    k, v = (rng.standard_normal((2, 5, 2, 16)).astype(np.float32) for _ in range(2))
    bmask = tm.causal_mask(torch.tensor(mask))
    ref = tm.eager_attention(torch.tensor(q), torch.tensor(k), torch.tensor(v), bmask, 0.25)
    ours = jm.eager_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(bmask.numpy()), 0.25)
    assert tensor_score(ours, ref) >= BAR
    # GQA order: query heads 0,1 use KV head 0 (HF repeat_kv), so a swapped KV head must move the output.
    swapped = jm.eager_attention(jnp.asarray(q), jnp.asarray(k[:, :, ::-1]), jnp.asarray(v[:, :, ::-1]),
                                 jnp.asarray(bmask.numpy()), 0.25)
    assert tensor_score(swapped, ref) < 0.99


# ---- (3) sharded checkpoints, (4) reproducible assets ---------------------------------------

def test_sharded_checkpoint_loads_identically(tmp_path):
    tools = load_tools()
    sharded = tools.shard_checkpoint(CKPT, tmp_path / "sharded", max_tensors_per_shard=4)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-{k:05d}-of-00006.safetensors" for k in range(1, 7)]
    assert not (sharded / "model.safetensors").exists()

    single_t, sharded_t = loading.load_state_dict(CKPT), loading.load_state_dict(sharded)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in single_t.values())
    assert single_t.keys() == sharded_t.keys() == index["weight_map"].keys()
    assert all(torch.equal(single_t[k], sharded_t[k]) for k in single_t)

    single_n, sharded_n = safetensors_io.load_state_dict(CKPT), safetensors_io.load_state_dict(sharded)
    assert single_n.keys() == sharded_n.keys() and all(np.array_equal(single_n[k], sharded_n[k]) for k in single_n)
    flat = jax.tree_util.tree_leaves_with_path
    a, b = dict(flat(conv.load_params(CKPT))), dict(flat(conv.load_params(sharded)))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    ids, mask = batch(SHAPES[0])
    np.testing.assert_array_equal(torch_logits(tm.LlamaForCausalLM.from_pretrained(sharded), ids, mask),
                                  torch_logits(tm.LlamaForCausalLM.from_pretrained(CKPT), ids, mask))


def test_checkpoint_regenerates_byte_identical(tmp_path):
    out = load_tools().make_llama3(tmp_path / "llama3")
    names = sorted(p.name for p in CKPT.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == names
    for name in names:
        assert (out / name).read_bytes() == (CKPT / name).read_bytes(), name


# ---- (5) clear loader errors -----------------------------------------------------------------

LOADERS = [(loading.load_state_dict, loading.CheckpointError),
           (safetensors_io.load_state_dict, safetensors_io.CheckpointError)]


def copy_ckpt(dst: Path) -> Path:
    dst.mkdir()
    for p in CKPT.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


@pytest.mark.parametrize("load, error", LOADERS, ids=["torch", "numpy"])
def test_loader_errors(tmp_path, load, error):
    with pytest.raises(error, match="checkpoint directory not found"):
        load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(error, match="no weights in"):
        load(tmp_path / "empty")

    d = copy_ckpt(tmp_path / "corrupt")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(error, match=r"model\.safetensors is not a readable safetensors file"):
        load(d)
    (d / "model.safetensors").write_bytes(b"\x00" * 8 + data[8:])  # header length zeroed
    with pytest.raises(error, match="not a readable safetensors file"):
        load(d)

    sharded = load_tools().shard_checkpoint(CKPT, tmp_path / "sharded", max_tensors_per_shard=8)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(error, match=r"missing .*model-00002-of-00003\.safetensors"):
        load(sharded)


def test_config_errors(tmp_path):
    d = copy_ckpt(tmp_path / "noconfig")
    (d / "config.json").unlink()
    for fn in (tm.LlamaConfig.from_pretrained, conv.load_config):
        with pytest.raises(OSError, match="missing config.json"):
            fn(d)


def test_conversion_checks_both_ways():
    config = conv.load_config(CKPT)
    state = safetensors_io.load_state_dict(CKPT)
    with pytest.raises(ValueError, match=r"unused source tensors \['model.layers.0.self_attn.rotary_emb.inv_freq'\]"):
        conv.convert_state_dict({**state, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}, config)
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"never written \['model/layers_1/mlp/up_proj/kernel'\]"):
        conv.convert_state_dict(missing, config)
    with pytest.raises(ValueError, match="shape mismatch"):
        conv.convert_state_dict({**state, "model.norm.weight": np.ones(32, np.float32)}, config)


# ---- (6) LoRA collection ---------------------------------------------------------------------

def lora_tree(params, r=4, seed=5, b_scale=0.05):
    rng = np.random.default_rng(seed)
    tree = {"model": {}}
    for layer, mods in params["model"].items():
        if not layer.startswith("layers_"):
            continue
        tree["model"][layer] = {}
        for block, names in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down"))):
            tree["model"][layer][block] = {}
            for n in names:
                kernel = mods[block][f"{n}_proj"]["kernel"]  # [in, out]
                a = rng.standard_normal((kernel.shape[0], r)).astype(np.float32) * 0.1
                b = rng.standard_normal((r, kernel.shape[1])).astype(np.float32) * b_scale
                tree["model"][layer][block][f"{n}_proj"] = {"lora_A": jnp.asarray(a), "lora_B": jnp.asarray(b)}
    return tree


def test_lora_collection(jax_model):
    model, params = jax_model
    ids, mask = batch(SHAPES[1], seed=6)
    base = jax_logits(jax_model, ids, mask)
    zero_b = lora_tree(params, b_scale=0.0)
    np.testing.assert_array_equal(jax_logits(jax_model, ids, mask, zero_b), base)

    lora = lora_tree(params)
    adapted = jax_logits(jax_model, ids, mask, lora)
    assert tensor_score(adapted, base) < 0.9999
    # The adapter must equal merging W + scaling * A @ B into the kernels (scaling = 2.0 by default).
    merged = jax.tree_util.tree_map(lambda x: x, params)
    for layer, blocks in lora["model"].items():
        for block, mods in blocks.items():
            for name, ab in mods.items():
                k = merged["model"][layer][block][name]["kernel"]
                merged["model"][layer][block][name] = {"kernel": k + 2.0 * ab["lora_A"] @ ab["lora_B"]}
    assert tensor_score(jax_logits((model, merged), ids, mask), adapted) >= BAR


# ---- torch-free JAX side ---------------------------------------------------------------------

def test_jax_side_imports_without_torch():
    code = ("import sys\n"
            "for m in ('torch', 'transformers', 'torch_sources', 'recorder'): sys.modules[m] = None\n"
            "import conversion.llama3, jax_oracles.models.llama3, jax_oracles.training.lora\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
