"""Tiny Qwen2.5-Omni checkpoint (Qwen2.5-Omni-7B's format, thinker only) in the release's HF layout, from numpy.

config.json is the wrapper's (model_type qwen2_5_omni, `enable_audio_output: false`, no talker or token2wav
config) with the thinker under `thinker_config`: the release's keys (`*_token_index`, a text_config with
`rope_scaling: {mrope_section, rope_type, type}` + `rope_theta`, a vision_config with the legacy `embed_dim` /
`in_chans` / `spatial_patch_size` / `tokens_per_second`), and an untied head as the release stores it (its
thinker sets no tie; transformers 5.24 ties only by the thinker-level key). Tensors: `thinker.model.*` (the Qwen2
language model, drawn by tools/checkpoints_qwen2.py's generator), `thinker.lm_head.weight`, `thinker.visual.*`
(Qwen2.5-VL's tower with separate q/k/v) and `thinker.audio_tower.*`. No spk_dict.pt (the wrapper class's
from_pretrained wants one; the thinker class loads this directory as it is).

Token ids: Omni's specials in the release's order from 400 (400 + release id - 151643): <|AUDIO|> 403,
<|audio_bos|> 404, <|audio_eos|> 405, <|vision_bos|> 409, <|vision_eos|> 410, <|IMAGE|> 412, <|VIDEO|> 413.
`python tools/make_checkpoints.py qwen2_omni` reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from checkpoints_qwen2 import qwen2_tensors  # noqa: E402
from make_checkpoints import normal, norm_weight, write_checkpoint  # noqa: E402

__all__ = ["OMNI_SPECIALS", "OMNI_IDS", "TOKENIZER", "QWEN2_OMNI_SEED", "QWEN2_OMNI_CONFIG", "QWEN2_OMNI_GENERATION_CONFIG",
           "qwen2_omni_vision_tensors", "qwen2_omni_audio_tensors", "qwen2_omni_tensors", "make_qwen2_omni"]

# 151643.. in the release (Qwen2.5-Omni's added tokens); the same order from 400 here
OMNI_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                 "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>",
                 "<|IMAGE|>", "<|VIDEO|>")
OMNI_IDS = {tok: 400 + i for i, tok in enumerate(OMNI_SPECIALS)}
# "user" is an ordinary BPE token in the release (872); here the tiny Qwen tokenizer's id of "user". The thinker
# never reads it (the talker does).
USER_TOKEN_ID = 267

QWEN2_OMNI_SEED = 25
QWEN2_OMNI_TEXT_CONFIG = {
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "max_window_layers": 2,
    "model_type": "qwen2_5_omni_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default", "type": "default"},  # 8 pairs of head_dim 16
    "rope_theta": 1000000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 512,
}
# the tiny tower: 2 blocks of width 32, 4 heads; windows of 56 px = 2x2 merged tokens; block 1 attends fully
QWEN2_OMNI_VISION_CONFIG = {
    "depth": 2, "embed_dim": 32, "fullatt_block_indexes": [1], "hidden_act": "silu", "hidden_size": 32,
    "in_channels": 3, "in_chans": 3, "intermediate_size": 64, "model_type": "qwen2_5_omni_vision_encoder",
    "num_heads": 4, "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
    "temporal_patch_size": 2, "tokens_per_second": 25, "window_size": 56,
}
# the tiny audio encoder: the release processor's 128 mel bins (the template's feature extractor feeds it as LF's
# processor feeds the release), 2 layers of width 32, chunks of 2 * 10 frames
QWEN2_OMNI_AUDIO_CONFIG = {
    "activation_dropout": 0.0, "activation_function": "gelu", "attention_dropout": 0.0, "d_model": 32, "dropout": 0.0,
    "encoder_attention_heads": 4, "encoder_ffn_dim": 64, "encoder_layers": 2, "initializer_range": 0.02,
    "max_source_positions": 100, "model_type": "qwen2_5_omni_audio_encoder", "n_window": 10, "num_mel_bins": 128,
    "output_dim": 64, "scale_embedding": False,
}
QWEN2_OMNI_CONFIG = {
    "architectures": ["Qwen2_5OmniForConditionalGeneration"],
    "enable_audio_output": False,
    "model_type": "qwen2_5_omni",
    "torch_dtype": "float32",
    "thinker_config": {
        "architectures": ["Qwen2_5OmniThinkerForConditionalGeneration"],
        "audio_config": QWEN2_OMNI_AUDIO_CONFIG,
        "audio_end_token_id": OMNI_IDS["<|audio_eos|>"],
        "audio_start_token_id": OMNI_IDS["<|audio_bos|>"],
        "audio_token_index": OMNI_IDS["<|AUDIO|>"],
        "bos_token_id": OMNI_IDS["<|im_start|>"],
        "eos_token_id": OMNI_IDS["<|im_end|>"],
        "image_token_index": OMNI_IDS["<|IMAGE|>"],
        "initializer_range": 0.02,
        "model_type": "qwen2_5_omni_thinker",
        "pad_token_id": OMNI_IDS["<|endoftext|>"],
        "position_id_per_seconds": 25,
        "seconds_per_chunk": 2,
        "text_config": QWEN2_OMNI_TEXT_CONFIG,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "user_token_id": USER_TOKEN_ID,
        "video_token_index": OMNI_IDS["<|VIDEO|>"],
        "vision_config": QWEN2_OMNI_VISION_CONFIG,
        "vision_end_token_id": OMNI_IDS["<|vision_eos|>"],
        "vision_start_token_id": OMNI_IDS["<|vision_bos|>"],
        "vision_token_id": OMNI_IDS["<|vision_pad|>"],
    },
}
QWEN2_OMNI_GENERATION_CONFIG = {"bos_token_id": OMNI_IDS["<|endoftext|>"], "do_sample": False,
                                "eos_token_id": [OMNI_IDS["<|im_end|>"], OMNI_IDS["<|endoftext|>"]],
                                "pad_token_id": OMNI_IDS["<|endoftext|>"]}
# tools/make_tokenizer.py: Omni's special tokens in the release's order from 400 (OMNI_SPECIALS, spelled out: the
# table is read as a literal), so the template's <|IMAGE|> / <|AUDIO|> / <|audio_bos|> land on the checkpoint's ids;
# Qwen2.5-Omni-7B's tokenizer_config: no bos, eos <|im_end|>, pad <|endoftext|>
TOKENIZER = {"specials": ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                          "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_bos|>", "<|vision_eos|>",
                          "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>"),
             "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
PATCH_STD = 0.05  # a 1176-wide patch: small enough that the tower's activations stay O(1)
HEAD_STD = 0.1    # the untied head, as wide as the tied Qwen2 embedding it stands beside
STD, BIAS_STD = 0.1, 0.05


def qwen2_omni_vision_tensors(rng: np.random.Generator, vc: dict) -> dict[str, np.ndarray]:
    """Omni's ViT (`visual.*`): Conv3d patch embed (no bias), RMSNorm blocks with separate biased q/k/v and a
    biased SiLU-gated MLP, the merger (RMSNorm ln_q, then a 2-layer MLP over 2x2 merged patches)."""
    e, inter, ps, tp, m = (vc["hidden_size"], vc["intermediate_size"], vc["patch_size"], vc["temporal_patch_size"],
                           vc["spatial_merge_size"])
    merged = e * m * m
    t = {"visual.patch_embed.proj.weight": normal(rng, (e, vc["in_channels"], tp, ps, ps), PATCH_STD)}
    for i in range(vc["depth"]):
        p = f"visual.blocks.{i}."
        t[p + "norm1.weight"], t[p + "norm2.weight"] = norm_weight(rng, e), norm_weight(rng, e)
        for name, (o, i_) in (("attn.q", (e, e)), ("attn.k", (e, e)), ("attn.v", (e, e)), ("attn.proj", (e, e)),
                              ("mlp.gate_proj", (inter, e)), ("mlp.up_proj", (inter, e)),
                              ("mlp.down_proj", (e, inter))):
            t[p + f"{name}.weight"], t[p + f"{name}.bias"] = normal(rng, (o, i_), STD), normal(rng, (o,), BIAS_STD)
    t["visual.merger.ln_q.weight"] = norm_weight(rng, e)
    for name, (o, i_) in (("mlp.0", (merged, merged)), ("mlp.2", (vc["out_hidden_size"], merged))):
        t[f"visual.merger.{name}.weight"] = normal(rng, (o, i_), STD)
        t[f"visual.merger.{name}.bias"] = normal(rng, (o,), BIAS_STD)
    return t


def qwen2_omni_audio_tensors(rng: np.random.Generator, ac: dict) -> dict[str, np.ndarray]:
    """Omni's audio encoder (`audio_tower.*`): two Conv1d (k3), LayerNorm layers with q/v/out biased and k_proj
    unbiased, fc1/fc2, ln_post, proj, and the stored (never read) audio_bos_eos_token table."""
    d, ffn, mel, out = ac["d_model"], ac["encoder_ffn_dim"], ac["num_mel_bins"], ac["output_dim"]
    t = {}
    for name, shape in (("conv1", (d, mel, 3)), ("conv2", (d, d, 3))):
        t[f"audio_tower.{name}.weight"] = normal(rng, shape, STD)
        t[f"audio_tower.{name}.bias"] = normal(rng, (d,), BIAS_STD)
    t["audio_tower.audio_bos_eos_token.weight"] = normal(rng, (2, out), STD)
    for i in range(ac["encoder_layers"]):
        p = f"audio_tower.layers.{i}."
        for name in ("self_attn_layer_norm", "final_layer_norm"):
            t[p + f"{name}.weight"], t[p + f"{name}.bias"] = norm_weight(rng, d), normal(rng, (d,), BIAS_STD)
        for name, (o, i_), bias in (("self_attn.q_proj", (d, d), True), ("self_attn.k_proj", (d, d), False),
                                    ("self_attn.v_proj", (d, d), True), ("self_attn.out_proj", (d, d), True),
                                    ("fc1", (ffn, d), True), ("fc2", (d, ffn), True)):
            t[p + f"{name}.weight"] = normal(rng, (o, i_), STD)
            if bias:
                t[p + f"{name}.bias"] = normal(rng, (o,), BIAS_STD)
    t["audio_tower.ln_post.weight"], t["audio_tower.ln_post.bias"] = norm_weight(rng, d), normal(rng, (d,), BIAS_STD)
    t["audio_tower.proj.weight"], t["audio_tower.proj.bias"] = normal(rng, (out, d), STD), normal(rng, (out,), BIAS_STD)
    return t


def qwen2_omni_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The Qwen2 language model's tensors (its generator, this seed), then the head and the towers from a second
    stream; every name under `thinker.`."""
    th = config["thinker_config"]
    tc = th["text_config"]
    t = qwen2_tensors(tc, seed)
    rng = np.random.default_rng([seed, 1])
    t["lm_head.weight"] = normal(rng, (tc["vocab_size"], tc["hidden_size"]), HEAD_STD)
    t.update(qwen2_omni_vision_tensors(rng, th["vision_config"]))
    t.update(qwen2_omni_audio_tensors(rng, th["audio_config"]))
    return {f"thinker.{name}": w for name, w in t.items()}


