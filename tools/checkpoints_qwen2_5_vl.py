"""Tiny Qwen2.5-VL checkpoint (Qwen2.5-VL-7B-Instruct's format) in the release's HF layout, from numpy.

config.json has the release's keys: flat text keys, `rope_scaling: {type: mrope, mrope_section}` + `rope_theta`, an
untied head, and a `vision_config` with the release's legacy `in_chans` / `spatial_patch_size` / `tokens_per_second`
(transformers 5 saves the nested `text_config` form instead; both read the same). Tensors: `model.*` (the Qwen2
language model, drawn by tools/checkpoints_qwen2.py's generator), `lm_head.weight` and `visual.*` (the Qwen2.5-VL
tower: fused qkv, RMSNorm blocks with a biased SiLU-gated MLP, the merger) from a second stream; the 57 names and
shapes transformers 5.24's Qwen2_5_VLForConditionalGeneration saves. The tower's windows are 56 px (2x2 merged
tokens) with block 1 attending fully, so the shipped images (assets/images: 112x84 -> grid 6x8, 150x90 -> 6x10)
cross several windows. No preprocessor_config.json: the release's processor settings are
models/vision_processing.py's `QwenImageProcessorConfig.qwen2_vl()` (min_pixels 3136, max_pixels 12845056).
Token ids: tools/make_vl_checkpoints.py. `python tools/make_checkpoints.py qwen2_5_vl` reproduces the files byte
for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from checkpoints_qwen2 import qwen2_tensors  # noqa: E402
from make_checkpoints import normal, norm_weight, write_checkpoint  # noqa: E402
from make_vl_checkpoints import VL_IDS  # noqa: E402

__all__ = ["QWEN2_5_VL_SEED", "QWEN2_5_VL_CONFIG", "QWEN2_5_VL_GENERATION_CONFIG", "qwen2_5_vl_tower_tensors",
           "qwen2_5_vl_tensors", "make_qwen2_5_vl"]

QWEN2_5_VL_SEED = 27
QWEN2_5_VL_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
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
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_cache": True,
    "use_sliding_window": False,
    # the tiny tower: 2 blocks of width 32, 4 heads, a gated MLP of 64; windows of 56 px = 2x2 merged tokens, block 1
    # attending over the whole image; merged 2x2 into the language model's width
    "vision_config": {"depth": 2, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                      "in_chans": 3, "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                      "spatial_patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1],
                      "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # 8 rotary pairs of head_dim 16
    "vocab_size": 512,
}
QWEN2_5_VL_GENERATION_CONFIG = {"bos_token_id": VL_IDS["<|endoftext|>"], "do_sample": False,
                                "eos_token_id": [VL_IDS["<|im_end|>"], VL_IDS["<|endoftext|>"]],
                                "pad_token_id": VL_IDS["<|endoftext|>"]}
PATCH_STD = 0.05  # a 1176-wide patch: small enough that the tower's activations stay O(1)
HEAD_STD = 0.1    # the untied head, as wide as the tied Qwen2 embedding it stands beside
STD, BIAS_STD = 0.1, 0.05


def qwen2_5_vl_tower_tensors(rng: np.random.Generator, vc: dict) -> dict[str, np.ndarray]:
    """Qwen2.5-VL's ViT (`visual.*`): Conv3d patch embed (no bias), RMSNorm blocks (weight only) with a fused biased
    qkv and a biased SiLU-gated MLP, the merger (RMSNorm ln_q, then a 2-layer MLP over 2x2 merged patches)."""
    e, inter, ps, tp, m = (vc["hidden_size"], vc["intermediate_size"], vc["patch_size"], vc["temporal_patch_size"],
                           vc["spatial_merge_size"])
    merged = e * m * m
    t = {"visual.patch_embed.proj.weight": normal(rng, (e, vc["in_chans"], tp, ps, ps), PATCH_STD)}
    for i in range(vc["depth"]):
        p = f"visual.blocks.{i}."
        t[p + "norm1.weight"], t[p + "norm2.weight"] = norm_weight(rng, e), norm_weight(rng, e)
        for name, (o, i_) in (("attn.qkv", (3 * e, e)), ("attn.proj", (e, e)), ("mlp.gate_proj", (inter, e)),
                              ("mlp.up_proj", (inter, e)), ("mlp.down_proj", (e, inter))):
            t[p + f"{name}.weight"], t[p + f"{name}.bias"] = normal(rng, (o, i_), STD), normal(rng, (o,), BIAS_STD)
    t["visual.merger.ln_q.weight"] = norm_weight(rng, e)
    for name, (o, i_) in (("mlp.0", (merged, merged)), ("mlp.2", (vc["out_hidden_size"], merged))):
        t[f"visual.merger.{name}.weight"] = normal(rng, (o, i_), STD)
        t[f"visual.merger.{name}.bias"] = normal(rng, (o,), BIAS_STD)
    return t


def qwen2_5_vl_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The Qwen2 language model's tensors (its generator, this seed), then the head and the tower from a second
    stream."""
    t = qwen2_tensors(config, seed)
    rng = np.random.default_rng([seed, 1])
    if not config["tie_word_embeddings"]:
        t["lm_head.weight"] = normal(rng, (config["vocab_size"], config["hidden_size"]), HEAD_STD)
    t.update(qwen2_5_vl_tower_tensors(rng, config["vision_config"]))
    return t


def make_qwen2_5_vl(out_dir) -> Path:
    """Tiny Qwen2.5-VL (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 16, M-RoPE [2,3,3], untied; tower 2 x 32
    with 56 px windows)."""
    return write_checkpoint(out_dir, QWEN2_5_VL_CONFIG, qwen2_5_vl_tensors(QWEN2_5_VL_CONFIG, QWEN2_5_VL_SEED),
                            QWEN2_5_VL_GENERATION_CONFIG)


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: Qwen2.5-VL's special tokens, the same 14 as Qwen2-VL's in the release's order from 400
# (tools/make_vl_checkpoints.py VL_SPECIALS, spelled out: the table is read as a literal); the Instruct release: no
# bos, eos <|im_end|>, pad <|endoftext|>
TOKENIZER = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                          "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                          "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"),
             "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}

# tools/checkpoints_small.py (scale=small): Qwen2's Llama-like widths (GQA 12/2, head_dim 64, so M-RoPE's sections
# scale to [8, 12, 12] of 32 rotary pairs, the 7B's [16, 24, 24] of 64 halved) and a 4-block tower of width 256
# (block 3 attending fully) whose merger projects into the 768-wide language model
SMALL_BASE = "llama_like"
SMALL_OVERRIDES = {"num_key_value_heads": 2, "max_window_layers": 12, "sliding_window": 2048,
                   "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]},
                   "vision_config": {**QWEN2_5_VL_CONFIG["vision_config"], "depth": 4, "hidden_size": 256,
                                     "intermediate_size": 1024, "num_heads": 4, "fullatt_block_indexes": [3],
                                     "out_hidden_size": 768}}
