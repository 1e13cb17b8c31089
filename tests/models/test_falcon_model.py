"""Falcon, both attention layouts (new decoder architecture; 7B multi-query): torch reference vs
transformers, JAX oracle vs torch, conversion both ways, LoRA targets, reproducible checkpoint assets."""

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

from conversion import falcon as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import falcon as jm  # noqa: E402
from jax_oracles.training import lora as jlora  # noqa: E402
from torch_sources.models import falcon as tm  # noqa: E402
from torch_sources.training import lora as tlora  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CKPTS = {name: ROOT / "assets" / "checkpoints" / name for name in ("falcon", "falcon-mqa")}
TORCH_TOL, JAX_TOL = 1e-5, 2e-5
# (batch, seq, real lengths, left padding?)
BATCHES = {"unpadded": (2, 9, (9, 9), False), "right": (3, 21, (21, 13, 3), False),
           "right-long": (2, 40, (40, 29), False), "left": (3, 17, (17, 11, 4), True)}


def load_generator():
    # tools/ is not a package: load by path, so plain `pytest` works too.
    spec = importlib.util.spec_from_file_location("checkpoints_falcon", ROOT / "tools" / "checkpoints_falcon.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def batch(name, seed=0):
    """ids, mask, position_ids (None for right padding; HF's mask cumsum - 1 for left padding)."""
    B, T, lengths, left = BATCHES[name]
    ids = np.random.default_rng(seed).integers(0, 400, size=(B, T))
    real = np.arange(T)[None] < np.array(lengths)[:, None]
    mask = (real[:, ::-1] if left else real).astype(np.int64)
    ids[np.arange(B), mask.argmax(1)] = 400  # <|endoftext|> opens each row
    pos = np.where(mask == 1, mask.cumsum(-1) - 1, 1) if left else None
    return np.where(mask == 1, ids, 0), mask, pos


def valid(x, mask):  # the real (unpadded) positions, flattened: [n, V]
    return np.asarray(x)[np.asarray(mask) == 1]


@pytest.fixture(scope="module", params=list(CKPTS))
def ckpt(request):
    return CKPTS[request.param]


@pytest.fixture(scope="module")
def torch_model(ckpt):
    return tm.FalconForCausalLM.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    transformers = pytest.importorskip("transformers")
    return transformers.FalconForCausalLM.from_pretrained(ckpt, attn_implementation="eager",
                                                          dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def jax_model(ckpt):
    return jm.FalconForCausalLM(conv.load_config(ckpt)), conv.load_params(ckpt)


def torch_logits(model, ids, mask, pos=None):
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(mask), None if pos is None else torch.tensor(pos)).numpy()


_apply = jax.jit(lambda model, variables, ids, mask, pos: model.apply(variables, ids, mask, pos), static_argnums=0)


def jax_logits(jax_model, ids, mask, pos=None, lora=None):
    model, params = jax_model
    variables = {"params": params} if lora is None else {"params": params, "lora": lora}
    pos = None if pos is None else jnp.asarray(pos, jnp.int32)
    return np.asarray(_apply(model, variables, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32), pos))


# ---- checkpoint assets -----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(CKPTS))
def test_checkpoint_regenerates_byte_identical(tmp_path, name):
    out = getattr(load_generator(), f"make_{name.replace('-', '_')}")(tmp_path / name)
    names = sorted(p.name for p in CKPTS[name].iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in out.iterdir()) == names
    for f in names:
        assert (out / f).read_bytes() == (CKPTS[name] / f).read_bytes(), f


def test_make_checkpoints_registry_builds_falcon(tmp_path):
    spec = importlib.util.spec_from_file_location("make_checkpoints", ROOT / "tools" / "make_checkpoints.py")
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    out = tools.BUILDERS["falcon"](tmp_path / "falcon")
    assert (out / "model.safetensors").read_bytes() == (CKPTS["falcon"] / "model.safetensors").read_bytes()


