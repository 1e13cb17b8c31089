"""GPT-OSS, JAX side (jax_oracles/models/gpt_oss.py, conversion/gpt_oss.py, serving_engine/models/gpt_oss.py)
against the torch source (torch_sources/models/gpt_oss.py) on the tiny MXFP4 checkpoint: the numpy MXFP4
dequantization bit for bit, the converted layout, YaRN and sinks, the grouped-matmul MoE, the router's ties,
the logits, and the paged serving path (prefill, greedy engine, Pallas kernel with sinks)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors import safe_open

from conversion import gpt_oss as conv
from jax_oracles.models import gpt_oss as J
from jax_oracles.models import layers as jlayers
from jax_oracles.models import rope as jrope
from recorder.probes.training import rng_for
from serving_engine.config import EngineConfig, SamplingParams
from serving_engine.engine import LLMEngine
from serving_engine.model_runner import ModelRunner
from torch_sources.models import gpt_oss as T
from torch_sources.models import layers as tlayers
from torch_sources.models import rope as trope
from torch_sources.models.mxfp4 import dequantize_mxfp4 as torch_dequantize
from torch_sources.serving import config as tconfig
from torch_sources.serving import engine as tengine
from torch_sources.serving import model_runner as trunner

jax.config.update("jax_default_matmul_precision", "highest")

CKPT = "assets/checkpoints/gpt_oss"
ENGINE = dict(block_size=4, num_blocks=32, max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64, mode="ragged")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models():
    """(config, converted params, the Linen model bound to them, the torch source model)."""
    config, params = conv.load_config(CKPT), conv.load_params(CKPT)
    lm = J.GptOssForCausalLM(config).bind({"params": params})
    return config, params, lm, T.GptOssForCausalLM.from_pretrained(CKPT)


def _bits(x) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


# ---- layout and conversion ---------------------------------------------------------------------------------

def test_public_names_mirror_torch():
    assert set(T.__all__) <= set(J.__all__), set(T.__all__) - set(J.__all__)
    assert set(tlayers.__all__) <= set(jlayers.__all__)


def test_torch_free():
    mods = "conversion.gpt_oss, jax_oracles.models.gpt_oss, serving_engine.models.gpt_oss, serving_engine.models"
    code = (f"import sys, {mods}; bad = [m for m in ('torch', 'transformers', 'torch_sources') if m in sys.modules];"
            " assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_dequantize_matches_torch_bit_for_bit():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 5, 4), dtype=np.uint8)
    scales[0, 0, :3] = (0, 1, 127)  # subnormal results, 2^-126, 2^0
    mine = conv.dequantize_mxfp4(blocks, scales)
    assert mine.shape == (3, 5, 128) and mine.dtype == np.float32
    ref = torch_dequantize(torch.from_numpy(blocks), torch.from_numpy(scales))
    np.testing.assert_array_equal(_bits(mine), _bits(ref))
    # the nibble order: element 2j is byte j's low nibble; 0x1A = codes (0xA, 0x1) = (-1.0, 0.5)
    one = np.zeros((1, 16), np.uint8)
    one[0, 0] = 0x1A
    assert conv.dequantize_mxfp4(one, np.array([128], np.uint8))[:2].tolist() == [-2.0, 1.0]
    with safe_open(f"{CKPT}/model.safetensors", "np") as f:  # the checkpoint's own experts
        for name in [k for k in f.keys() if k.endswith("_blocks")]:
            b, s = f.get_tensor(name), f.get_tensor(name.replace("_blocks", "_scales"))
            np.testing.assert_array_equal(_bits(conv.dequantize_mxfp4(b, s)),
                                          _bits(torch_dequantize(torch.from_numpy(b), torch.from_numpy(s))))


def test_converted_params_and_layout(models):
    config, params, _, tmodel = models
    with safe_open(f"{CKPT}/model.safetensors", "np") as f:
        header = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert conv.hf_layout(params) == header  # MXFP4 pairs included, derived from the params' shapes
    experts = params["model"]["layers_1"]["mlp"]["experts"]
    t_experts = tmodel.model.layers[1].mlp.experts
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        np.testing.assert_array_equal(_bits(experts[name]), _bits(getattr(t_experts, name).detach()))
    assert params["model"]["layers_0"]["self_attn"]["sinks"].shape == (config.num_attention_heads,)
    state = {k: np.zeros(s, np.uint8 if k.endswith(("_blocks", "_scales")) else np.float32) for k, s in header.items()}
    del state["model.layers.0.mlp.experts.down_proj_scales"]
    with pytest.raises(ValueError, match="down_proj_scales"):
        conv.convert_state_dict(state, config)


def test_config_reads_both_forms():
    d = json.load(open(f"{CKPT}/config.json"))
    new = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = {**d["rope_scaling"], "rope_theta": d["rope_theta"]}
    assert J.GptOssConfig.from_hf(new) == J.GptOssConfig.from_hf(d)
    assert dataclasses.asdict(J.GptOssConfig.from_hf(d)) == dataclasses.asdict(T.GptOssConfig.from_hf(d))


# ---- operators ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {"truncate": True}, {"attention_factor": 1.25, "beta_fast": 16.0}])
def test_yarn_inv_freq_and_factor(extra):
    block = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
             "truncate": False, **extra}
    for dim in (16, 64):  # both twins round the float64 power once: the same table, bit for bit
        s, ts = jrope.read_rope({"rope_parameters": block}, dim), trope.read_rope({"rope_parameters": block}, dim)
        np.testing.assert_array_equal(jrope.inv_freq(s), trope.inv_freq(ts).numpy())
    assert jrope.attention_factor(s) == trope.attention_factor(ts)
    s, ts = jrope.read_rope({"rope_parameters": block}, 16), trope.read_rope({"rope_parameters": block}, 16)
    pos = np.arange(40)[None]
    for a, b in zip(jrope.cos_sin(s, jnp.asarray(pos)), trope.cos_sin(ts, torch.from_numpy(pos))):
        np.testing.assert_allclose(a, b.numpy(), atol=2e-6)


def test_eager_attention_sinks_match_torch():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((2, 9, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8)))
    sinks = rng.standard_normal(4).astype(np.float32) * 2
    am = np.ones((2, 9), np.int64)
    am[1, :3] = 0
    jm, tm = jlayers.causal_mask(jnp.asarray(am), 4), tlayers.causal_mask(torch.from_numpy(am), 4)
    out = jlayers.eager_attention(*map(jnp.asarray, (q, k, v)), jm, 0.3, sinks=jnp.asarray(sinks))
    ref = tlayers.eager_attention(*map(torch.from_numpy, (q, k, v)), tm, 0.3, sinks=torch.from_numpy(sinks))
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-6)
    no_sink = jlayers.eager_attention(*map(jnp.asarray, (q, k, v)), jm, 0.3)
    assert np.abs(np.asarray(out) - np.asarray(no_sink)).max() > 1e-2  # the sinks matter


def test_swiglu_clamped_matches_torch():
    x = np.linspace(-12, 12, 2 * 48, dtype=np.float32).reshape(2, 48)  # past +-limit on both halves
    np.testing.assert_allclose(J.swiglu_clamped(jnp.asarray(x), 1.702, 7.0),
                               T.swiglu_clamped(torch.from_numpy(x), 1.702, 7.0).numpy(), atol=2e-6)


def test_route_ties():
    """The same experts in the same order as the torch source, exact ties included: both take the lower
    tied index (the source by a stable sort, jax.lax.top_k by its documented rule), with equal weights."""
    rng = np.random.default_rng(2)
    untied = rng.standard_normal((64, 4)).astype(np.float32) * 2
    tied = np.array([[1, 2, 2, 0], [1, 1, 1, 0], [0, 0, 0, 0], [3, 0, 3, 3], [0, 5, 0, 5]], np.float32)
    for logits in (untied, tied):
        w, i = J.route(jnp.asarray(logits), 2)
        tw, ti = T.route(torch.from_numpy(logits), 2)
        np.testing.assert_array_equal(i, ti.numpy())
        np.testing.assert_allclose(w, tw.numpy(), atol=1e-7)
    assert np.asarray(J.route(jnp.asarray(tied), 2)[1]).tolist() == [[1, 2], [0, 1], [0, 1], [0, 2], [1, 3]]


def _one_expert(experts, e: int, x):  # f32[n,D] -> f32[n,D]: expert e alone, densely (the reference)
    c = experts.config
    h = jnp.dot(x, experts.gate_up_proj[e], precision="highest") + experts.gate_up_proj_bias[e]
    h = J.swiglu_clamped(h, c.swiglu_alpha, c.swiglu_limit)
    return jnp.dot(h, experts.down_proj[e], precision="highest") + experts.down_proj_bias[e]


def test_moe_block_matches_torch(models):
    config, _, lm, tmodel = models
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 13, config.hidden_size)).astype(np.float32)
    for i in range(config.num_hidden_layers):
        with torch.no_grad():
            ref = tmodel.model.layers[i].mlp(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(lm.model.layers[i].mlp(jnp.asarray(x)), ref, atol=1e-5, rtol=0)
    # the grouped matmul equals a dense per-expert reference on the same routing
    experts, flat = lm.model.layers[0].mlp.experts, jnp.asarray(x.reshape(-1, config.hidden_size))
    _, w, idx = lm.model.layers[0].mlp.router(flat)
    dense = sum(jnp.where((idx == e).any(-1, keepdims=True), _one_expert(experts, e, flat), 0)
                * jnp.sum(jnp.where(idx == e, w, 0), -1, keepdims=True) for e in range(config.num_local_experts))
    np.testing.assert_allclose(experts(flat, idx, w), dense, atol=1e-5, rtol=0)


def test_logits_match_torch(models):
    """Two rows of 20 tokens (> the window of 8), the second left-padded with HF's positions."""
    config, params, _, tmodel = models
    rng = np.random.default_rng(4)
    ids = rng.integers(0, config.vocab_size, (2, 20))
    mask = np.ones((2, 20), np.int64)
    mask[1, :5] = 0
    pos = np.clip(np.cumsum(mask, -1) - 1, 0, None)
    logits = jax.jit(J.GptOssForCausalLM(config).apply)({"params": params}, ids, mask, pos)
    with torch.no_grad():
        ref = tmodel(*map(torch.from_numpy, (ids, mask, pos))).numpy()
    diff = np.abs(np.asarray(logits) - ref)
    assert diff[0].max() <= 1e-5 and diff[1, 5:].max() <= 1e-5, (diff[0].max(), diff[1, 5:].max())


