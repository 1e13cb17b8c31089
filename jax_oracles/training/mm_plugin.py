"""LLaMA-Factory's multimodal plugins for the Qwen-VL templates (`data/mm_plugin.py`: Qwen2VLPlugin, Qwen3VLPlugin,
Qwen2OmniPlugin), images only: the numpy twin of torch_sources/training/mm_plugin.py (images decoded and resized by
jax_oracles/models/vision_processing.py, bit-equal to PIL's).

A template with a plugin rewrites each `<image>` of the messages, prompt and response alike, to
vision_bos + image_token * (t*h*w // merge_size**2) + vision_eos before tokenizing, so the image tokens count
against cutoff_len. The processors keep the image paths in the feature; the collator loads the images again and
hands the model their pixel values and grids. An image goes through LF's regularization (the base plugin's
image_max_pixels / image_min_pixels resize and convert("RGB"), then Qwen2VLPlugin's min-side-28 and aspect-ratio-200
rules) and then the HF image processor (models/vision_processing.py).

Paths are the data's own (LF's alpaca `images` column), resolved against `media_dir` as LF's converter does
(`DatasetConverter._find_medias`: media_dir/path when that file exists, else the path as written).

LF's collator (`MultiModalDataCollatorForSeq2Seq.__call__`) gives a batch without any image a fake one, so the vision
tower runs on every step (zero3/fsdp would hang otherwise): a 64x64 white image whose expanded tokens go after row 0's
tokens (before them when the tokenizer pads on the left), with attention mask 0 and labels IGNORE_INDEX.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from jax_oracles.models.vision_processing import (IMAGE_PLACEHOLDER, QwenImageProcessorConfig,
                                                 expand_image_placeholders, preprocess_image_lf, process_images,
                                                 read_png)

__all__ = ["IGNORE_INDEX", "MMPlugin", "find_medias", "preprocess_image", "regularize_images", "get_mm_inputs",
           "process_messages", "fake_image", "fake_image_input_ids", "add_fake_image"]

IGNORE_INDEX = -100  # LF's extras/constants.py (processor.IGNORE_INDEX; imported from there it would make a cycle)
NO_IMAGE_SUPPORT = "This model does not support image input. Please check whether the correct `template` is used."


@dataclass(frozen=True)
class MMPlugin:
    """LF's get_mm_plugin(name, image_token, video_token, audio_token, vision_bos_token, vision_eos_token) for a
    Qwen-VL template, with what LF reads off the model's processor: ModelArguments' image_max_pixels /
    image_min_pixels (patch_processor copies them on) and the image processor's config (merge_size included)."""

    name: str  # LF's plugin: qwen2_vl, qwen3_vl or qwen2_omni
    image_token: str
    video_token: str
    image_processor: QwenImageProcessorConfig
    vision_bos_token: str = "<|vision_start|>"
    vision_eos_token: str = "<|vision_end|>"
    audio_token: str | None = None  # Qwen2.5-Omni's: LF then adds a fake audio to every batch (not mirrored)
    image_max_pixels: int = 768 * 768
    image_min_pixels: int = 32 * 32


def find_medias(paths: list[str], media_dir) -> list[str]:
    """DatasetConverter._find_medias for local files: media_dir/path when that file exists, else the path."""
    if media_dir is None:
        return list(paths)
    return [os.path.join(media_dir, p) if os.path.isfile(os.path.join(media_dir, p)) else p for p in paths]


def preprocess_image(image: np.ndarray, plugin: MMPlugin) -> np.ndarray:
    """uint8[H,W,C] -> uint8[H',W',3]: Qwen2VLPlugin._preprocess_image at the plugin's pixel bounds."""
    return preprocess_image_lf(image, plugin.image_max_pixels, plugin.image_min_pixels)


def regularize_images(paths: list[str], media_dir, plugin: MMPlugin) -> list[np.ndarray]:
    """MMPluginMixin._regularize_images on the data's paths: decode (PIL's Image.open), then preprocess_image."""
    return [preprocess_image(read_png(path), plugin) for path in find_medias(paths, media_dir)]


def get_mm_inputs(images: list[np.ndarray], plugin: MMPlugin) -> tuple[np.ndarray, np.ndarray]:
    """Regularized images -> (pixel_values f32[P, C*T*ps*ps], image_grid_thw i64[I,3]): the image processor's
    output (Qwen2VLPlugin._get_mm_inputs), images in order; no image gives P = I = 0."""
    if not images:
        c = plugin.image_processor
        return np.zeros((0, 3 * c.temporal_patch_size * c.patch_size**2), np.float32), np.zeros((0, 3), np.int64)
    return process_images(images, plugin.image_processor)


def process_messages(messages: list[dict], images: list[np.ndarray], plugin: MMPlugin | None) -> list[dict]:
    """Qwen2VLPlugin.process_messages for images (regularized, in order): each `<image>`, counted over every
    message, expanded to its image's tokens (LF's _validate_messages error when the counts differ). Without a
    plugin (LF's base plugin) the messages stay as they are, placeholders included, and any image is refused
    (only counted: it may be a path)."""
    if plugin is None:
        if images:  # MMPluginMixin._validate_input
            raise ValueError(NO_IMAGE_SUPPORT)
        return messages
    _, grid = get_mm_inputs(images, plugin)
    return expand_image_placeholders(messages, grid, plugin.image_processor.merge_size,
                                     image_token=plugin.image_token, vision_bos_token=plugin.vision_bos_token,
                                     vision_eos_token=plugin.vision_eos_token)


def fake_image() -> np.ndarray:  # -> uint8[64,64,3]
    """The collator's stand-in: Image.new("RGB", (64, 64), (255, 255, 255))."""
    return np.full((64, 64, 3), 255, np.uint8)


def fake_image_input_ids(tokenizer, plugin: MMPlugin) -> list[int]:
    """The fake image's tokens: `<image>` expanded for the regularized fake image, then tokenizer.encode
    (vision_bos, image_token * n, vision_eos: n = 4 for Qwen2-VL's processor, 64 for Qwen3-VL's)."""
    messages = process_messages([{"role": "user", "content": IMAGE_PLACEHOLDER}],
                                [preprocess_image(fake_image(), plugin)], plugin)
    return tokenizer.encode(messages[0]["content"])


def add_fake_image(features: list[dict], fake_ids: list[int], padding_side: str = "right") -> list[dict]:
    """The batch with the fake image's tokens on row 0 (a copy): after its tokens with right padding, before them
    with left padding; attention mask 0 and labels IGNORE_INDEX over them (a row without labels gets none)."""
    row, n = dict(features[0]), len(fake_ids)
    pieces = {"input_ids": list(fake_ids), "attention_mask": [0] * n, "labels": [IGNORE_INDEX] * n}
    for key, piece in pieces.items():
        if key in row:
            row[key] = list(row[key]) + piece if padding_side == "right" else piece + list(row[key])
    return [row, *features[1:]]