def make_qwen2_omni(out_dir) -> Path:
    """Tiny Qwen2.5-Omni thinker (vocab 512, hidden 64, 2 layers, GQA 4/2, head_dim 16, M-RoPE [2,3,3], untied;
    vision tower 2 x 32 with windows; audio encoder 2 x 32 over 128 mel bins)."""
    return write_checkpoint(out_dir, QWEN2_OMNI_CONFIG, qwen2_omni_tensors(QWEN2_OMNI_CONFIG, QWEN2_OMNI_SEED),
                            QWEN2_OMNI_GENERATION_CONFIG)

# tools/checkpoints_small.py (scale=small): the thinker nests every config, so the small row replaces
# thinker_config whole: Qwen2's small widths (hidden 768, 12 layers, GQA 12/2, head_dim 64: M-RoPE sections [8, 12,
# 12] of 32 pairs), a 4-block 256-wide Qwen2.5-VL tower (block 3 attending fully) and a 4-layer 256-wide audio
# encoder, both projecting into 768
SMALL_OVERRIDES = {"thinker_config": {
    **QWEN2_OMNI_CONFIG["thinker_config"],
    "text_config": {**QWEN2_OMNI_TEXT_CONFIG, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                    "num_attention_heads": 12, "num_key_value_heads": 2, "max_window_layers": 12,
                    "max_position_embeddings": 2048, "sliding_window": 2048, "vocab_size": 32000,
                    "rope_scaling": {"mrope_section": [8, 12, 12], "rope_type": "default", "type": "default"}},
    "vision_config": {**QWEN2_OMNI_VISION_CONFIG, "depth": 4, "embed_dim": 256, "hidden_size": 256,
                      "intermediate_size": 1024, "fullatt_block_indexes": [3], "out_hidden_size": 768},
    "audio_config": {**QWEN2_OMNI_AUDIO_CONFIG, "d_model": 256, "encoder_layers": 4, "encoder_ffn_dim": 1024,
                     "output_dim": 768},
}}
