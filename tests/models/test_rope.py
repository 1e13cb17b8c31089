"""models/rope.py on both sides (issue 29): every rope type against transformers' own table functions
(modeling_rope_utils.ROPE_INIT_FUNCTIONS) at release head dims, the twins bit for bit, and the readers'
standardisation of both config forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jax_oracles.models import rope as jrope
from torch_sources.models import rope as trope

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

# (rope block, head_dim, theta): release head dims and thetas (Llama 3.1 128 / 5e5, Qwen2.5 128 / 1e6,
# Phi-4-mini 128 x 0.75 / 1e4, GPT-OSS 64 / 1.5e5, Mistral 128 / 1e6, StarCoder2 128 / ~1e6).
CASES = [
    ({"rope_type": "default"}, 128, 1e6),
    ({"rope_type": "linear", "factor": 4.0}, 128, 1e4),
    ({"rope_type": "dynamic", "factor": 2.0}, 80, 1e4),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 128, 1e6),
    ({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
      "original_max_position_embeddings": 4096}, 64, 150000.0),
    ({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
      "original_max_position_embeddings": 4096}, 64, 1e4),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, 128, 500000.0),
    ({"rope_type": "longrope", "short_factor": list(np.linspace(1.0, 1.5, 48)), "long_factor":
      list(np.linspace(1.0, 40.0, 48)), "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75},
     128, 10000.0),
    ({"rope_type": "proportional", "partial_rotary_factor": 0.25}, 256, 1e6),
]
IDS = ["default", "linear", "dynamic", "yarn-qwen2.5", "yarn-gpt-oss", "yarn-mscale", "llama3", "longrope",
       "proportional"]


def _hf_table(block, head_dim, theta, seq_len=None):
    rope_parameters = {**block, "rope_theta": theta}
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      max_position_embeddings=131072, rope_parameters=rope_parameters)
    inv, factor = ROPE_INIT_FUNCTIONS[block["rope_type"]](config, "cpu", seq_len=seq_len) \
        if block["rope_type"] != "default" else (None, 1.0)
    if inv is None:
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return inv.numpy(), factor


def _ours(module, block, head_dim, theta):
    d = {"rope_parameters": {**block, "rope_theta": theta}, "max_position_embeddings": 131072}
    return module.read_rope(d, head_dim, partial_rotary=True)


@pytest.mark.parametrize("block,head_dim,theta", CASES, ids=IDS)
def test_tables_match_transformers_within_two_ulps(block, head_dim, theta):
    want, want_factor = _hf_table(block, head_dim, theta)
    r = _ours(trope, block, head_dim, theta)
    got = trope.inv_freq(r).numpy()
    assert got.shape == want.shape
    ulps = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    # torch's vectorised powf misses the nearest float by an ulp at a few pairs; the products after it (longrope's
    # factor x power, then 1 / that) can round that ulp to two
    assert ulps.max() <= 2, f"{ulps.max()} ulps"
    assert (ulps > 0).mean() <= 0.1
    assert trope.attention_factor(r) == pytest.approx(want_factor, rel=1e-12)


@pytest.mark.parametrize("block,head_dim,theta", CASES, ids=IDS)
def test_the_twins_tables_are_equal_bit_for_bit(block, head_dim, theta):
    t, j = _ours(trope, block, head_dim, theta), _ours(jrope, block, head_dim, theta)
    np.testing.assert_array_equal(jrope.inv_freq(j), trope.inv_freq(t).numpy())
    assert jrope.attention_factor(j) == trope.attention_factor(t)
    pos = np.array([[0, 1, 5000, 100_000]], np.int32)  # long positions: one ulp of a table shows up here
    for a, b in zip(jrope.cos_sin(j, pos), trope.cos_sin(t, torch.from_numpy(pos))):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), atol=3e-6, rtol=0)


def test_longrope_switches_past_the_original_length():
    block = CASES[7][0]
    r = _ours(trope, block, 128, 1e4)
    short = _hf_table(block, 128, 1e4)[0]
    long = _hf_table(block, 128, 1e4, seq_len=4097)[0]
    np.testing.assert_array_equal(trope.inv_freq(r, 4096).numpy(), trope.inv_freq(r).numpy())
    assert np.abs(trope.inv_freq(r, 4096).numpy() - short).max() <= 1e-7 * short.max()
    assert np.abs(trope.inv_freq(r, 4097).numpy() - long).max() <= 1e-7 * long.max()
    j = _ours(jrope, block, 128, 1e4)
    for longest in (4096, 4097):  # the traced switch picks the table the torch side picks
        pos = np.arange(longest - 4, longest, dtype=np.int32)[None]
        np.testing.assert_allclose(np.asarray(jrope.cos_sin(j, pos)[0]), trope.cos_sin(r, torch.from_numpy(pos))[0],
                                   atol=3e-6, rtol=0)


def test_both_config_forms_read_alike():
    release = {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
               "max_position_embeddings": 256}
    saved = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                 "original_max_position_embeddings": 64}, "max_position_embeddings": 256}
    for m in (trope, jrope):
        assert m.read_rope(release, 16) == m.read_rope(saved, 16)
        # rope_scaling wins over rope_parameters, as transformers' convert_rope_params_to_dict
        both = {**saved, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
        assert m.read_rope(both, 16).rope_type == "linear"
        assert m.read_rope({"max_position_embeddings": 256}, 16, default_theta=150000.0).theta == 150000.0


def test_longrope_switch_keeps_torch_table_on_a_wider_static_shape():
    """transformers picks longrope's table from the padded batch's largest position. A twin that pads wider
    for jit (the DPO and PPO twins' static shapes) passes torch's positions (layers.padded_positions): the
    real tokens keep their own, the extra pads hold torch's last one, and the table is torch's."""
    from jax_oracles.models.layers import padded_positions
    block = {**CASES[7][0], "original_max_position_embeddings": 32}
    r, j = _ours(trope, block, 128, 1e4), _ours(jrope, block, 128, 1e4)
    for real in (30, 32, 33):
        torch_len = -(-real // 8) * 8  # the torch collators: the longest row, rounded up to a multiple of 8
        want = trope.cos_sin(r, torch.arange(torch_len)[None])[0][0, :real].numpy()
        mask = (np.arange(64)[None] < real).astype(np.int32)  # the twin's one static length, 64
        got = np.asarray(jrope.cos_sin(j, padded_positions(mask, torch_len))[0])[0, :real]
        np.testing.assert_allclose(got, want, atol=3e-6, rtol=0, err_msg=f"{real} real tokens")
        wrong = np.asarray(jrope.cos_sin(j, np.arange(64, dtype=np.int32)[None])[0])[0, :real]
        assert real > 32 or np.abs(wrong - want).max() > 1e-3  # without them a short batch would take the long table
