"""Tiny Qwen3 checkpoint (Qwen3-0.6B format) in the release's HF layout, from numpy.

config.json has the release's keys (explicit head_dim, attention_bias false, `rope_scaling: null`,
rope_theta 1e6, RMSNorm eps 1e-6, tied embeddings, so no lm_head.weight, `use_sliding_window: false`
with `sliding_window: null`) with small dims. head_dim is 32 while hidden / heads is 16, as the
0.6B's 128 differs from 1024 / 16, so a port that derives it fails. Each attention has q_norm /
k_norm weights [head_dim]. Special tokens 400 <|endoftext|>, 401 <|im_start|>, 402 <|im_end|>,
403 <think>, 404 </think>: bos <|endoftext|>, eos <|im_end|>. `python tools/make_checkpoints.py qwen3`
reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from make_checkpoints import normal, norm_weight, write_checkpoint  # noqa: E402

__all__ = ["QWEN3_SEED", "QWEN3_CONFIG", "QWEN3_GENERATION_CONFIG", "qwen3_tensors", "make_qwen3"]

QWEN3_SEED = 7
QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 400,  # <|endoftext|>
    "eos_token_id": 402,  # <|im_end|>
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 512,
}
QWEN3_GENERATION_CONFIG = {"bos_token_id": 400, "do_sample": True, "eos_token_id": [402, 400], "pad_token_id": 400,
                           "temperature": 0.6, "top_k": 20, "top_p": 0.95}
EMBED_STD = 0.1  # tied: the embedding is also the output head, drawn wide enough for LoRA to learn through it


def qwen3_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random HF-named tensors ([out, in] layout), drawn in module order from one rng."""
    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    d, inter, vocab, hd = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["head_dim"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": normal(rng, (vocab, d), EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in [("q_proj", (q_out, d)), ("k_proj", (kv_out, d)),
                            ("v_proj", (kv_out, d)), ("o_proj", (d, q_out))]:
            t[p + f"self_attn.{name}.weight"] = normal(rng, shape, std)
        t[p + "self_attn.q_norm.weight"] = norm_weight(rng, hd)
        t[p + "self_attn.k_norm.weight"] = norm_weight(rng, hd)
        for name, shape in [("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))]:
            t[p + f"mlp.{name}.weight"] = normal(rng, shape, std)
        t[p + "input_layernorm.weight"] = norm_weight(rng, d)
        t[p + "post_attention_layernorm.weight"] = norm_weight(rng, d)
    t["model.norm.weight"] = norm_weight(rng, d)
    return t


def make_qwen3(out_dir) -> Path:
    """Tiny Qwen3 checkpoint (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 32, tied)."""
    return write_checkpoint(out_dir, QWEN3_CONFIG, qwen3_tensors(QWEN3_CONFIG, QWEN3_SEED), QWEN3_GENERATION_CONFIG)


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: special tokens (ids 400.. in this order) and what tokenizer_config.json names
# Qwen3-0.6B: no bos, eos <|im_end|>, pad <|endoftext|>
TOKENIZER = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"), "bos_token": None,
             "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

# tools/checkpoints_small.py (scale=small): the widths over the tiny config (over the shared Llama-like ones
# where SMALL_BASE says so), and the stds wider than initializer_range that it rescales
SMALL_BASE = "llama_like"
# head_dim 128 != hidden / heads (96), as the 0.6B's 128 != 1024 / 16
SMALL_OVERRIDES = {"num_attention_heads": 8, "head_dim": 128, "max_window_layers": 12}