def test_transformers_loads_every_tensor_and_no_other(ckpt):
    transformers = pytest.importorskip("transformers")
    _, info = transformers.FalconForCausalLM.from_pretrained(ckpt, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = safetensors_io.load_state_dict(ckpt)
    assert "lm_head.weight" not in state  # tied, as released
    for name, w in state.items():
        if "ln" in name or "layernorm" in name:  # biased norms, drawn away from identity
            assert np.abs(w - (1.0 if name.endswith("weight") else 0.0)).max() > 0.05, name


# ---- config and operators --------------------------------------------------------------------

def test_config_layouts():
    new, mqa = (tm.FalconConfig.from_pretrained(CKPTS[n]) for n in ("falcon", "falcon-mqa"))
    assert (new.num_key_value_heads, new.num_parallel_norms) == (2, 2)
    assert (mqa.num_key_value_heads, mqa.num_parallel_norms) == (1, 1)
    for name, c in (("falcon", new), ("falcon-mqa", mqa)):
        assert (c.head_dim, c.intermediate_size, c.norm_eps, c.rope_theta, c.tie_word_embeddings) == \
            (16, 256, 1e-5, 10000.0, True)
        d = json.loads((CKPTS[name] / "config.json").read_text())  # token ids: bookkeeping, not the config's math
        assert (d["bos_token_id"], d["eos_token_id"]) == (400, 400)
    assert jm.FalconConfig.from_pretrained(CKPTS["falcon"]).num_key_value_heads == 2


def test_reads_config_saved_by_transformers(hf_model, torch_model, ckpt, tmp_path):
    hf_model.config.save_pretrained(tmp_path)  # transformers 5: rope_parameters, num_kv_heads filled in
    assert tm.FalconConfig.from_pretrained(tmp_path).num_key_value_heads == torch_model.config.num_key_value_heads
    assert conv.load_config(tmp_path).num_parallel_norms == conv.load_config(ckpt).num_parallel_norms
    assert tm.FalconConfig.from_pretrained(tmp_path).rope_theta == 10000.0


def test_rope_inv_freq_matches_transformers(torch_model, hf_model):
    assert torch.equal(tm.rope_inv_freq(torch_model.config), hf_model.transformer.rotary_emb.inv_freq)
    np.testing.assert_allclose(np.asarray(jm.rope_inv_freq(torch_model.config)),
                               hf_model.transformer.rotary_emb.inv_freq.numpy(), rtol=1e-6)


def test_split_qkv_matches_transformers(torch_model, hf_model):
    c = torch_model.config
    N, K, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    fused = torch.randn(2, 5, (N + 2 * K) * hd, generator=torch.Generator().manual_seed(0))
    q, k, v = tm.split_qkv(c, fused)
    assert q.shape == (2, 5, N, hd) and k.shape == v.shape == (2, 5, K, hd)
    hq, hk, hv = hf_model.transformer.h[0].self_attention._split_heads(fused)
    # HF broadcasts the new architecture's K/V groups to every query head (head j*G+g reads group j)
    torch.testing.assert_close(q, hq, rtol=0, atol=0)
    G = N // K if c.new_decoder_architecture else 1
    torch.testing.assert_close(k.repeat_interleave(G, 2), hk, rtol=0, atol=0)
    torch.testing.assert_close(v.repeat_interleave(G, 2), hv, rtol=0, atol=0)
    for ours, ref in zip(jm.split_qkv(c, jnp.asarray(fused.numpy())), (q, k, v)):
        np.testing.assert_array_equal(np.asarray(ours), ref.numpy())


def test_split_qkv_grouping_literal():
    """New architecture, 4 heads in 2 groups: rows [q0 q1 k0 v0 | q2 q3 k1 v1] of width hd each."""
    c = jm.FalconConfig.from_pretrained(CKPTS["falcon"])
    labels = np.repeat(np.arange(8, dtype=np.float32), c.head_dim)[None, None]
    q, k, v = (np.asarray(x)[0, 0, :, 0] for x in jm.split_qkv(c, jnp.asarray(labels)))
    assert q.tolist() == [0, 1, 4, 5] and k.tolist() == [2, 6] and v.tolist() == [3, 7]
    c = jm.FalconConfig.from_pretrained(CKPTS["falcon-mqa"])  # [Q0..Q3; K; V]
    labels = np.repeat(np.arange(6, dtype=np.float32), c.head_dim)[None, None]
    q, k, v = (np.asarray(x)[0, 0, :, 0] for x in jm.split_qkv(c, jnp.asarray(labels)))
    assert q.tolist() == [0, 1, 2, 3] and k.tolist() == [4] and v.tolist() == [5]


def test_operators_match_torch(torch_model):
    c = torch_model.config
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((2, 5, 64)) * 3 + 1.5).astype(np.float32)
    w, b = (rng.standard_normal(64).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(np.asarray(jm.layer_norm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), 1e-5)),
                               tm.layer_norm(torch.tensor(x), torch.tensor(w), torch.tensor(b), 1e-5).numpy(),
                               atol=2e-6)
    pos = np.array([[0, 1, 2, 3, 4], [7, 30, 63, 128, 255]], np.int32)
    jcos, jsin = jm.rope_cos_sin(jm.rope_inv_freq(c), jnp.asarray(pos))
    tcos, tsin = tm.rope_cos_sin(tm.rope_inv_freq(c), torch.tensor(pos))
    np.testing.assert_allclose(np.asarray(jcos), tcos.numpy(), atol=1e-6)
    q = rng.standard_normal((2, 5, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 5, c.num_key_value_heads, 16)).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(np.asarray(jm.apply_rope(jnp.asarray(q), jcos, jsin)),
                               tm.apply_rope(torch.tensor(q), tcos, tsin).numpy(), atol=1e-6)
    mask = tm.causal_mask(torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]))
    ref = tm.eager_attention(torch.tensor(q), torch.tensor(k), torch.tensor(v), mask, 0.25).numpy()
    ours = jm.eager_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask.numpy()), 0.25)
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-6)


# ---- full model ------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(BATCHES))
def test_torch_matches_transformers(torch_model, hf_model, case):
    ids, mask, pos = batch(case)
    ours = torch_logits(torch_model, ids, mask, pos)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                       position_ids=None if pos is None else torch.tensor(pos)).logits.numpy()
    diff = np.abs(valid(ours, mask) - valid(ref, mask)).max()
    print(f"{case}: max |torch - transformers| = {diff:.3g}")
    assert diff <= TORCH_TOL


