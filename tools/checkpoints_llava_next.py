"""Tiny LLaVA-NeXT checkpoint (llava-hf/llava-v1.6-vicuna-7b-hf's format) in the release's HF layout, from numpy.

config.json has the release's keys: the 4.39 extras (`ignore_index`, `use_image_newline_parameter`, a top-level
`vocab_size`), a sparse vicuna `text_config` (no head_dim, no num_key_value_heads: multi-head attention as vicuna's,
no rope keys: the default RoPE at LlamaConfig's theta 1e4), a `clip_vision_model` vision_config with its copied
`vocab_size`, `vision_feature_layer` -2 and the "default" strategy, untied embeddings. The tiny anyres geometry:
32 px tiles of 8 px patches (4 x 4 = 16 features a tile, the CLS dropped), pinpoints [[32, 64], [64, 32], [64, 64]]
(a 2-tile row, a 2-tile column or a 2 x 2 grid, plus the base tile). Tensors as the release names them:
`language_model.model.*` and `language_model.lm_head.weight` (the Llama generator of tools/make_checkpoints.py),
`vision_tower.vision_model.*`, `multi_modal_projector.*`, `image_newline`. Token ids 400 <s>, 401 </s>, 402 <unk>,
403 <image> (`TOKENIZER`). `python tools/make_checkpoints.py llava_next` reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from make_checkpoints import llama3_tensors, normal, norm_weight, write_checkpoint  # noqa: E402

__all__ = ["LLAVA_NEXT_SEED", "LLAVA_NEXT_CONFIG", "LLAVA_NEXT_GENERATION_CONFIG", "clip_tower_tensors",
           "llava_next_tensors", "make_llava_next"]

LLAVA_NEXT_SEED = 41
BOS, EOS, UNK, IMAGE = 400, 401, 402, 403
LLAVA_NEXT_CONFIG = {
    "architectures": ["LlavaNextForConditionalGeneration"],
    "ignore_index": -100,
    "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64]],
    "image_token_index": IMAGE,
    "model_type": "llava_next",
    "projector_hidden_act": "gelu",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "pad_token_id": UNK,
        "rms_norm_eps": 1e-05,
        "torch_dtype": "float32",
        "vocab_size": 512,
    },
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "use_image_newline_parameter": True,
    # the tiny CLIP tower: width 32, 2 blocks (layer -2 is the first block's output), 4 heads, 32 px, patch 8
    "vision_config": {"hidden_size": 32, "image_size": 32, "intermediate_size": 64, "model_type": "clip_vision_model",
                      "num_attention_heads": 4, "num_hidden_layers": 2, "patch_size": 8, "projection_dim": 32,
                      "vocab_size": 32000},
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 512,
}
LLAVA_NEXT_GENERATION_CONFIG = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": UNK}
TEXT_STD = 0.02  # LlamaConfig's initializer_range (the head at make_checkpoints' LLAMA3_LM_HEAD_STD)
PATCH_STD = 0.07  # a 192-value patch: unit pixels embed at about 1
CLASS_STD = POS_STD = 0.5  # the CLS and the learned positions: comparable to the patch embedding, so a slip shows
BIAS_STD = 0.05
TOWER_STD = 0.15  # the blocks' and the projector's weights: features O(1)
NEWLINE_STD = 0.5  # above transformers' 1/sqrt(hidden) init, so a misplaced newline row shows


def clip_tower_tensors(rng: np.random.Generator, vc: dict) -> dict[str, np.ndarray]:
    """CLIPVisionModel under `vision_tower.vision_model.`: the bias-free Conv2d patch embed, the class embedding,
    positions for the (image/patch)^2 patches plus the CLS, pre_layrnorm, the blocks (layer_norm1, biased
    q/k/v/out_proj, layer_norm2, fc1/fc2), post_layernorm."""
    e, ps, inter = vc["hidden_size"], vc["patch_size"], vc["intermediate_size"]
    v = "vision_tower.vision_model."
    t = {v + "embeddings.class_embedding": normal(rng, (e,), CLASS_STD),
         v + "embeddings.patch_embedding.weight": normal(rng, (e, 3, ps, ps), PATCH_STD),
         v + "embeddings.position_embedding.weight": normal(rng, ((vc["image_size"] // ps) ** 2 + 1, e), POS_STD)}

    def norm(prefix):
        t[prefix + ".weight"], t[prefix + ".bias"] = norm_weight(rng, e), normal(rng, (e,), BIAS_STD)

    norm(v + "pre_layrnorm")
    for i in range(vc["num_hidden_layers"]):
        p = f"{v}encoder.layers.{i}."
        norm(p + "layer_norm1")
        for name, (o, i_) in (("self_attn.k_proj", (e, e)), ("self_attn.v_proj", (e, e)),
                              ("self_attn.q_proj", (e, e)), ("self_attn.out_proj", (e, e)),
                              ("mlp.fc1", (inter, e)), ("mlp.fc2", (e, inter))):
            t[p + f"{name}.weight"], t[p + f"{name}.bias"] = normal(rng, (o, i_), TOWER_STD), normal(rng, (o,), BIAS_STD)
        norm(p + "layer_norm2")
    norm(v + "post_layernorm")
    return t


def llava_next_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The vicuna (Llama) language model from make_checkpoints' generator under `language_model.`, then the tower,
    the projector and the newline from a second stream."""
    tc = config["text_config"]
    heads = tc["num_attention_heads"]
    lm = llama3_tensors({**tc, "initializer_range": TEXT_STD, "head_dim": tc["hidden_size"] // heads,
                         "num_key_value_heads": heads, "tie_word_embeddings": False}, seed)
    t = {"language_model." + name: w for name, w in lm.items()}  # model.* and lm_head.weight, as the release
    rng = np.random.default_rng([seed, 1])
    t.update(clip_tower_tensors(rng, config["vision_config"]))
    e, d = config["vision_config"]["hidden_size"], tc["hidden_size"]
    for name, (o, i_) in (("linear_1", (d, e)), ("linear_2", (d, d))):
        t[f"multi_modal_projector.{name}.weight"] = normal(rng, (o, i_), TOWER_STD)
        t[f"multi_modal_projector.{name}.bias"] = normal(rng, (o,), BIAS_STD)
    t["image_newline"] = normal(rng, (d,), NEWLINE_STD)
    return t


