"""Tiny Mistral checkpoint (7B-Instruct-v0.2 format) in the release's HF layout, from numpy.

config.json has the release's keys (no head_dim, rope_theta 1e6, untied lm_head) with small dims and
one change: the release's `sliding_window: null` becomes 16, so that sequences past 16 tokens (the
logits checks use 33, training rows reach 64) cross the window. Special tokens 400 <unk>, 401 <s>,
402 </s>. `python tools/make_checkpoints.py mistral` reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from make_checkpoints import normal, norm_weight, write_checkpoint  # noqa: E402

__all__ = ["MISTRAL_SEED", "MISTRAL_CONFIG", "MISTRAL_GENERATION_CONFIG", "mistral_tensors", "make_mistral"]

MISTRAL_SEED = 5
MISTRAL_CONFIG = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 401,  # <s>
    "eos_token_id": 402,  # </s>
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "model_type": "mistral",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": 16,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "vocab_size": 512,
}
MISTRAL_GENERATION_CONFIG = {"bos_token_id": 401, "eos_token_id": 402}
LM_HEAD_STD = 0.1  # wider than initializer_range so LoRA can move the logits (see make_checkpoints.LLAMA3_LM_HEAD_STD)


def mistral_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random HF-named tensors ([out, in] layout), drawn in module order from one rng."""
    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    t = {"model.embed_tokens.weight": normal(rng, (vocab, d), std)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape in [("q_proj", (q_out, d)), ("k_proj", (kv_out, d)),
                            ("v_proj", (kv_out, d)), ("o_proj", (d, q_out))]:
            t[p + f"self_attn.{name}.weight"] = normal(rng, shape, std)
        for name, shape in [("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))]:
            t[p + f"mlp.{name}.weight"] = normal(rng, shape, std)
        t[p + "input_layernorm.weight"] = norm_weight(rng, d)
        t[p + "post_attention_layernorm.weight"] = norm_weight(rng, d)
    t["model.norm.weight"] = norm_weight(rng, d)
    t["lm_head.weight"] = normal(rng, (vocab, d), LM_HEAD_STD)
    return t


def make_mistral(out_dir) -> Path:
    """Tiny Mistral checkpoint (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 16, window 16)."""
    return write_checkpoint(out_dir, MISTRAL_CONFIG, mistral_tensors(MISTRAL_CONFIG, MISTRAL_SEED),
                            MISTRAL_GENERATION_CONFIG)


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: special tokens (ids 400.. in this order) and what tokenizer_config.json names
# Mistral-7B v0.1/v0.2: bos <s>, eos </s>, no pad
TOKENIZER = {"specials": ("<unk>", "<s>", "</s>"), "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}

# tools/checkpoints_small.py (scale=small): the widths over the tiny config (over the shared Llama-like ones
# where SMALL_BASE says so), and the stds wider than initializer_range that it rescales
SMALL_BASE = "llama_like"
# a window of 256: 512-token sequences cross it (tiny: 16 against 33 / 64)
SMALL_OVERRIDES = {"sliding_window": 256}