@pytest.mark.parametrize("case", list(BATCHES))
def test_jax_matches_torch(torch_model, jax_model, case):
    ids, mask, pos = batch(case, seed=1)
    ours, ref = jax_logits(jax_model, ids, mask, pos), torch_logits(torch_model, ids, mask, pos)
    diff = np.abs(valid(ours, mask) - valid(ref, mask)).max()
    print(f"{case}: max |jax - torch| = {diff:.3g}")
    assert diff <= JAX_TOL


def test_decoder_layer_matches_torch(torch_model, jax_model):
    config, params = jax_model[0].config, jax_model[1]
    ids, mask, _ = batch("right", seed=2)
    hidden = np.random.default_rng(3).standard_normal((*ids.shape, config.hidden_size)).astype(np.float32)
    with torch.no_grad():
        ref = torch_model.transformer.h[1](torch.tensor(hidden), tm.layer_inputs(torch_model.config, torch.tensor(mask)))
    layer = jm.FalconDecoderLayer(config)
    ours = jax.jit(lambda p, h, m: layer.apply({"params": p}, h, jm.layer_inputs(config, m)))(
        params["transformer"]["h_1"], jnp.asarray(hidden), jnp.asarray(mask))
    assert np.abs(valid(ours, mask) - valid(ref.numpy(), mask)).max() <= JAX_TOL


# ---- conversion ------------------------------------------------------------------------------

def test_hf_layout_is_the_checkpoint(ckpt, jax_model):
    state = safetensors_io.load_state_dict(ckpt)
    assert conv.hf_layout(jax_model[1]) == {k: tuple(v.shape) for k, v in state.items()}


def test_conversion_checks_both_ways():
    state = safetensors_io.load_state_dict(CKPTS["falcon"])
    config = conv.load_config(CKPTS["falcon"])
    with pytest.raises(ValueError, match=r"never written \['transformer/h_1/ln_mlp/bias'\]"):
        conv.convert_state_dict({k: v for k, v in state.items() if k != "transformer.h.1.ln_mlp.bias"}, config)
    with pytest.raises(ValueError, match="unused source tensors"):
        conv.convert_state_dict({**state, "transformer.h.0.self_attention.rotary.inv_freq": np.ones(8, np.float32)},
                                config)
    with pytest.raises(ValueError, match="shape mismatch"):  # an MQA-sized fused projection
        conv.convert_state_dict({**state, "transformer.h.0.self_attention.query_key_value.weight":
                                 np.zeros((96, 64), np.float32)}, config)
    # the other layout's checkpoint (one input_layernorm) under this config is refused
    mqa = safetensors_io.load_state_dict(CKPTS["falcon-mqa"])
    with pytest.raises(ValueError, match="checkpoint/model mismatch"):
        conv.convert_state_dict(mqa, config)


# ---- LoRA --------------------------------------------------------------------------------------

def test_lora_targets_are_transformers_linears(ckpt, hf_model, torch_model, jax_model):
    want = sorted((f"{tlora.PEFT_PREFIX}{n}", m.in_features, m.out_features) for n, m in hf_model.named_modules()
                  if isinstance(m, torch.nn.Linear) and n.split(".")[0] != "lm_head")
    ours = tlora.lora_target_specs(torch_model, tlora.LoraConfig())
    assert sorted(ours) == want and len(want) == 4 * torch_model.config.num_hidden_layers
    assert jlora.lora_target_specs(jax_model[1], jlora.LoraConfig()) == ours


def test_lora_adapter_torch_matches_jax(ckpt, jax_model):
    model = tm.FalconForCausalLM.from_pretrained(ckpt)
    names = tlora.inject_lora(model, tlora.LoraConfig(), seed=0)
    rng = np.random.default_rng(9)
    adapters = {n: rng.standard_normal(p.shape).astype(np.float32) * 0.1
                for n, p in tlora.lora_state_dict(model).items()}
    tlora.load_lora_state_dict(model, adapters)
    assert sorted(names) == sorted(adapters)
    ids, mask, pos = batch("left", seed=6)
    ref = torch_logits(model, ids, mask, pos)
    lora = jlora.lora_tree_from_state_dict(tlora.lora_state_dict(model))
    ours = jax_logits((jm.FalconForCausalLM(jax_model[0].config, tlora.LoraConfig().scaling), jax_model[1]),
                      ids, mask, pos, lora)
    base = jax_logits(jax_model, ids, mask, pos)
    assert np.abs(valid(ours, mask) - valid(base, mask)).max() > 0.05  # the adapter moves the logits
    assert np.abs(valid(ours, mask) - valid(ref, mask)).max() <= JAX_TOL


# ---- torch-free JAX side ---------------------------------------------------------------------

def test_jax_side_imports_without_torch():
    code = ("import sys\n"
            "for m in ('torch', 'transformers', 'torch_sources', 'recorder'): sys.modules[m] = None\n"
            "import conversion.falcon, jax_oracles.models.falcon\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
