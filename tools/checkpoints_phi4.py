"""Tiny Phi-4 checkpoint (HF model_type "phi3") in the release's HF format, from numpy.

`make_phi4(out_dir)` writes config.json, generation_config.json and model.safetensors with microsoft/phi-4's
config keys (the legacy `rope_theta` / `rope_scaling: null` form, as the release stores it) and tensor
names: fused `self_attn.qkv_proj` [(N + 2K) * hd, D] (rows [Q | K | V]) and `mlp.gate_up_proj` [2I, D]
(rows [gate | up]), no biases, an untied `lm_head`. The RoPE is Phi-4-mini's (microsoft/Phi-4-mini-instruct):
`partial_rotary_factor` 0.75 (rotary dim 12 of head_dim 16) and `longrope` scaling in the legacy
`rope_scaling` form (`type`, six short and six long factors), with original_max_position_embeddings 32
of max_position_embeddings 256, so training rows longer than 32 tokens take the long factors and the
attention factor sqrt(1 + ln 8 / ln 32), shorter ones the short factors.

Weights come from one `np.random.default_rng(PHI4_SEED)` drawn in module order, so
`python tools/make_checkpoints.py phi4` reproduces the files byte for byte.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

__all__ = ["PHI4_SEED", "PHI4_CONFIG", "PHI4_GENERATION_CONFIG", "phi4_tensors", "make_phi4"]


def _tools():
    # tools/ is not a package: the shared helpers are loaded by path.
    spec = importlib.util.spec_from_file_location("make_checkpoints", Path(__file__).with_name("make_checkpoints.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


PHI4_SEED = 44
# microsoft/phi-4 config.json keys (dims shrunk; ids are this repo's special tokens 400..404).
PHI4_CONFIG = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 400,  # <|endoftext|>
    "embd_pdrop": 0.0,
    "eos_token_id": 402,  # <|im_end|>
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "model_type": "phi3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "original_max_position_embeddings": 32,  # Phi-4-mini: 4096 of 131072; here 32 of 256 (cutoff_len is 64)
    "pad_token_id": 404,  # <|dummy_85|>
    "partial_rotary_factor": 0.75,  # Phi-4-mini's (Phi-4 itself rotates all of head_dim)
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    # Phi-4-mini's form; the factors grow with the wavelength, as its released ones do (1.0 .. ~50 there).
    "rope_scaling": {"long_factor": [1.0, 1.25, 1.9, 3.6, 7.5, 14.0], "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.35],
                     "type": "longrope"},
    "rope_theta": 250000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 512,
}
PHI4_GENERATION_CONFIG = {"bos_token_id": 400, "eos_token_id": 402, "pad_token_id": 404}

# As llama3's: a wider output head than initializer_range, so that LoRA can move the logits.
PHI4_LM_HEAD_STD = 0.1
# The input projections (qkv_proj, gate_up_proj) wider than initializer_range: attention scores and gate
# pre-activations of order 1, so that RoPE (which channels rotate), the q/k/v split and the gate/up halves
# shape the logits. At 0.02 the attention is near uniform and these bugs move the logits by < 1e-3.
PHI4_IN_PROJ_STD = 0.2


def phi4_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random HF-named Phi-3/4 tensors ([out, in] layout), drawn in module order from one rng."""
    tools = _tools()
    normal, norm_weight = tools.normal, tools.norm_weight
    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    qkv_out = (config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * hd
    t = {"model.embed_tokens.weight": normal(rng, (vocab, d), std)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm_weight(rng, d)
        t[p + "self_attn.qkv_proj.weight"] = normal(rng, (qkv_out, d), PHI4_IN_PROJ_STD)
        t[p + "self_attn.o_proj.weight"] = normal(rng, (d, config["num_attention_heads"] * hd), std)
        t[p + "post_attention_layernorm.weight"] = norm_weight(rng, d)
        t[p + "mlp.gate_up_proj.weight"] = normal(rng, (2 * inter, d), PHI4_IN_PROJ_STD)
        t[p + "mlp.down_proj.weight"] = normal(rng, (d, inter), std)
    t["model.norm.weight"] = norm_weight(rng, d)
    t["lm_head.weight"] = normal(rng, (vocab, d), PHI4_LM_HEAD_STD)
    return t


def make_phi4(out_dir) -> Path:
    """Tiny Phi-4-format checkpoint (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 16, rotary dim 12)."""
    tensors = phi4_tensors(PHI4_CONFIG, PHI4_SEED)
    return _tools().write_checkpoint(out_dir, PHI4_CONFIG, tensors, PHI4_GENERATION_CONFIG)


if __name__ == "__main__":
    print(make_phi4(Path(__file__).resolve().parents[1] / "assets" / "checkpoints" / "phi4"))


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: special tokens (ids 400.. in this order) and what tokenizer_config.json names
# microsoft/phi-4: bos <|endoftext|>, eos <|im_end|>, pad <|dummy_85|>
TOKENIZER = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_sep|>", "<|dummy_85|>"),
             "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|dummy_85|>"}

# tools/checkpoints_small.py (scale=small): the widths over the tiny config (over the shared Llama-like ones
# where SMALL_BASE says so), and the stds wider than initializer_range that it rescales
SMALL_BASE = "llama_like"
# rotary dim 48 of head_dim 64 (partial_rotary_factor 0.75 kept): longrope's factors, one per rotary pair,
# spread over the tiny checkpoint's ranges; at the original length 2048 = max, only the short ones apply;
# factor 1.0 = max / original, written out (transformers warns once when it has to infer it)
SMALL_OVERRIDES = {"original_max_position_embeddings": 2048,
                   "rope_scaling": {"type": "longrope", "factor": 1.0,
                                    "short_factor": [1.0 + 0.35 * i / 23 for i in range(24)],
                                    "long_factor": [14.0 ** (i / 23) for i in range(24)]}}
SMALL_WIDE_STDS = ('PHI4_IN_PROJ_STD',)
