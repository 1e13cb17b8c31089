"""LLaMA-Factory's multimodal plugins for the Qwen-VL templates (`data/mm_plugin.py`: Qwen2VLPlugin, Qwen3VLPlugin,
Qwen2OmniPlugin): images, and for Qwen2.5-Omni the audio LF's collator adds (videos are out of scope).

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

A plugin with an audio token (Qwen2OmniPlugin) expands each `<audio>` to audio_bos + audio_token * n + audio_eos,
n from the Whisper features' frame mask ((frames - 1) // 2 + 1, then (that - 2) // 2 + 1: the audio tower's output
length), and LF's collator gives every batch without audio a fake one: np.zeros(1600), 0.1 s of silence, 10 frames,
2 audio tokens, placed after the fake image's tokens when both are added. Audio files in the data are not read
(LF decodes them with torchaudio); the fake audio is the only audio here.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np
import torch

from torch_sources.models.audio_processing import WhisperFeatureConfig, frame_mask, pad_waveforms, whisper_features
from torch_sources.models.vision_processing import (AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER,
                                                   QwenImageProcessorConfig, expand_image_placeholders,
                                                   preprocess_image_lf, process_images, read_png)

__all__ = ["IGNORE_INDEX", "MMPlugin", "find_medias", "preprocess_image", "regularize_images", "get_mm_inputs",
           "get_audio_inputs", "audio_token_counts", "process_messages", "fake_image", "fake_image_input_ids",
           "fake_audio", "fake_audio_input_ids", "fake_input_ids", "fake_audio_inputs", "add_fake_image"]

IGNORE_INDEX = -100  # LF's extras/constants.py (processor.IGNORE_INDEX; imported from there it would make a cycle)
NO_IMAGE_SUPPORT = "This model does not support image input. Please check whether the correct `template` is used."
NO_AUDIO_SUPPORT = "This model does not support audio input. Please check whether the correct `template` is used."


@dataclass(frozen=True)
class MMPlugin:
    """LF's get_mm_plugin(name, image_token, video_token, audio_token, vision_bos_token, vision_eos_token) for a
    Qwen-VL template, with what LF reads off the model's processor: ModelArguments' image_max_pixels /
    image_min_pixels (patch_processor copies them on), the image processor's config (merge_size included) and, with
    an audio token, the feature extractor's (the release's: the tiny Omni checkpoint's tower takes its 128 mel bins)."""

    name: str  # LF's plugin: qwen2_vl, qwen3_vl or qwen2_omni
    image_token: str
    video_token: str
    image_processor: QwenImageProcessorConfig
    vision_bos_token: str = "<|vision_start|>"
    vision_eos_token: str = "<|vision_end|>"
    audio_token: str | None = None  # Qwen2.5-Omni's: LF then adds a fake audio to every batch without audio
    image_max_pixels: int = 768 * 768
    image_min_pixels: int = 32 * 32
    audio_bos_token: str = "<|audio_start|>"  # Qwen2OmniPlugin's defaults; the qwen2_omni template passes its own
    audio_eos_token: str = "<|audio_end|>"
    feature_extractor: WhisperFeatureConfig | None = None  # the processor's, with an audio token

    def __post_init__(self):
        if self.audio_token is not None and self.feature_extractor is None:  # LF's _validate_input
            raise ValueError("Audio feature extractor was not found, please check and update your model file.")


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


def get_mm_inputs(images: list[np.ndarray], plugin: MMPlugin) -> tuple[torch.Tensor, torch.Tensor]:
    """Regularized images -> (pixel_values f32[P, C*T*ps*ps], image_grid_thw i64[I,3]): the image processor's
    output (Qwen2VLPlugin._get_mm_inputs), images in order; no image gives P = I = 0."""
    if not images:
        c = plugin.image_processor
        return torch.zeros(0, 3 * c.temporal_patch_size * c.patch_size**2), torch.zeros(0, 3, dtype=torch.int64)
    return process_images(images, plugin.image_processor)


def get_audio_inputs(audios: list[np.ndarray], plugin: MMPlugin) -> tuple[torch.Tensor, torch.Tensor]:
    """Waveforms -> (input_features f32[A, mel, frames], feature_attention_mask i32[A, frames]): LF's call to the
    processor's feature extractor (Qwen2OmniPlugin._get_mm_inputs; models/audio_processing.py)."""
    return whisper_features(audios, plugin.feature_extractor)