# ---- serving -----------------------------------------------------------------------------------------------

def test_prefill_logits_match_torch_runner():
    j, t = ModelRunner(CKPT, EngineConfig(**ENGINE)), trunner.ModelRunner(CKPT, tconfig.EngineConfig(**ENGINE))
    for n in (5, 23):
        ids = np.random.default_rng(n).integers(3, 400, n).tolist()
        diff = np.abs(np.asarray(j.prefill_logits(ids)) - np.asarray(t.prefill_logits(ids)))
        assert diff.max() <= 1e-5, (n, diff.max())


def test_engine_greedy_matches_torch_engine():
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 400, n).tolist() for n in (7, 19, 4, 26)]
    j_out = LLMEngine(CKPT, EngineConfig(**ENGINE)).generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    t_out = tengine.LLMEngine(CKPT, tconfig.EngineConfig(**ENGINE)).generate(
        prompts, tconfig.SamplingParams(temperature=0.0, max_tokens=8))
    assert [o.output_token_ids for o in j_out] == [o.output_token_ids for o in t_out]


def test_pallas_kernel_with_sinks_matches_reference_path():
    cfg = EngineConfig(block_size=4, num_blocks=16, max_num_seqs=2, max_model_len=32, max_num_batched_tokens=32,
                       mode="ragged")
    ids = np.random.default_rng(9).integers(3, 400, 21).tolist()  # past the window of 8
    kernel = ModelRunner(CKPT, cfg, attn_impl="interpret").prefill_logits(ids)
    reference = ModelRunner(CKPT, cfg, attn_impl="reference").prefill_logits(ids)
    np.testing.assert_allclose(kernel, reference, atol=1e-5, rtol=0)