def make_llava_next(out_dir) -> Path:
    """Tiny LLaVA-NeXT (vicuna: vocab 512, hidden 64, 2 layers, MHA 4 heads; CLIP 2 x 32, 32 px / patch 8; anyres
    pinpoints 32x64, 64x32, 64x64)."""
    return write_checkpoint(out_dir, LLAVA_NEXT_CONFIG, llava_next_tensors(LLAVA_NEXT_CONFIG, LLAVA_NEXT_SEED),
                            LLAVA_NEXT_GENERATION_CONFIG)


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: vicuna's specials from 400 (<s>, </s>, <unk> are 1, 2, 0 there; <image> 32000); the
# llava-hf vicuna tokenizer: bos <s>, eos </s>, unk <unk>, and <unk> as the pad
TOKENIZER = {"specials": ("<s>", "</s>", "<unk>", "<image>"),
             "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>", "unk_token": "<unk>",
             # the processor files beside the tokenizer (LF loads the processor from the model dir): llava-v1.6's at
             # the tiny tower's size (32 px tiles, the checkpoint's pinpoints)
             "processor": {"preprocessor_config.json": {
                               "crop_size": {"height": 32, "width": 32}, "do_center_crop": True,
                               "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True,
                               "do_resize": True, "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64]],
                               "image_mean": [0.48145466, 0.4578275, 0.40821073],
                               "image_processor_type": "LlavaNextImageProcessor",
                               "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3,
                               "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 32}},
                           "processor_config.json": {"num_additional_image_tokens": 1, "patch_size": 8,
                                                     "processor_class": "LlavaNextProcessor",
                                                     "vision_feature_select_strategy": "default"}}}

# tools/checkpoints_small.py (scale=small): text_config replaced whole (Llama's small widths: hidden 768, 12 layers,
# 12 heads), the CLIP tower widened to 4 blocks of 256 (tiles and pinpoints stay)
SMALL_OVERRIDES = {
    "vocab_size": 32000,
    "text_config": {**LLAVA_NEXT_CONFIG["text_config"], "hidden_size": 768, "intermediate_size": 2048,
                    "num_hidden_layers": 12, "num_attention_heads": 12, "vocab_size": 32000,
                    "max_position_embeddings": 2048},
    "vision_config": {**LLAVA_NEXT_CONFIG["vision_config"], "hidden_size": 256, "intermediate_size": 1024,
                      "num_hidden_layers": 4, "num_attention_heads": 4},
}
