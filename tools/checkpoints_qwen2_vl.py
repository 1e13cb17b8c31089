"""Tiny Qwen2-VL checkpoint (Qwen2-VL-2B-Instruct's format) in the release's HF layout, from numpy.

config.json has the release's keys: flat text keys, `rope_scaling: {type: mrope, mrope_section}`, a `vision_config`
with the release's legacy `in_chans` / `spatial_patch_size`, tied embeddings; tensors `model.*` (the Qwen2 language
model, drawn by tools/checkpoints_qwen2.py's generator) and `visual.*` (`qwen2_vl_tower_tensors`). Token ids:
tools/make_vl_checkpoints.py. `python tools/make_checkpoints.py qwen2_vl` reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from checkpoints_qwen2 import qwen2_tensors  # noqa: E402
from make_checkpoints import normal, norm_weight, write_checkpoint  # noqa: E402
from make_vl_checkpoints import VL_IDS  # noqa: E402

__all__ = ["QWEN2_VL_SEED", "QWEN2_VL_CONFIG", "QWEN2_VL_GENERATION_CONFIG", "qwen2_vl_tower_tensors",
           "qwen2_vl_tensors", "make_qwen2_vl"]

QWEN2_VL_SEED = 21
QWEN2_VL_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": VL_IDS["<|endoftext|>"],
    "eos_token_id": VL_IDS["<|im_end|>"],
    "vision_start_token_id": VL_IDS["<|vision_start|>"],
    "vision_end_token_id": VL_IDS["<|vision_end|>"],
    "vision_token_id": VL_IDS["<|vision_pad|>"],
    "image_token_id": VL_IDS["<|image_pad|>"],
    "video_token_id": VL_IDS["<|video_pad|>"],
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "model_type": "qwen2_vl",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    # the tiny tower: 2 blocks of width 32, 4 heads, merged 2x2 into the language model's width
    "vision_config": {"depth": 2, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 4, "in_chans": 3, "hidden_size": 64,
                      "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # 8 rotary pairs of head_dim 16
    "vocab_size": 512,
}
QWEN2_VL_GENERATION_CONFIG = {"bos_token_id": VL_IDS["<|endoftext|>"], "do_sample": False,
                              "eos_token_id": [VL_IDS["<|im_end|>"], VL_IDS["<|endoftext|>"]],
                              "pad_token_id": VL_IDS["<|endoftext|>"]}
PATCH_STD = 0.05  # a 1176-wide patch: small enough that the tower's activations stay O(1)
BIAS_STD = 0.05


def qwen2_vl_tower_tensors(rng: np.random.Generator, vc: dict, out_hidden: int, std: float) -> dict[str, np.ndarray]:
    """Qwen2-VL's ViT (`visual.*`): Conv3d patch embed (no bias), LayerNorm blocks with a fused qkv and a
    quick-GELU fc1/fc2 MLP, and the merger (ln_q, then a 2-layer MLP over 2x2 merged patches)."""
    e, ps, tp, m = vc["embed_dim"], vc["patch_size"], vc["temporal_patch_size"], vc["spatial_merge_size"]
    hidden, merged = e * vc["mlp_ratio"], e * m * m
    t = {"visual.patch_embed.proj.weight": normal(rng, (e, vc["in_chans"], tp, ps, ps), PATCH_STD)}
    for i in range(vc["depth"]):
        p = f"visual.blocks.{i}."
        for norm in ("norm1", "norm2"):
            t[p + f"{norm}.weight"], t[p + f"{norm}.bias"] = norm_weight(rng, e), normal(rng, (e,), BIAS_STD)
        for name, (o, i_) in (("attn.qkv", (3 * e, e)), ("attn.proj", (e, e)), ("mlp.fc1", (hidden, e)),
                              ("mlp.fc2", (e, hidden))):
            t[p + f"{name}.weight"], t[p + f"{name}.bias"] = normal(rng, (o, i_), std), normal(rng, (o,), BIAS_STD)
    t["visual.merger.ln_q.weight"], t["visual.merger.ln_q.bias"] = norm_weight(rng, e), normal(rng, (e,), BIAS_STD)
    for name, (o, i_) in (("mlp.0", (merged, merged)), ("mlp.2", (out_hidden, merged))):
        t[f"visual.merger.{name}.weight"] = normal(rng, (o, i_), std)
        t[f"visual.merger.{name}.bias"] = normal(rng, (o,), BIAS_STD)
    return t


def qwen2_vl_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The Qwen2 language model's tensors (its generator, this seed), then the tower's from the same stream."""
    t = qwen2_tensors(config, seed)
    rng = np.random.default_rng([seed, 1])
    t.update(qwen2_vl_tower_tensors(rng, config["vision_config"], config["hidden_size"], 0.1))
    return t


def make_qwen2_vl(out_dir) -> Path:
    """Tiny Qwen2-VL (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 16, M-RoPE [2,3,3], tied; tower 2 x 32)."""
    return write_checkpoint(out_dir, QWEN2_VL_CONFIG, qwen2_vl_tensors(QWEN2_VL_CONFIG, QWEN2_VL_SEED),
                            QWEN2_VL_GENERATION_CONFIG)




# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: Qwen2-VL's special tokens in the release's order from 400 (tools/make_vl_checkpoints.py
# VL_SPECIALS, spelled out: the table is read as a literal); the Instruct release: no bos, eos <|im_end|>,
# pad <|endoftext|>
TOKENIZER = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                          "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                          "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
             "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

# tools/checkpoints_small.py (scale=small): Qwen2's Llama-like widths (GQA 12/2, head_dim 64, so M-RoPE's sections
# scale to [8, 12, 12] of 32 rotary pairs, Qwen2-VL-2B's [16, 24, 24] of 64 halved) and a 4-block tower of width
# 256 whose merger projects into the 768-wide language model
SMALL_BASE = "llama_like"
SMALL_OVERRIDES = {"num_key_value_heads": 2, "max_window_layers": 12, "sliding_window": 2048,
                   "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
                   "vision_config": {**QWEN2_VL_CONFIG["vision_config"], "depth": 4, "embed_dim": 256, "num_heads": 4,
                                     "hidden_size": 768}}

