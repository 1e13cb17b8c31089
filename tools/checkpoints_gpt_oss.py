"""Tiny GPT-OSS checkpoint (openai/gpt-oss-20b format) in the release's HF layout, from numpy.

config.json has the release's keys: attention_bias true, explicit head_dim, `layer_types` alternating
sliding / full (sliding_window 8 here, 128 in the release), the release's YaRN `rope_scaling` verbatim
(factor 32, original 4096, beta 32 / 1, truncate false) with rope_theta 150000, swiglu_limit 7, an untied
lm_head, and `quantization_config` mxfp4: like the release, the experts are stored MXFP4
(`*_blocks` u8 [E, out, in/32, 16], two e2m1 codes a byte, low nibble = even element; `*_scales` u8
[E, out, in/32], E8M0 = 2^(s-127)), everything else fp32. The expert weights are drawn, encoded with
the numpy encoder below, and so ARE their dequantized values (a reader that dequantizes exactly gets the
model). gate_up rows are interleaved: row 2j is gate j, row 2j+1 is up j.

Scales are drawn per group over several octaves and the expert weights wide, so that several scale
exponents, the swiglu clamp (gate > 7, |up| > 7) and a non-degenerate top-2 router are all exercised;
the sinks are wide (std 1) so the sink term visibly changes the attention.
Special tokens from 400: <|startoftext|> (bos), 401 <|endoftext|> (pad), 402 <|return|> (eos),
403 <|call|>. `python tools/make_checkpoints.py gpt_oss` reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from make_checkpoints import normal, norm_weight, write_checkpoint  # noqa: E402

__all__ = ["GPT_OSS_SEED", "GPT_OSS_CONFIG", "GPT_OSS_GENERATION_CONFIG", "E2M1_VALUES", "mxfp4_encode",
           "gpt_oss_tensors", "make_gpt_oss"]

GPT_OSS_SEED = 11
GPT_OSS_CONFIG = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "bos_token_id": 400,  # <|startoftext|>
    "eos_token_id": 402,  # <|return|>
    "experts_per_token": 2,  # the release writes both spellings
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_types": ["sliding_attention", "full_attention"],
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "output_router_logits": False,
    "pad_token_id": 401,  # <|endoftext|>
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-5,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 8,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 512,
}
GPT_OSS_GENERATION_CONFIG = {"bos_token_id": 400, "do_sample": True, "eos_token_id": [402, 401, 403],
                             "pad_token_id": 401, "transformers_version": "4.55.0.dev0"}

# Widths chosen for what they exercise (measured on this seed: see tests/models/test_gpt_oss_model.py).
EMBED_STD = 1.0
ATTN_STD = 0.15        # q/k/v/o weights: attention far from uniform, so the window and rope matter
ATTN_BIAS_STD = 0.1
SINK_STD = 1.0         # comparable to log(#keys): the sink column takes a real share of the softmax
ROUTER_STD, ROUTER_BIAS_STD = 0.2, 0.5
GATE_UP_STD = 0.6      # gate_up pre-activations std ~5: some exceed the limit 7
GATE_UP_BIAS_STD = 1.0
DOWN_STD = 0.02
DOWN_BIAS_STD = 0.1
LM_HEAD_STD = 0.1

# E2M1 magnitudes by 3-bit code; bit 3 is the sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """f32[..., out, in] -> (blocks u8[..., out, in/32, 16], scales u8[..., out, in/32]).

    One E8M0 scale per 32 consecutive `in` values: 2^(floor(log2 amax) - 2), so amax / scale lies in
    [4, 8) and the largest magnitude rounds to 4 or 6. Each value takes the nearest e2m1 code (ties to the
    lower code, by argmin), sign in bit 3; element 2j goes to the low nibble of byte j.
    """
    *lead, n_in = w.shape
    g = w.reshape(*lead, n_in // 32, 32).astype(np.float32)
    amax = np.abs(g).max(-1)
    exp = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127).astype(np.int32)
    exp = np.clip(exp, -127, 127)
    scaled = g / np.ldexp(np.float32(1.0), exp)[..., None].astype(np.float32)
    mag = np.argmin(np.abs(np.abs(scaled)[..., None] - E2M1_VALUES), axis=-1).astype(np.uint8)
    codes = mag | (np.signbit(scaled).astype(np.uint8) << 3)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exp + 127).astype(np.uint8)


def _expert_weight(rng: np.random.Generator, shape, std: float) -> np.ndarray:
    # Each 32-group gets its own octave (x 1/4 .. x 2), so the scales span several exponents.
    e, out, n_in = shape
    octave = rng.integers(-2, 2, size=(e, out, n_in // 32, 1)).astype(np.float32)
    w = normal(rng, (e, out, n_in // 32, 32), std) * np.exp2(octave)
    return w.reshape(shape).astype(np.float32)


def gpt_oss_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random HF-named tensors ([out, in] layout; experts MXFP4), drawn in module order from one rng."""
    rng = np.random.default_rng(seed)
    d, inter, vocab, hd = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["head_dim"]
    n_exp = config["num_local_experts"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": normal(rng, (vocab, d), EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm_weight(rng, d)
        for name, (o, n_in) in [("q_proj", (q_out, d)), ("k_proj", (kv_out, d)),
                                ("v_proj", (kv_out, d)), ("o_proj", (d, q_out))]:
            t[p + f"self_attn.{name}.weight"] = normal(rng, (o, n_in), ATTN_STD)
            t[p + f"self_attn.{name}.bias"] = normal(rng, (o,), ATTN_BIAS_STD)
        t[p + "self_attn.sinks"] = normal(rng, (config["num_attention_heads"],), SINK_STD)
        t[p + "post_attention_layernorm.weight"] = norm_weight(rng, d)
        t[p + "mlp.router.weight"] = normal(rng, (n_exp, d), ROUTER_STD)
        t[p + "mlp.router.bias"] = normal(rng, (n_exp,), ROUTER_BIAS_STD)
        # out x in as stored: gate_up [E, 2I, H] (rows interleaved gate/up), down [E, H, I]
        for name, shape, std, bias_std in [("gate_up_proj", (n_exp, 2 * inter, d), GATE_UP_STD, GATE_UP_BIAS_STD),
                                           ("down_proj", (n_exp, d, inter), DOWN_STD, DOWN_BIAS_STD)]:
            blocks, scales = mxfp4_encode(_expert_weight(rng, shape, std))
            t[p + f"mlp.experts.{name}_blocks"] = blocks
            t[p + f"mlp.experts.{name}_scales"] = scales
            t[p + f"mlp.experts.{name}_bias"] = normal(rng, shape[:2], bias_std)
    t["model.norm.weight"] = norm_weight(rng, d)
    t["lm_head.weight"] = normal(rng, (vocab, d), LM_HEAD_STD)
    return t


def make_gpt_oss(out_dir) -> Path:
    """Tiny GPT-OSS checkpoint (vocab 512, hidden 64, 2 layers sliding/full, GQA 4/2, 4 experts top-2, MXFP4)."""
    return write_checkpoint(out_dir, GPT_OSS_CONFIG, gpt_oss_tensors(GPT_OSS_CONFIG, GPT_OSS_SEED),
                            GPT_OSS_GENERATION_CONFIG)


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/checkpoints_small.py (scale=small): the widths over the tiny config (over the shared Llama-like ones
# where SMALL_BASE says so), and the stds wider than initializer_range that it rescales
SMALL_BASE = None
# 8 experts top-2 (the 20b: 32 top-4), hidden = intermediate as released (512: MXFP4 groups of 32 divide
# both), GQA 8/2, sliding/full alternating with the release's window of 128; YaRN as released
SMALL_OVERRIDES = {"hidden_size": 512, "intermediate_size": 512, "num_hidden_layers": 12, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": 8, "num_experts_per_tok": 2,
                   "experts_per_token": 2, "layer_types": ["sliding_attention", "full_attention"] * 6,
                   "sliding_window": 128, "vocab_size": 32000}
SMALL_WIDE_STDS = ('ATTN_STD', 'ROUTER_STD', 'GATE_UP_STD', 'DOWN_STD')
