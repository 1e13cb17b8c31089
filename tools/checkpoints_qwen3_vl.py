"""Tiny Qwen3-VL checkpoint (Qwen3-VL-2B-Instruct's format) in the release's HF layout, from numpy.

config.json has the release's keys: a nested `text_config` with explicit head_dim, `rope_scaling: {rope_type:
default, mrope_section, mrope_interleaved: true}` + rope_theta 5e6 and its own copy of the tie, a `vision_config`
with the release's legacy `model_type: qwen3_vl`, tied embeddings at the top level; tensors
`model.language_model.*` (the Qwen3 language model, drawn by tools/checkpoints_qwen3.py's generator and re-prefixed)
and `model.visual.*` (`qwen3_vl_tower_tensors`), no lm_head. deepstack_visual_indexes [0, 1]: both tower blocks
feed a deepstack merger, whose features join the image rows after both decoder layers. Token ids:
tools/make_vl_checkpoints.py. `python tools/make_checkpoints.py qwen3_vl` reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from checkpoints_qwen3 import qwen3_tensors  # noqa: E402
from make_checkpoints import normal, norm_weight, write_checkpoint  # noqa: E402
from make_vl_checkpoints import VL_IDS  # noqa: E402

__all__ = ["QWEN3_VL_SEED", "QWEN3_VL_CONFIG", "QWEN3_VL_GENERATION_CONFIG", "qwen3_vl_tower_tensors",
           "qwen3_vl_tensors", "make_qwen3_vl"]

QWEN3_VL_SEED = 31
QWEN3_VL_CONFIG = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": VL_IDS["<|image_pad|>"],
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": VL_IDS["<|endoftext|>"],
        "dtype": "float32",
        "eos_token_id": VL_IDS["<|im_end|>"],
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        # 8 rotary pairs of head_dim 16, interleaved t h w t h w t t (transformers reads only the h and w counts)
        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "use_cache": True,
        "vocab_size": 512,
    },
    "tie_word_embeddings": True,
    "video_token_id": VL_IDS["<|video_pad|>"],
    # the tiny tower: 2 blocks of width 32, 4 heads, an 8x8 learned position grid, merged 2x2 into the LM's width
    "vision_config": {"deepstack_visual_indexes": [0, 1], "depth": 2, "dtype": "float32",
                      "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "in_channels": 3, "initializer_range": 0.02,
                      "intermediate_size": 64, "model_type": "qwen3_vl", "num_heads": 4, "num_position_embeddings": 64,
                      "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "vision_end_token_id": VL_IDS["<|vision_end|>"],
    "vision_start_token_id": VL_IDS["<|vision_start|>"],
}
QWEN3_VL_GENERATION_CONFIG = {"bos_token_id": VL_IDS["<|endoftext|>"], "do_sample": True,
                              "eos_token_id": [VL_IDS["<|im_end|>"], VL_IDS["<|endoftext|>"]],
                              "pad_token_id": VL_IDS["<|endoftext|>"], "repetition_penalty": 1.0, "temperature": 0.7,
                              "top_k": 20, "top_p": 0.8}
PATCH_STD = 0.03  # a 1536-wide patch: unit pixels embed at about 1
POS_STD = 0.5  # the learned position table: comparable to the patch embedding, so a misplaced tap shows
BIAS_STD = 0.05
TOWER_STD = 0.1  # the blocks and the mergers: merged tokens and deepstack features O(1)


def qwen3_vl_tower_tensors(rng: np.random.Generator, vc: dict, std: float) -> dict[str, np.ndarray]:
    """Qwen3-VL's ViT (`model.visual.*`): Conv3d patch embed with bias, the learned position table, LayerNorm blocks
    with a fused qkv and a linear_fc1/linear_fc2 MLP, the merger (norm per patch) and one deepstack merger (norm
    over the 2x2 merged patches) per deepstack index."""
    e, ps, tp, m = vc["hidden_size"], vc["patch_size"], vc["temporal_patch_size"], vc["spatial_merge_size"]
    inter, merged, out = vc["intermediate_size"], e * m * m, vc["out_hidden_size"]
    v = "model.visual."
    t = {v + "patch_embed.proj.weight": normal(rng, (e, vc["in_channels"], tp, ps, ps), PATCH_STD),
         v + "patch_embed.proj.bias": normal(rng, (e,), BIAS_STD),
         v + "pos_embed.weight": normal(rng, (vc["num_position_embeddings"], e), POS_STD)}
    for i in range(vc["depth"]):
        p = f"{v}blocks.{i}."
        for norm in ("norm1", "norm2"):
            t[p + f"{norm}.weight"], t[p + f"{norm}.bias"] = norm_weight(rng, e), normal(rng, (e,), BIAS_STD)
        for name, (o, i_) in (("attn.qkv", (3 * e, e)), ("attn.proj", (e, e)), ("mlp.linear_fc1", (inter, e)),
                              ("mlp.linear_fc2", (e, inter))):
            t[p + f"{name}.weight"], t[p + f"{name}.bias"] = normal(rng, (o, i_), std), normal(rng, (o,), BIAS_STD)
    mergers = [(f"{v}merger.", e)] + [(f"{v}deepstack_merger_list.{j}.", merged)
                                      for j in range(len(vc["deepstack_visual_indexes"]))]
    for p, norm_dim in mergers:
        t[p + "norm.weight"], t[p + "norm.bias"] = norm_weight(rng, norm_dim), normal(rng, (norm_dim,), BIAS_STD)
        for name, (o, i_) in (("linear_fc1", (merged, merged)), ("linear_fc2", (out, merged))):
            t[p + f"{name}.weight"], t[p + f"{name}.bias"] = normal(rng, (o, i_), std), normal(rng, (o,), BIAS_STD)
    return t


def qwen3_vl_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The Qwen3 language model's tensors (its generator on text_config, this seed) under `model.language_model.`,
    then the tower's from a second stream."""
    lm = qwen3_tensors(config["text_config"], seed)
    t = {"model.language_model." + name.removeprefix("model."): w for name, w in lm.items()}
    t.update(qwen3_vl_tower_tensors(np.random.default_rng([seed, 1]), config["vision_config"], TOWER_STD))
    return t


