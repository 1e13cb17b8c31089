"""LLaMA-Factory's multimodal plugins (`data/mm_plugin.py`) for the Qwen-VL templates (Qwen2VLPlugin, Qwen3VLPlugin,
Qwen2OmniPlugin: images, and for Qwen2.5-Omni the audio LF's collator adds) and for the fixed-size towers
(Gemma3Plugin, PaliGemmaPlugin, LlavaNextPlugin, InternVLPlugin: the end of this file). The numpy twin of
torch_sources/training/mm_plugin.py (images decoded and resized by jax_oracles/models/vision_processing.py, bit-equal
to PIL's; audio features by jax_oracles/models/audio_processing.py).

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
import json
import os
from dataclasses import dataclass, replace

import numpy as np

from jax_oracles.models.audio_processing import WhisperFeatureConfig, frame_mask, pad_waveforms, whisper_features
from jax_oracles.models.gemma3_processing import Gemma3ImageProcessorConfig
from jax_oracles.models.gemma3_processing import process_images as gemma3_process_images
from jax_oracles.models.internvl_processing import GotOcr2ImageProcessorConfig
from jax_oracles.models.internvl_processing import expand_image_placeholders as internvl_expand
from jax_oracles.models.internvl_processing import process_images as internvl_process_images
from jax_oracles.models.llava_next_processing import LlavaNextImageProcessorConfig
from jax_oracles.models.llava_next_processing import expand_image_placeholders as llava_next_expand
from jax_oracles.models.llava_next_processing import process_images as llava_next_process_images
from jax_oracles.models.siglip_processing import SiglipImageProcessorConfig
from jax_oracles.models.siglip_processing import process_images as siglip_process_images
from jax_oracles.models.vision_processing import (AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER,
                                                 QwenImageProcessorConfig, expand_image_placeholders,
                                                 preprocess_image_base, preprocess_image_lf, process_images,
                                                 read_png)

__all__ = ["IGNORE_INDEX", "MMPlugin", "find_medias", "preprocess_image", "regularize_images", "get_mm_inputs",
           "get_audio_inputs", "audio_token_counts", "process_messages", "fake_image", "fake_image_input_ids",
           "fake_audio", "fake_audio_input_ids", "fake_input_ids", "fake_audio_inputs", "add_fake_image",
           "read_processor_files", "TowerPlugin", "Gemma3Plugin", "PaliGemmaPlugin", "LlavaNextPlugin",
           "InternVLPlugin"]

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


def preprocess_image(image: np.ndarray, plugin) -> np.ndarray:
    """uint8[H,W,C] -> uint8[H',W',3]: the plugin's _preprocess_image at its pixel bounds (Qwen2VLPlugin's rules
    after the base plugin's; a tower plugin's base rule alone)."""
    if isinstance(plugin, TowerPlugin):
        return plugin.preprocess_image(image)
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


def get_audio_inputs(audios: list[np.ndarray], plugin: MMPlugin) -> tuple[np.ndarray, np.ndarray]:
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
    if isinstance(plugin, TowerPlugin):
        return plugin.process_messages(messages, images)
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
    ids = tokenizer.encode(messages[0]["content"])
    return plugin.process_token_ids(ids, None, 1, tokenizer)[0] if isinstance(plugin, TowerPlugin) else ids


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
def _fake_audio_inputs(config: WhisperFeatureConfig) -> tuple[np.ndarray, np.ndarray]:
    return whisper_features([fake_audio()], config)  # the same every batch: computed once per config


def fake_audio_inputs(plugin: MMPlugin) -> tuple[np.ndarray, np.ndarray]:
    """get_audio_inputs([fake_audio()], plugin), a fresh copy of one cached result."""
    features, mask = _fake_audio_inputs(plugin.feature_extractor)
    return features.copy(), mask.copy()


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


# ---- the plugins of the fixed-size towers (Gemma 3, PaliGemma, LLaVA-NeXT, InternVL) ---------------------------
# Their image processor is the checkpoint's own (LF loads it from the model dir with the tokenizer): a template
# names the plugin, `bind(processor_dir)` reads preprocessor_config.json and processor_config.json from the
# tokenizer's dir. Images reach them regularized by LF's base rule (preprocess_image_base) only.

def read_processor_files(processor_dir) -> tuple[dict, dict]:
    """(preprocessor_config.json, processor_config.json) of a processor dir; a missing file refuses, since a
    tower's image size and token count live there."""
    out = []
    for name in ("preprocessor_config.json", "processor_config.json"):
        path = os.path.join(str(processor_dir), name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: a vision-language template's processor files sit beside its tokenizer")
        with open(path) as f:
            out.append(json.load(f))
    return out[0], out[1]


@dataclass(frozen=True)
class TowerPlugin:
    """LF's plugin for a fixed-size tower, bound to its processor (`bind`); the methods are LF's, images given
    regularized (preprocess_image_base) and in order."""

    name: str
    image_token: str
    image_max_pixels: int = 768 * 768  # ModelArguments' defaults, copied onto the processor by patch_processor
    image_min_pixels: int = 32 * 32
    image_processor: object | None = None  # the bound processor's image processor config
    image_seq_length: int = 0  # processor_config.json's (tokens per image or per tile)
    processor_config: dict | None = None
    audio_token = None  # no audio: LF adds no fake audio

    def bind(self, processor_dir) -> "TowerPlugin":
        pre, proc = read_processor_files(processor_dir)
        return replace(self, image_processor=self.read_image_processor(pre), processor_config=proc,
                       image_seq_length=int(proc.get("image_seq_length", 0)))

    def read_image_processor(self, d: dict):
        raise NotImplementedError

    def _bound(self):
        if self.image_processor is None:
            raise ValueError(f"the {self.name} plugin has no processor: Template.bind(processor_dir) first")

    def preprocess_image(self, image: np.ndarray) -> np.ndarray:
        return preprocess_image_base(image, self.image_max_pixels, self.image_min_pixels)

    def process_messages(self, messages: list[dict], images: list[np.ndarray]) -> list[dict]:
        _validate_messages(messages, len(images), 0)
        return messages

    def process_token_ids(self, input_ids: list[int], labels: list[int] | None, num_images: int,
                          tokenizer) -> tuple[list[int], list[int] | None]:
        return input_ids, labels

    def get_mm_inputs(self, images: list[np.ndarray], imglens: list[int], batch_ids: list[list[int]],
                      tokenizer) -> dict:
        """The collated batch's image inputs: pixel values and the family's extras (token_type_ids as unpadded
        lists, padded by the collator as LF's tokenizer.pad does)."""
        raise NotImplementedError


def _replace_placeholders(messages: list[dict], expansions) -> list[dict]:
    """Each `<image>`, counted over every message, -> the next string of expansions."""
    expansions, out = iter(expansions), []
    for message in messages:
        content = message["content"]
        while IMAGE_PLACEHOLDER in content:
            content = content.replace(IMAGE_PLACEHOLDER, next(expansions), 1)
        out.append({**message, "content": content})
    return out


@dataclass(frozen=True)
class Gemma3Plugin(TowerPlugin):
    """LF's Gemma3Plugin (pan-and-scan off): `<image>` -> the processor's full_image_sequence
    ("\\n\\n" + boi + image_token * image_seq_length + eoi + "\\n\\n"); token_type_ids 1 at the image tokens."""

    boi_token: str = "<start_of_image>"
    eoi_token: str = "<end_of_image>"

    def read_image_processor(self, d: dict):
        return Gemma3ImageProcessorConfig.from_hf(d)

    def process_messages(self, messages, images):
        self._bound()
        _validate_messages(messages, len(images), 0)
        sequence = f"\n\n{self.boi_token}{self.image_token * self.image_seq_length}{self.eoi_token}\n\n"
        return _replace_placeholders(messages, [sequence] * len(images))

    def get_mm_inputs(self, images, imglens, batch_ids, tokenizer):
        self._bound()
        image_id = tokenizer.convert_tokens_to_ids(self.image_token)
        return {"pixel_values": gemma3_process_images(images, self.image_processor),
                "token_type_ids": [[int(i == image_id) for i in ids] for ids in batch_ids]}


@dataclass(frozen=True)
class PaliGemmaPlugin(TowerPlugin):
    """LF's PaliGemmaPlugin: `<image>` removed from the text, image_seq_length image tokens per image put before
    everything (bos included, labels IGNORE_INDEX); token_type_ids 0 over the first image_seq_length * images
    positions of each row, 1 after (LF counts them from the row's start, the fake image's row too)."""

    def read_image_processor(self, d: dict):
        return SiglipImageProcessorConfig.from_hf(d)

    def process_messages(self, messages, images):
        self._bound()
        _validate_messages(messages, len(images), 0)
        return _replace_placeholders(messages, [""] * len(images))

    def process_token_ids(self, input_ids, labels, num_images, tokenizer):
        n = num_images * self.image_seq_length
        input_ids = [tokenizer.convert_tokens_to_ids(self.image_token)] * n + list(input_ids)
        return input_ids, (None if labels is None else [IGNORE_INDEX] * n + list(labels))

    def get_mm_inputs(self, images, imglens, batch_ids, tokenizer):
        self._bound()
        types = [[0] * (k * self.image_seq_length) + [1] * (len(ids) - k * self.image_seq_length)
                 for k, ids in zip(imglens, batch_ids)]
        return {"pixel_values": siglip_process_images(images, self.image_processor), "token_type_ids": types}


@dataclass(frozen=True)
class LlavaNextPlugin(TowerPlugin):
    """LF's LlavaNextPlugin: `<image>` -> image_token * the image's feature count (anyres grid, unpadded, one
    newline per row, the base tile; minus 1 under the "default" strategy); pixel_values [I, tiles, C, h, w] and
    image_sizes."""

    def read_image_processor(self, d: dict):
        return LlavaNextImageProcessorConfig.from_hf(d)

    def process_messages(self, messages, images):
        self._bound()
        _validate_messages(messages, len(images), 0)
        sizes = [image.shape[:2] for image in images]
        return llava_next_expand(messages, sizes, self.image_processor, int(self.processor_config["patch_size"]),
                                 image_token=self.image_token,
                                 num_additional_image_tokens=int(self.processor_config.get("num_additional_image_tokens", 1)))

    def get_mm_inputs(self, images, imglens, batch_ids, tokenizer):
        self._bound()
        pixel_values, image_sizes = llava_next_process_images(images, self.image_processor)
        return {"pixel_values": pixel_values, "image_sizes": image_sizes}


@dataclass(frozen=True)
class InternVLPlugin(TowerPlugin):
    """LF's InternVLPlugin (its crop_to_patches model argument off: the processor's own tiling): `<image>` ->
    `<img>` + `<IMG_CONTEXT>` * image_seq_length * the image's tiles + `</img>`; pixel_values [tiles, C, h, w]."""

    def read_image_processor(self, d: dict):
        return GotOcr2ImageProcessorConfig.from_hf(d)

    def process_messages(self, messages, images):
        self._bound()
        _validate_messages(messages, len(images), 0)
        _, num_patches = internvl_process_images(images, self.image_processor) if images else (None, [])
        return internvl_expand(messages, [int(n) for n in num_patches], self.image_seq_length)

    def get_mm_inputs(self, images, imglens, batch_ids, tokenizer):
        self._bound()
        pixel_values, _ = internvl_process_images(images, self.image_processor)
        return {"pixel_values": pixel_values}