def audio_token_counts(feature_attention_mask) -> list[int]:
    """The audio tokens of each audio (Qwen2OmniPlugin.process_messages): its frames through the tower's stride-2
    conv, then its pairwise pooling."""
    input_lengths = (np.asarray(feature_attention_mask).sum(-1) - 1) // 2 + 1
    return ((input_lengths - 2) // 2 + 1).tolist()


def _validate_input(images: list, audios: list, plugin: MMPlugin | None) -> None:
    """MMPluginMixin._validate_input: media a plugin cannot take, images first."""
    if images and (plugin is None or plugin.image_token is None):
        raise ValueError(NO_IMAGE_SUPPORT)
    if audios and (plugin is None or plugin.audio_token is None):
        raise ValueError(NO_AUDIO_SUPPORT)


def _validate_messages(messages: list[dict], n_images: int, n_audios: int) -> None:
    """MMPluginMixin._validate_messages: each placeholder's count over every message equals its media's."""
    for placeholder, kind, n in ((IMAGE_PLACEHOLDER, "images", n_images), (VIDEO_PLACEHOLDER, "videos", 0),
                                 (AUDIO_PLACEHOLDER, "audios", n_audios)):
        if sum(m["content"].count(placeholder) for m in messages) != n:
            raise ValueError(f"The number of {kind} does not match the number of {placeholder} tokens in {messages}.")


def _expand_audio_placeholders(messages: list[dict], audios: list[np.ndarray], plugin: MMPlugin) -> list[dict]:
    """Each `<audio>`, counted over every message, -> audio_bos + audio_token * n + audio_eos (n from the frame
    mask alone: the features themselves are the collator's)."""
    config = plugin.feature_extractor
    counts = iter(audio_token_counts(frame_mask(pad_waveforms(audios, config)[1], config)) if audios else [])
    out = []
    for message in messages:
        content = message["content"]
        while AUDIO_PLACEHOLDER in content:
            tokens = plugin.audio_token * next(counts)
            content = content.replace(AUDIO_PLACEHOLDER, f"{plugin.audio_bos_token}{tokens}{plugin.audio_eos_token}", 1)
        out.append({**message, "content": content})
    return out


def process_messages(messages: list[dict], images: list[np.ndarray], plugin: MMPlugin | None,
                     audios: list[np.ndarray] = ()) -> list[dict]:
    """Qwen2VLPlugin / Qwen2OmniPlugin.process_messages (images regularized, audios as waveforms, each in order):
    each `<image>` and `<audio>`, counted over every message, expanded to its tokens (LF's _validate_messages
    error when the counts differ). Without a plugin (LF's base plugin) the messages stay as they are,
    placeholders included, and any image or audio is refused (only counted: it may be a path)."""
    _validate_input(images, list(audios), plugin)
    if plugin is None:
        return messages
    _validate_messages(messages, len(images), len(audios))
    # an audio span holds no `<image>`: expanding the audios first leaves LF's image expansion as it is
    messages = _expand_audio_placeholders(messages, list(audios), plugin)
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


def fake_audio() -> np.ndarray:  # -> f64[1600]
    """The collator's stand-in audio: np.zeros(1600), 0.1 s of silence at 16 kHz."""
    return np.zeros(1600)


def fake_audio_input_ids(tokenizer, plugin: MMPlugin) -> list[int]:
    """The fake audio's tokens: `<audio>` expanded for it (10 frames: 2 audio tokens), then tokenizer.encode."""
    messages = process_messages([{"role": "user", "content": AUDIO_PLACEHOLDER}], [], plugin, [fake_audio()])
    return tokenizer.encode(messages[0]["content"])


def fake_input_ids(tokenizer, plugin: MMPlugin, image: bool = True, audio: bool = True) -> list[int]:
    """What LF's collator appends to row 0: the fake image's tokens, then (a plugin with an audio token) the
    fake audio's; by default both, the most a batch gains."""
    ids = fake_image_input_ids(tokenizer, plugin) if image else []
    return ids + (fake_audio_input_ids(tokenizer, plugin) if audio and plugin.audio_token is not None else [])


@functools.lru_cache(maxsize=None)
def _fake_audio_inputs(config: WhisperFeatureConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return whisper_features([fake_audio()], config)  # the same every batch: computed once per config


def fake_audio_inputs(plugin: MMPlugin) -> tuple[torch.Tensor, torch.Tensor]:
    """get_audio_inputs([fake_audio()], plugin), a fresh copy of one cached result."""
    features, mask = _fake_audio_inputs(plugin.feature_extractor)
    return features.clone(), mask.clone()


def add_fake_image(features: list[dict], fake_ids: list[int], padding_side: str = "right") -> list[dict]:
    """The batch with the fake media's tokens (fake_input_ids) on row 0 (a copy): after its tokens with right
    padding, before them with left padding; attention mask 0 and labels IGNORE_INDEX over them (a row without
    labels gets none)."""
    row, n = dict(features[0]), len(fake_ids)
    pieces = {"input_ids": list(fake_ids), "attention_mask": [0] * n, "labels": [IGNORE_INDEX] * n}
    for key, piece in pieces.items():
        if key in row:
            row[key] = list(row[key]) + piece if padding_side == "right" else piece + list(row[key])
    return [row, *features[1:]]
