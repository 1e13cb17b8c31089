"""Tiny InternVL checkpoint (OpenGVLab/InternVL3-1B-hf's format) in the release's HF layout, from numpy.

config.json has the release's keys, as transformers 4.52 wrote them: `text_config` the Qwen2.5 language model's
config (rope_theta, sliding-window keys off, its own `tie_word_embeddings: false`, token ids), `vision_config` the
InternViT-300M keys (LayerNorm, biased q/k/v, no qk-norm, mean pooling, the original config's `dropout` /
`initializer_factor`), the top level without a tie key (transformers 5 defaults it to True, finds the stored head
different from the embedding and leaves it untied), image_token_id = `<IMG_CONTEXT>`, image_seq_length,
downsample_ratio 0.5, projector_hidden_act, vision_feature_layer -1, strategy default. Tiny dims (shared notes,
hf-tiny-models.md): image 32, patch 8, so 16 patches a tile and 4 tokens after the 2x2 pixel shuffle.
Tensors as the release stores them: `language_model.model.*` (Qwen2's, drawn by tools/checkpoints_qwen2.py's
generator), `language_model.lm_head.weight`, `vision_tower.*`, `multi_modal_projector.*`.
`python tools/make_checkpoints.py internvl` reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from checkpoints_qwen2 import qwen2_tensors  # noqa: E402
from make_checkpoints import normal, norm_weight, write_checkpoint  # noqa: E402

__all__ = ["INTERNVL_SEED", "INTERNVL_IDS", "INTERNVL_CONFIG", "INTERNVL_GENERATION_CONFIG", "internvl_tower_tensors",
           "internvl_tensors", "make_internvl"]

INTERNVL_SEED = 37
# ids 400.. in TOKENIZER's order (151643.. and 151665.. in the release)
INTERNVL_IDS = {tok: 400 + i for i, tok in enumerate(
    ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"))}
INTERNVL_CONFIG = {
    "architectures": ["InternVLForConditionalGeneration"],
    "downsample_ratio": 0.5,
    "image_seq_length": 4,
    "image_token_id": INTERNVL_IDS["<IMG_CONTEXT>"],
    "model_type": "internvl",
    # the untied head said at the top level too: transformers 5 reads only this key (default True), the release
    # states it in text_config alone and relies on its stored head
    "tie_word_embeddings": False,
    "projector_hidden_act": "gelu",
    "text_config": {
        "_attn_implementation_autoset": True,
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": INTERNVL_IDS["<|endoftext|>"],
        "eos_token_id": INTERNVL_IDS["<|im_end|>"],
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 512,
    },
    "torch_dtype": "float32",
    "transformers_version": "4.52.0.dev0",
    "vision_config": {
        "architectures": ["InternVisionModel"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "dropout": 0.0,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.0,
        "hidden_size": 32,
        "image_size": [32, 32],
        "initializer_factor": 0.1,
        "initializer_range": 1e-10,
        "intermediate_size": 64,
        "layer_norm_eps": 1e-6,
        "layer_scale_init_value": 0.1,
        "model_type": "internvl_vision",
        "norm_type": "layer_norm",
        "num_attention_heads": 4,
        "num_channels": 3,
        "num_hidden_layers": 2,
        "patch_size": [8, 8],
        "projection_dropout": 0.0,
        "torch_dtype": "float32",
        "use_absolute_position_embeddings": True,
        "use_mask_token": False,
        "use_mean_pooling": True,
        "use_qk_norm": False,
    },
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "default",
}
PATCH_STD = 0.07  # a 3*8*8 patch of unit pixels embeds at about 1
POS_STD = 0.5  # CLS and the position table comparable to the patch embedding, so a misplaced row shows
BIAS_STD = 0.05
TOWER_STD = 0.15  # the blocks and the projector: features O(1)
HEAD_STD = 0.1  # the untied head: logits O(1), and different from the embedding (transformers must not tie them)


def internvl_tower_tensors(rng: np.random.Generator, vc: dict) -> dict[str, np.ndarray]:
    """InternViT (`vision_tower.*`): Conv2d patch embedding with bias, CLS token, the (1 + patches) position table,
    LayerNorm blocks with separate biased q/k/v, projection_layer, fc1/fc2 and the layer scales lambda_1/lambda_2
    (about 0.5, not the 0.1 init: both residual branches weigh in)."""
    e, inter, ps = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"][0]
    n = (vc["image_size"][0] // ps) * (vc["image_size"][1] // ps)
    v = "vision_tower."
    t = {v + "embeddings.cls_token": normal(rng, (1, 1, e), POS_STD),
         v + "embeddings.patch_embeddings.projection.weight": normal(rng, (e, vc["num_channels"], ps, ps), PATCH_STD),
         v + "embeddings.patch_embeddings.projection.bias": normal(rng, (e,), BIAS_STD),
         v + "embeddings.position_embeddings": normal(rng, (1, n + 1, e), POS_STD)}
    for i in range(vc["num_hidden_layers"]):
        p = f"{v}encoder.layer.{i}."
        for name, (o, i_) in (("attention.q_proj", (e, e)), ("attention.k_proj", (e, e)), ("attention.v_proj", (e, e)),
                              ("attention.projection_layer", (e, e)), ("mlp.fc1", (inter, e)), ("mlp.fc2", (e, inter))):
            t[p + f"{name}.weight"], t[p + f"{name}.bias"] = normal(rng, (o, i_), TOWER_STD), normal(rng, (o,), BIAS_STD)
        for norm in ("layernorm_before", "layernorm_after"):
            t[p + f"{norm}.weight"], t[p + f"{norm}.bias"] = norm_weight(rng, e), normal(rng, (e,), BIAS_STD)
        for lam in ("lambda_1", "lambda_2"):
            t[p + lam] = (np.float32(0.5) + normal(rng, (e,), 0.1)).astype(np.float32)
    return t


def internvl_projector_tensors(rng: np.random.Generator, config: dict) -> dict[str, np.ndarray]:
    """`multi_modal_projector.*`: LayerNorm over the 4 shuffled neighbours' channels, linear_1, linear_2."""
    width = config["vision_config"]["hidden_size"] * int(1 / config["downsample_ratio"]) ** 2
    d = config["text_config"]["hidden_size"]
    p = "multi_modal_projector."
    t = {p + "layer_norm.weight": norm_weight(rng, width), p + "layer_norm.bias": normal(rng, (width,), BIAS_STD)}
    for name, (o, i_) in (("linear_1", (d, width)), ("linear_2", (d, d))):
        t[p + f"{name}.weight"], t[p + f"{name}.bias"] = normal(rng, (o, i_), TOWER_STD), normal(rng, (o,), BIAS_STD)
    return t


