"""Tiny StarCoder2 checkpoint in the release's HF format, from numpy.

`make_starcoder2(out_dir)` writes config.json, generation_config.json and model.safetensors with
bigcode/starcoder2-3b's config keys and tensor names: biased LayerNorms, biased q/k/v/o and
`mlp.c_fc` / `mlp.c_proj`, and no `lm_head.weight` (the config leaves `tie_word_embeddings` at
transformers' default, True). The release's dropouts (0.1) are set to 0.0: the models here have no
dropout, so a transformers model in train mode stays comparable. sliding_window is 16, so that the
longer training rows (up to 64 tokens) and the 33-token logits checks run past it.

Weights come from one `np.random.default_rng(STARCODER2_SEED)` drawn in module order, so
`python tools/make_checkpoints.py starcoder2` reproduces the files byte for byte.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

__all__ = ["STARCODER2_SEED", "STARCODER2_CONFIG", "STARCODER2_GENERATION_CONFIG", "starcoder2_tensors",
           "make_starcoder2"]


def _tools():
    # tools/ is not a package: the shared helpers are loaded by path.
    spec = importlib.util.spec_from_file_location("make_checkpoints", Path(__file__).with_name("make_checkpoints.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


STARCODER2_SEED = 52
# bigcode/starcoder2-3b config.json keys (dims shrunk; the special token is this repo's id 400).
STARCODER2_CONFIG = {
    "architectures": ["Starcoder2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 400,  # <|endoftext|>
    "embedding_dropout": 0.0,
    "eos_token_id": 400,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "mlp_type": "default",
    "model_type": "starcoder2",
    "norm_epsilon": 1e-05,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "residual_dropout": 0.0,
    "rope_theta": 999999.4420358813,  # the release's value
    "sliding_window": 16,
    "torch_dtype": "float32",
    "use_bias": True,
    "use_cache": True,
    "vocab_size": 512,
}
STARCODER2_GENERATION_CONFIG = {"bos_token_id": 400, "eos_token_id": 400}

# Tied head: the embedding is the output head too, drawn wide enough (std 0.1) for LoRA to learn.
STARCODER2_EMBED_STD = 0.1
BIAS_STD = 0.02  # projection biases: nonzero, so a dropped bias shows
# The input projections (q/k/v_proj, c_fc) wider than initializer_range: attention scores of order 1, so
# that RoPE and the sliding window shape the logits (at 0.02 the attention is near uniform), and c_fc
# pre-activations of std ~1.6, where gelu_pytorch_tanh and the exact (erf) GELU differ most (~1e-4
# relative; at 0.02 they agree to ~1e-6).
IN_PROJ_STD = 0.2
NORM_BIAS_STD = 0.1  # LayerNorm biases


def starcoder2_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random HF-named StarCoder2 tensors ([out, in] layout), drawn in module order from one rng."""
    tools = _tools()
    normal, norm_weight = tools.normal, tools.norm_weight
    rng = np.random.default_rng(seed)
    std = config["initializer_range"]
    d, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def linear(name, out_f, in_f, w_std=std):
        t[name + ".weight"] = normal(rng, (out_f, in_f), w_std)
        t[name + ".bias"] = normal(rng, (out_f,), BIAS_STD)

    def norm(name):
        t[name + ".weight"] = norm_weight(rng, d)
        t[name + ".bias"] = normal(rng, (d,), NORM_BIAS_STD)

    t = {"model.embed_tokens.weight": normal(rng, (vocab, d), STARCODER2_EMBED_STD)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        norm(p + "input_layernorm")
        for name, out_f, in_f, w_std in [("q_proj", q_out, d, IN_PROJ_STD), ("k_proj", kv_out, d, IN_PROJ_STD),
                                         ("v_proj", kv_out, d, IN_PROJ_STD), ("o_proj", d, q_out, std)]:
            linear(p + f"self_attn.{name}", out_f, in_f, w_std)
        norm(p + "post_attention_layernorm")
        linear(p + "mlp.c_fc", inter, d, IN_PROJ_STD)
        linear(p + "mlp.c_proj", d, inter)
    norm("model.norm")
    return t


def make_starcoder2(out_dir) -> Path:
    """Tiny StarCoder2-format checkpoint (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 16, window 16)."""
    tensors = starcoder2_tensors(STARCODER2_CONFIG, STARCODER2_SEED)
    return _tools().write_checkpoint(out_dir, STARCODER2_CONFIG, tensors, STARCODER2_GENERATION_CONFIG)


if __name__ == "__main__":
    print(make_starcoder2(Path(__file__).resolve().parents[1] / "assets" / "checkpoints" / "starcoder2"))


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: special tokens (ids 400.. in this order) and what tokenizer_config.json names
# bigcode/starcoder2: bos = eos = <|endoftext|>, no pad
TOKENIZER = {"specials": ("<|endoftext|>",), "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}

# tools/checkpoints_small.py (scale=small): the widths over the tiny config (over the shared Llama-like ones
# where SMALL_BASE says so), and the stds wider than initializer_range that it rescales
SMALL_BASE = "llama_like"
SMALL_OVERRIDES = {"intermediate_size": 3072, "sliding_window": 256}
SMALL_WIDE_STDS = ('IN_PROJ_STD',)
