"""Qwen2.5-VL over the paged KV cache: the pre-norm decoder serving path (serving/models/paged_decoder.py) on the
language model of torch_sources/models/qwen2_5_vl.py (Qwen2's blocks), its RoPE the M-RoPE of three position rows,
plus what a multimodal model runner needs around it:
- `process_image`: the training side's image processor (models/vision_processing.py) with the release's
  preprocessor_config (`QwenImageProcessorConfig.qwen2_vl()`: min_pixels 3136, max_pixels 12845056; the tiny
  checkpoint ships none, and the training template uses the same);
- `embed_multimodal`: the tower's merged embeddings of one image (t*h*w/4 rows, in the order of its
  `<|image_pad|>` tokens);
- `mrope_positions`: the prompt's 3 x L position table and its delta (models/mrope.py, transformers'
  get_rope_index); every later token sits at (context + delta) on all three rows;
- `forward_paged` takes the step's image rows (`mm_embeds` where `is_mm`) in place of those tokens' embeddings.
"""
from __future__ import annotations

import numpy as np
import torch

from torch_sources.models import mrope, rope
from torch_sources.models.qwen2_5_vl import Qwen2_5VLConfig, Qwen2_5VLForConditionalGeneration
from torch_sources.models.vision_processing import QwenImageProcessorConfig, process_images
from torch_sources.serving.models.paged_decoder import paged_functions
from torch_sources.serving.paged_attention import AttentionMetadata, PagedKVCache

SERVES = ("qwen2_5_vl",)  # the config.json model_types this module serves (models/__init__.py finds them here)
MULTIMODAL = True  # the runner places images: process_image, embed_multimodal, mrope_positions
__all__ = ["IMAGE_PROCESSOR", "load_model", "image_token_id", "process_image", "embed_multimodal", "mrope_positions",
           "forward_paged", "decoder_layer_paged", "compute_logits"]

IMAGE_PROCESSOR = QwenImageProcessorConfig.qwen2_vl()  # the release's preprocessor_config.json


def _mrope_tables(config: Qwen2_5VLConfig, positions):  # i32[3,T] -> (cos, sin) f32[1,T,hd]
    inv_freq = rope.static_inv_freq(config.text.rope, "the paged engine")
    return mrope.mrope_cos_sin(inv_freq, torch.as_tensor(positions)[:, None], config.mrope_section, interleaved=False)


_PAGED = paged_functions(Qwen2_5VLForConditionalGeneration, rope_tables=_mrope_tables)
load_model, decoder_layer_paged, compute_logits = _PAGED.load_model, _PAGED.decoder_layer_paged, _PAGED.compute_logits


def image_token_id(config: Qwen2_5VLConfig) -> int:
    return config.image_token_id


def process_image(config: Qwen2_5VLConfig, image: np.ndarray) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8[H,W,3] -> (pixel_values f32[P, C*2*14*14], grid_thw (t, h, w)): P = t*h*w patches, merge-block order."""
    pixel_values, grid = process_images([image], IMAGE_PROCESSOR)
    return pixel_values, tuple(int(x) for x in grid[0])


@torch.no_grad()
def embed_multimodal(model: Qwen2_5VLForConditionalGeneration, pixel_values, grid_thw) -> torch.Tensor:
    """pixel_values f32[P, C*2*14*14] and grid_thw (t, h, w) of one image -> f32[t*h*w/4, D]."""
    return model.encode_images(torch.as_tensor(pixel_values, dtype=torch.float32), torch.tensor([list(grid_thw)]))


def mrope_positions(config: Qwen2_5VLConfig, prompt_token_ids, grid_thws) -> tuple[np.ndarray, int]:
    """One unpadded prompt and the grids of its images in order -> (positions i64[3, L], delta = largest
    position + 1 - L). Video tokens are refused."""
    ids = torch.tensor([list(prompt_token_ids)], dtype=torch.int64)
    types = mrope.token_types(ids, image_token_id=config.image_token_id, video_token_id=config.video_token_id)
    grids = torch.tensor([list(g) for g in grid_thws], dtype=torch.int64) if grid_thws else None
    positions, deltas = mrope.get_rope_index(ids, grids, None, mm_token_type_ids=types,
                                             spatial_merge_size=config.vision.spatial_merge_size)
    return positions[:, 0].numpy(), int(deltas[0, 0])


@torch.no_grad()
def forward_paged(model: Qwen2_5VLForConditionalGeneration, input_ids, positions, kv_cache: PagedKVCache,
                  attn_meta: AttentionMetadata, mm_embeds, is_mm):
    """input_ids i32[T], positions i32[3,T], mm_embeds f32[T,D] (rows read only where is_mm), is_mm bool[T] ->
    (final-normed hidden f32[T,D], kv_cache)."""
    embeds = _PAGED.embed(model, input_ids)
    is_mm = torch.as_tensor(is_mm, dtype=torch.bool)[:, None]
    embeds = torch.where(is_mm, torch.as_tensor(mm_embeds, dtype=embeds.dtype), embeds)
    return _PAGED.forward_embeds(model, embeds, positions, kv_cache, attn_meta)
