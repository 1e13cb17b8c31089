"""Tiny BLOOM checkpoint in the release's HF format (bigscience/bloom-560m), from numpy.

`make_bloom(out_dir)` writes config.json (the keys of bloom-560m's config.json), generation_config.json
and model.safetensors with the names and [out, in] layouts `BloomForCausalLM.save_pretrained` writes:
everything under `transformer.`, a fused per-head-interleaved `query_key_value` [3h, h] with bias, a
`word_embeddings_layernorm`, biased LayerNorms and projections, and no `lm_head.weight` (tied).
6 heads, not a power of two, so the extra ALiBi slopes are used. Byte-reproducible.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from make_checkpoints import norm_weight, normal, write_checkpoint  # noqa: E402

__all__ = ["BLOOM_SEED", "BLOOM_CONFIG", "BLOOM_GENERATION_CONFIG", "bloom_tensors", "make_bloom"]

BLOOM_SEED = 5
# bloom-560m's config.json keys (minus `_name_or_path` and `transformers_version`, which name the
# upload, not the model), tiny dims; special ids 400 <unk>, 401 <s>, 402 </s>, 403 <pad>.
BLOOM_CONFIG = {
    "apply_residual_connection_post_layernorm": False,
    "architectures": ["BloomForCausalLM"],
    "attention_dropout": 0.0,
    "attention_softmax_in_fp32": True,
    "bias_dropout_fusion": True,
    "bos_token_id": 401,
    "eos_token_id": 402,
    "hidden_dropout": 0.0,
    "hidden_size": 96,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "masked_softmax_fusion": True,
    "model_type": "bloom",
    "n_head": 6,  # head_dim 16; 6 is not a power of two: heads 4, 5 take the extra slopes
    "n_inner": None,
    "n_layer": 2,
    "offset_alibi": 100,
    "pad_token_id": 403,
    "pretraining_tp": 1,
    "skip_bias_add": True,
    "skip_bias_add_qkv": False,
    "slow_but_exact": False,
    "unk_token_id": 400,
    "use_cache": True,
    "vocab_size": 512,
}
BLOOM_GENERATION_CONFIG = {
    "_from_model_config": True,
    "bos_token_id": 401,
    "eos_token_id": 402,
    "pad_token_id": 403,
}
# Tied head: the embedding is drawn wide (std 0.1) so that the head can learn (see LLAMA3_LM_HEAD_STD).
BLOOM_EMBED_STD = 0.1
# query_key_value and dense_h_to_4h are drawn wider than initializer_range, so that attention scores are
# O(1) (not near-uniform) and GELU's inputs reach its curved range |x| ~ 1: at std 0.02 an exact GELU in
# place of the tanh one moves the logits by only 1e-5.
BLOOM_WIDE_STD = 0.1


def _layer_norm(rng, t: dict, name: str, dim: int) -> None:
    # weight 1 + N(0, 0.1), bias N(0, 0.1): a dropped weight or bias shows in the logits.
    t[name + ".weight"] = norm_weight(rng, dim)
    t[name + ".bias"] = normal(rng, (dim,), 0.1)


def _linear(rng, t: dict, name: str, out_dim: int, in_dim: int, std: float) -> None:
    t[name + ".weight"] = normal(rng, (out_dim, in_dim), std)
    t[name + ".bias"] = normal(rng, (out_dim,), std)


def bloom_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Random HF-named BLOOM tensors ([out, in] layout), drawn in module order from one rng."""
    rng = np.random.default_rng(seed)
    std, d, vocab = config["initializer_range"], config["hidden_size"], config["vocab_size"]
    t = {"transformer.word_embeddings.weight": normal(rng, (vocab, d), BLOOM_EMBED_STD)}
    _layer_norm(rng, t, "transformer.word_embeddings_layernorm", d)
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}."
        _layer_norm(rng, t, p + "input_layernorm", d)
        _linear(rng, t, p + "self_attention.query_key_value", 3 * d, d, BLOOM_WIDE_STD)  # rows: per head [q; k; v]
        _linear(rng, t, p + "self_attention.dense", d, d, std)
        _layer_norm(rng, t, p + "post_attention_layernorm", d)
        _linear(rng, t, p + "mlp.dense_h_to_4h", 4 * d, d, BLOOM_WIDE_STD)
        _linear(rng, t, p + "mlp.dense_4h_to_h", d, 4 * d, std)
    _layer_norm(rng, t, "transformer.ln_f", d)
    return t


def make_bloom(out_dir) -> Path:
    """Tiny bloom-560m-format checkpoint (vocab 512, hidden 96, 6 heads of 16, 2 layers, tied head)."""
    return write_checkpoint(out_dir, BLOOM_CONFIG, bloom_tensors(BLOOM_CONFIG, BLOOM_SEED), BLOOM_GENERATION_CONFIG)


if __name__ == "__main__":
    print(make_bloom(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
                     / "assets" / "checkpoints" / "bloom"))


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: special tokens (ids 400.. in this order) and what tokenizer_config.json names
# bigscience/bloom: <unk> <s> </s> <pad> lead its vocab, all four named in the config
TOKENIZER = {"specials": ("<unk>", "<s>", "</s>", "<pad>"), "bos_token": "<s>", "eos_token": "</s>",
             "pad_token": "<pad>", "unk_token": "<unk>"}

# tools/checkpoints_small.py (scale=small): the widths over the tiny config (over the shared Llama-like ones
# where SMALL_BASE says so), and the stds wider than initializer_range that it rescales
SMALL_BASE = None
# 12 heads: not a power of two, so the extra ALiBi slopes stay in use; MLP 4 x hidden (fixed by BLOOM)
SMALL_OVERRIDES = {"hidden_size": 768, "n_head": 12, "n_layer": 12, "vocab_size": 32000}
SMALL_WIDE_STDS = ('BLOOM_WIDE_STD',)