def make_qwen3_vl(out_dir) -> Path:
    """Tiny Qwen3-VL (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 16, interleaved M-RoPE [4,2,2], tied; tower
    2 x 32, patch 16, 8x8 positions, deepstack [0, 1])."""
    return write_checkpoint(out_dir, QWEN3_VL_CONFIG, qwen3_vl_tensors(QWEN3_VL_CONFIG, QWEN3_VL_SEED),
                            QWEN3_VL_GENERATION_CONFIG)


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: Qwen3-VL's special tokens in the release's order from 400 (151643.. there: the Qwen-VL
# tokens of tools/make_vl_checkpoints.py VL_SPECIALS, then the tool-call, FIM and thinking tokens, so <think> is 424
# as 151667 is; spelled out: the table is read as a literal); the Instruct release: no bos, eos <|im_end|>, pad
# <|endoftext|>
TOKENIZER = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                          "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                          "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                          "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                          "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>",
                          "</think>"),
             "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

# tools/checkpoints_small.py (scale=small): the release nests the text keys, so the small row replaces text_config
# whole (Qwen3's small widths: hidden 768, 12 layers, GQA 8/4 with head_dim 128 as the 0.6B's; the interleaved M-RoPE
# sections scaled to its 64 rotary pairs as Qwen3-VL-2B's [24, 20, 20]) and a 4-block tower of width 256 projecting
# into 768 (deepstack after blocks 0 and 1, a 16x16 position table)
SMALL_OVERRIDES = {
    "text_config": {**QWEN3_VL_CONFIG["text_config"], "hidden_size": 768, "intermediate_size": 2048,
                    "num_hidden_layers": 12, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
                    "vocab_size": 32000, "max_position_embeddings": 2048,
                    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"}},
    "vision_config": {**QWEN3_VL_CONFIG["vision_config"], "depth": 4, "hidden_size": 256, "intermediate_size": 1024,
                      "num_position_embeddings": 256, "out_hidden_size": 768},
}
