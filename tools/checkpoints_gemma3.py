"""Tiny Gemma 3 multimodal checkpoint (google/gemma-3-4b-it's format) in the release's HF layout, from numpy.

config.json has the release's keys: boi / eoi / image token indices, eos_token_id [<eos>, <end_of_turn>],
mm_tokens_per_image, a `text_config` in the release's legacy form (`rope_scaling: {rope_type: linear, factor: 8}` for
the full layers, sliding_window) plus the tiny sizes the release leaves to defaults (vocab, heads, head_dim,
query_pre_attn_scalar 24 != head_dim so a wrong scale shows, sliding_window_pattern 2: layer 0 sliding, layer 1 full),
and a SigLIP `vision_config` without its head. The tower sees 64 px in 8 px patches (8 x 8), pooled 2 x 2 into 16
image tokens: more than the sliding window (8), so an image's block crosses the window and the sliding layers'
AND(window, OR(causal, image)) composition is exercised. Tensors `language_model.model.*` (tied: no head),
`vision_tower.vision_model.*`, `multi_modal_projector.{mm_input_projection_weight [in, out], mm_soft_emb_norm}`.
`python tools/make_checkpoints.py gemma3` reproduces the files byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from checkpoints_paligemma import PROJECTOR_STD, gemma_decoder_tensors, gemma_norm, siglip_tower_tensors  # noqa: E402
from make_checkpoints import normal, write_checkpoint  # noqa: E402

__all__ = ["GEMMA3_SEED", "GEMMA3_CONFIG", "GEMMA3_GENERATION_CONFIG", "gemma3_tensors", "make_gemma3"]

# ids 400.. in TOKENIZER's order
BOS, EOS, PAD, START_OF_TURN, END_OF_TURN, BOI, EOI, IMAGE = range(400, 408)
GEMMA3_SEED = 43
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": BOI,
    "eoi_token_index": EOI,
    "eos_token_id": [EOS, END_OF_TURN],
    "image_token_index": IMAGE,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 16,
    "model_type": "gemma3",
    "text_config": {"bos_token_id": BOS, "eos_token_id": EOS, "head_dim": 16, "hidden_size": 64,
                    "intermediate_size": 128, "model_type": "gemma3_text", "num_attention_heads": 4,
                    "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": PAD, "query_pre_attn_scalar": 24,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 8,
                    "sliding_window_pattern": 2, "vocab_size": 512},
    "torch_dtype": "float32",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {"hidden_size": 32, "image_size": 64, "intermediate_size": 64, "model_type": "siglip_vision_model",
                      "num_attention_heads": 4, "num_hidden_layers": 2, "patch_size": 8, "vision_use_head": False},
}
GEMMA3_GENERATION_CONFIG = {"bos_token_id": BOS, "cache_implementation": "hybrid", "do_sample": True,
                            "eos_token_id": [EOS, END_OF_TURN], "pad_token_id": PAD, "top_k": 64, "top_p": 0.95}


def gemma3_tensors(config: dict, seed: int) -> dict[str, np.ndarray]:
    """The decoder's tensors (sandwich norms, q/k norms), then the tower's and the projector's from a second
    stream."""
    t = gemma_decoder_tensors(np.random.default_rng(seed), config["text_config"], sandwich=True)
    rng = np.random.default_rng([seed, 1])
    vc = config["vision_config"]
    t.update(siglip_tower_tensors(rng, vc))
    t["multi_modal_projector.mm_input_projection_weight"] = normal(
        rng, (vc["hidden_size"], config["text_config"]["hidden_size"]), PROJECTOR_STD)
    t["multi_modal_projector.mm_soft_emb_norm.weight"] = gemma_norm(rng, vc["hidden_size"])
    return t


def make_gemma3(out_dir) -> Path:
    """Tiny Gemma 3 (vocab 512, hidden 64, 2 layers [sliding 8, full], GQA 4/2, head_dim 16, linear RoPE x8 on the
    full layer, tied; SigLIP 2 x 32 on 64 px, 16 image tokens)."""
    return write_checkpoint(out_dir, GEMMA3_CONFIG, gemma3_tensors(GEMMA3_CONFIG, GEMMA3_SEED), GEMMA3_GENERATION_CONFIG)


# tools/make_tokenizer.py: Gemma 3's special tokens from 400 (the release: <pad> 0, <eos> 1, <bos> 2,
# <start_of_turn> 105, <end_of_turn> 106, <start_of_image> 255999, <end_of_image> 256000, <image_soft_token> 262144)
TOKENIZER = {"specials": ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                          "<end_of_image>", "<image_soft_token>"),
             "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
             # the processor files beside the tokenizer (LF loads the processor from the model dir): gemma-3-4b-it's
             # at the tiny tower's size (64 px, BILINEAR), image_seq_length = mm_tokens_per_image
             "processor": {"preprocessor_config.json": {
                               "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None,
                               "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                               "image_processor_type": "Gemma3ImageProcessor", "image_std": [0.5, 0.5, 0.5],
                               "resample": 2, "rescale_factor": 0.00392156862745098, "size": {"height": 64, "width": 64}},
                           "processor_config.json": {"image_seq_length": 16, "processor_class": "Gemma3Processor"}}}

# tools/checkpoints_small.py (scale=small): text_config replaced whole (hidden 768, 12 layers of 12 heads of 64, GQA
# 12/4, the release's five sliding layers to one full, a 256-token window), the SigLIP tower widened to 4 blocks of 256
# (image, patch and the 16 pooled tokens stay)
SMALL_OVERRIDES = {
    "text_config": {**GEMMA3_CONFIG["text_config"], "hidden_size": 768, "intermediate_size": 2048,
                    "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
                    "query_pre_attn_scalar": 64, "sliding_window": 256, "sliding_window_pattern": 6,
                    "vocab_size": 32000},
    "vision_config": {**GEMMA3_CONFIG["vision_config"], "hidden_size": 256, "intermediate_size": 1024,
                      "num_hidden_layers": 4, "num_attention_heads": 4},
}
