"""Tiny Qwen2.5 checkpoint (Qwen2.5-0.5B format) in the release's HF layout, from numpy.

config.json has the release's keys (rope_theta 1e6, RMSNorm eps 1e-6, tied embeddings, so no
lm_head.weight; `use_sliding_window: false` with `sliding_window` / `max_window_layers` kept as the
release sets them: the context length and the layer count) with small dims. q/k/v carry biases,
o_proj does not. Special tokens 400 <|endoftext|>, 401 <|im_start|>, 402 <|im_end|>; the base
model's bos and eos are both <|endoftext|>. `python tools/make_checkpoints.py qwen2` reproduces the
files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from make_checkpoints import normal, norm_weight, write_checkpoint  # noqa: E402

__all__ = ["QWEN2_SEED", "QWEN2_CONFIG", "QWEN2_GENERATION_CONFIG", "qwen2_tensors", "make_qwen2"]

QWEN2_SEED = 6
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 400,  # <|endoftext|>
    "eos_token_id": 400,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "max_window_layers": 2,
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 256,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 512,
}
QWEN2_GENERATION_CONFIG = {"bos_token_id": 400, "do_sample": False, "eos_token_id": 400}
EMBED_STD = 0.1  # tied: the embedding is also the output head, drawn wide enough for LoRA to learn through it
BIAS_STD = 0.1   # q/k/v biases clearly nonzero (the released ones are large), so a dropped one shows


def qwen2_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random HF-named tensors ([out, in] layout), drawn in module order from one rng."""
    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": normal(rng, (vocab, d), EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, out in [("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)]:
            t[p + f"self_attn.{name}.weight"] = normal(rng, (out, d), std)
            t[p + f"self_attn.{name}.bias"] = normal(rng, (out,), BIAS_STD)
        t[p + "self_attn.o_proj.weight"] = normal(rng, (d, q_out), std)
        for name, shape in [("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))]:
            t[p + f"mlp.{name}.weight"] = normal(rng, shape, std)
        t[p + "input_layernorm.weight"] = norm_weight(rng, d)
        t[p + "post_attention_layernorm.weight"] = norm_weight(rng, d)
    t["model.norm.weight"] = norm_weight(rng, d)
    return t


def make_qwen2(out_dir) -> Path:
    """Tiny Qwen2.5 checkpoint (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 16, tied)."""
    return write_checkpoint(out_dir, QWEN2_CONFIG, qwen2_tensors(QWEN2_CONFIG, QWEN2_SEED), QWEN2_GENERATION_CONFIG)


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: special tokens (ids 400.. in this order) and what tokenizer_config.json names
# the Qwen2 base releases: no bos, eos = pad = <|endoftext|> (the qwen template makes <|im_end|> the eos)
TOKENIZER = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "bos_token": None,
             "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}

# tools/checkpoints_small.py (scale=small): the widths over the tiny config (over the shared Llama-like ones
# where SMALL_BASE says so), and the stds wider than initializer_range that it rescales
SMALL_BASE = "llama_like"
# GQA 12/2 like Qwen2.5-0.5B's 14/2; sliding window off as released (window = context, all layers)
SMALL_OVERRIDES = {"num_key_value_heads": 2, "max_window_layers": 12, "sliding_window": 2048}
