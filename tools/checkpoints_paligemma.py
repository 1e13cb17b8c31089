"""Tiny PaliGemma checkpoint (google/paligemma-3b-pt-224's format) in the release's HF layout, from numpy.

config.json has the release's keys: the top-level copies of hidden_size / vocab_size / projection_dim, ignore_index,
a `text_config` (model_type gemma, hidden_activation, num_image_tokens, multi-query attention: one KV head) and a
`vision_config` (siglip_vision_model without its head, projection_dim, projector_hidden_act, num_image_tokens), plus
the tiny sizes the release leaves to defaults (head_dim, image_size) and the tiny special ids. Tensors
`language_model.model.*` (the Gemma decoder, tied: no head), `vision_tower.vision_model.*` (the SigLIP tower, as the
release stores it) and `multi_modal_projector.linear.*`. Gemma norms store the offset from 1 (x_hat * (1 + w)):
drawn around 0, so a norm that forgets the 1 shows. `python tools/make_checkpoints.py paligemma` reproduces the files
byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from make_checkpoints import norm_weight, normal, write_checkpoint  # noqa: E402

__all__ = ["PALIGEMMA_SEED", "PALIGEMMA_CONFIG", "PALIGEMMA_GENERATION_CONFIG", "siglip_tower_tensors",
           "gemma_norm", "paligemma_tensors", "make_paligemma"]

# ids 400.. in TOKENIZER's order
BOS, EOS, PAD, IMAGE = 400, 401, 402, 403
PALIGEMMA_SEED = 41
PALIGEMMA_CONFIG = {
    "architectures": ["PaliGemmaForConditionalGeneration"],
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "hidden_size": 64,
    "ignore_index": -100,
    "image_token_index": IMAGE,
    "model_type": "paligemma",
    "pad_token_id": PAD,
    "projection_dim": 64,
    "text_config": {"head_dim": 16, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 64,
                    "intermediate_size": 128, "model_type": "gemma", "num_attention_heads": 4, "num_hidden_layers": 2,
                    "num_image_tokens": 16, "num_key_value_heads": 1, "pad_token_id": PAD, "torch_dtype": "float32",
                    "vocab_size": 512},
    "torch_dtype": "float32",
    "transformers_version": "4.41.0.dev0",
    # 32 px in 8 px patches: 16 image tokens
    "vision_config": {"hidden_size": 32, "image_size": 32, "intermediate_size": 64, "model_type": "siglip_vision_model",
                      "num_attention_heads": 4, "num_hidden_layers": 2, "num_image_tokens": 16, "patch_size": 8,
                      "projection_dim": 64, "projector_hidden_act": "gelu_fast", "vision_use_head": False},
    "vocab_size": 512,
}
PALIGEMMA_GENERATION_CONFIG = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD}
TEXT_STD = 0.1  # decoder projections and the (tied) embedding: logits O(1)
TOWER_STD = 0.1
PATCH_STD = 0.07  # 3*8*8 inputs per patch: unit pixels embed at about 1
POS_STD = 0.5
BIAS_STD = 0.05
PROJECTOR_STD = 0.15  # 32 normed tower features -> image rows about as large as the scaled token embeddings


def gemma_norm(rng: np.random.Generator, dim: int) -> np.ndarray:
    return normal(rng, (dim,), 0.1)  # the offset from 1


def siglip_tower_tensors(rng: np.random.Generator, vc: dict, prefix: str = "vision_tower.vision_model.") -> dict:
    """The SigLIP tower without its head, under the releases' `vision_tower.vision_model.` names."""
    e, inter, p, c = vc["hidden_size"], vc["intermediate_size"], vc["patch_size"], vc.get("num_channels", 3)
    patches = (vc["image_size"] // p) ** 2
    t = {prefix + "embeddings.patch_embedding.weight": normal(rng, (e, c, p, p), PATCH_STD),
         prefix + "embeddings.patch_embedding.bias": normal(rng, (e,), BIAS_STD),
         prefix + "embeddings.position_embedding.weight": normal(rng, (patches, e), POS_STD)}
    for i in range(vc["num_hidden_layers"]):
        q = f"{prefix}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            t[q + f"{norm}.weight"], t[q + f"{norm}.bias"] = norm_weight(rng, e), normal(rng, (e,), BIAS_STD)
        for name, (o, i_) in (("self_attn.q_proj", (e, e)), ("self_attn.k_proj", (e, e)), ("self_attn.v_proj", (e, e)),
                              ("self_attn.out_proj", (e, e)), ("mlp.fc1", (inter, e)), ("mlp.fc2", (e, inter))):
            t[q + f"{name}.weight"], t[q + f"{name}.bias"] = normal(rng, (o, i_), TOWER_STD), normal(rng, (o,), BIAS_STD)
    t[prefix + "post_layernorm.weight"], t[prefix + "post_layernorm.bias"] = norm_weight(rng, e), normal(rng, (e,), BIAS_STD)
    return t


def gemma_decoder_tensors(rng: np.random.Generator, tc: dict, sandwich: bool) -> dict:
    """A Gemma decoder under `language_model.model.` (tied: no head); sandwich adds Gemma 3's q/k norms and
    pre/post feed-forward norms."""
    d, inter, hd = tc["hidden_size"], tc["intermediate_size"], tc["head_dim"]
    q_out, kv_out = tc["num_attention_heads"] * hd, tc["num_key_value_heads"] * hd
    lm = "language_model.model."
    t = {lm + "embed_tokens.weight": normal(rng, (tc["vocab_size"], d), TEXT_STD)}
    for i in range(tc["num_hidden_layers"]):
        q = f"{lm}layers.{i}."
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if sandwich else []
        for norm in norms:
            t[q + f"{norm}.weight"] = gemma_norm(rng, d)
        for name, shape in (("q_proj", (q_out, d)), ("k_proj", (kv_out, d)), ("v_proj", (kv_out, d)),
                            ("o_proj", (d, q_out))):
            t[q + f"self_attn.{name}.weight"] = normal(rng, shape, TEXT_STD)
        if sandwich:
            t[q + "self_attn.q_norm.weight"], t[q + "self_attn.k_norm.weight"] = gemma_norm(rng, hd), gemma_norm(rng, hd)
        for name, shape in (("gate_proj", (inter, d)), ("up_proj", (inter, d)), ("down_proj", (d, inter))):
            t[q + f"mlp.{name}.weight"] = normal(rng, shape, TEXT_STD)
    t[lm + "norm.weight"] = gemma_norm(rng, d)
    return t


def paligemma_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The decoder's tensors, then the tower's and the projector's from a second stream."""
    t = gemma_decoder_tensors(np.random.default_rng(seed), config["text_config"], sandwich=False)
    rng = np.random.default_rng([seed, 1])
    t.update(siglip_tower_tensors(rng, config["vision_config"]))
    vc = config["vision_config"]
    t["multi_modal_projector.linear.weight"] = normal(rng, (config["projection_dim"], vc["hidden_size"]), PROJECTOR_STD)
    t["multi_modal_projector.linear.bias"] = normal(rng, (config["projection_dim"],), BIAS_STD)
    return t


def make_paligemma(out_dir) -> Path:
    """Tiny PaliGemma (vocab 512, hidden 64, 2 layers, 4 heads over one KV head, head_dim 16, tied; SigLIP 2 x 32,
    32 px in 8 px patches: 16 image tokens)."""
    return write_checkpoint(out_dir, PALIGEMMA_CONFIG, paligemma_tensors(PALIGEMMA_CONFIG, PALIGEMMA_SEED),
                            PALIGEMMA_GENERATION_CONFIG)


# tools/make_tokenizer.py: PaliGemma's special tokens from 400 (the release: <pad> 0, <eos> 1, <bos> 2, <image> 257152)
TOKENIZER = {"specials": ("<bos>", "<eos>", "<pad>", "<image>"),
             "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
             # the processor files beside the tokenizer (LF loads the processor from the model dir):
             # paligemma-3b-pt-224's at the tiny tower's size (32 px), image_seq_length = the tower's patches
             "processor": {"preprocessor_config.json": {
                               "do_convert_rgb": None, "do_normalize": True, "do_rescale": True, "do_resize": True,
                               "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "SiglipImageProcessor",
                               "image_seq_length": 16, "image_std": [0.5, 0.5, 0.5], "resample": 3,
                               "rescale_factor": 0.00392156862745098, "size": {"height": 32, "width": 32}},
                           "processor_config.json": {"image_seq_length": 16, "processor_class": "PaliGemmaProcessor"}}}

# tools/checkpoints_small.py (scale=small): text_config replaced whole (Gemma's small widths: hidden 768, 12 layers,
# 12 heads of 64, MQA), the projector into 768 (projection_dim, both levels), the SigLIP tower widened to 4 blocks of
# 256 (image and patch stay: 16 tokens)
SMALL_OVERRIDES = {
    "vocab_size": 32000, "hidden_size": 768, "projection_dim": 768,
    "text_config": {**PALIGEMMA_CONFIG["text_config"], "hidden_size": 768, "intermediate_size": 2048,
                    "num_hidden_layers": 12, "num_attention_heads": 12, "head_dim": 64, "vocab_size": 32000},
    "vision_config": {**PALIGEMMA_CONFIG["vision_config"], "hidden_size": 256, "intermediate_size": 1024,
                      "num_hidden_layers": 4, "num_attention_heads": 4, "projection_dim": 768},
}