def internvl_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Qwen2's tensors (its generator on text_config, this seed) under `language_model.`, the untied head, then the
    tower's and the projector's from their own streams."""
    t = {"language_model." + name: w for name, w in qwen2_tensors(config["text_config"], seed).items()}
    tc = config["text_config"]
    t["language_model.lm_head.weight"] = normal(np.random.default_rng([seed, 1]), (tc["vocab_size"], tc["hidden_size"]),
                                                HEAD_STD)
    t.update(internvl_tower_tensors(np.random.default_rng([seed, 2]), config["vision_config"]))
    t.update(internvl_projector_tensors(np.random.default_rng([seed, 3]), config))
    return t


# Qwen2.5's generation ids (InternVL3's language model): stop at <|im_end|> or <|endoftext|>, pad with the latter
INTERNVL_GENERATION_CONFIG = {"bos_token_id": INTERNVL_IDS["<|endoftext|>"],
                              "eos_token_id": [INTERNVL_IDS["<|im_end|>"], INTERNVL_IDS["<|endoftext|>"]],
                              "pad_token_id": INTERNVL_IDS["<|endoftext|>"]}


def make_internvl(out_dir) -> Path:
    """Tiny InternVL3 (Qwen2 vocab 512, hidden 64, 2 layers, GQA 4/2, untied head; InternViT 2 x 32, 4 heads,
    image 32, patch 8; 4 tokens per tile)."""
    return write_checkpoint(out_dir, INTERNVL_CONFIG, internvl_tensors(INTERNVL_CONFIG, INTERNVL_SEED),
                            INTERNVL_GENERATION_CONFIG)


# ---- this family's rows in the shared tool tables (found here by name: register once) ----

# tools/make_tokenizer.py: Qwen's ChatML specials then InternVL's image markers, ids 400.. in this order (config.json's
# image_token_id is <IMG_CONTEXT>'s); InternVL3-1B-hf's tokenizer_config: no bos, eos <|im_end|>, pad <|endoftext|>
TOKENIZER = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"),
             "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
             # the processor files beside the tokenizer (LF loads the processor from the model dir): InternVL3-1B-hf's
             # at the tiny tower's tile (32 px): GotOcr2 tiles, crop_to_patches off, image_seq_length = tokens per tile
             "processor": {"preprocessor_config.json": {
                               "crop_to_patches": False, "do_convert_rgb": True, "do_normalize": True,
                               "do_rescale": True, "do_resize": True, "image_mean": [0.485, 0.456, 0.406],
                               "image_processor_type": "GotOcr2ImageProcessor", "image_std": [0.229, 0.224, 0.225],
                               "max_patches": 12, "min_patches": 1, "resample": 3, "rescale_factor": 0.00392156862745098,
                               "size": {"height": 32, "width": 32}},
                           "processor_config.json": {"image_seq_length": 4, "processor_class": "InternVLProcessor"}}}

# tools/checkpoints_small.py (scale=small): the release nests its text keys, so the small row replaces text_config
# whole (Qwen2's small widths: hidden 768, 12 layers, GQA 12/4) and widens the tower to 4 blocks of 256 (the tile
# and patch stay: 4 tokens a tile)
SMALL_OVERRIDES = {
    "text_config": {**INTERNVL_CONFIG["text_config"], "hidden_size": 768, "intermediate_size": 2048,
                    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000,
                    "max_position_embeddings": 2048, "max_window_layers": 12},
    "vision_config": {**INTERNVL_CONFIG["vision_config"], "hidden_size": 256, "intermediate_size": 1024,
                      "num_hidden_layers": 4, "num_attention_heads": 4},
}
