"""The Qwen-VL image processor and LLaMA-Factory's Qwen2-VL mm plugin: the reference the numpy twin is held against.

transformers 5.24's `Qwen2VLImageProcessorPil` (qwen2_vl/image_processing_pil_qwen2_vl.py, used by Qwen2-VL,
Qwen2.5-VL, Qwen2.5-Omni and Qwen3-VL) on PIL images, step for step: convert to RGB (RGBA composited onto white),
PIL BICUBIC resize to `smart_resize`'s size, rescale in float64 then cast to float32, normalize in float32, and
the patch layout that repeats each image over the temporal patch. `pixel_values` equal the HF processor's bit
for bit (tests/models/test_vision_processing.py). PIL is here because it is the HF processor's own backend.

LLaMA-Factory 0.9.5 (src/llamafactory/data/mm_plugin.py) reshapes every image before the processor sees it
(`preprocess_image_lf`: the base plugin's image_max_pixels / image_min_pixels resize, `convert("RGB")`, then
`Qwen2VLPlugin`'s min-side-28 and aspect-ratio-200 rules) and expands each `<image>` placeholder to
vision_start + image_pad * (t*h*w // merge_size**2) + vision_end (`expand_image_placeholders`).

Images are uint8[H,W,C] numpy arrays, C = 1 (L), 3 (RGB) or 4 (RGBA), so both twins take the same input.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from PIL import Image

__all__ = [
    "IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "AUDIO_PLACEHOLDER", "LF_TEMPLATE_TOKENS",
    "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD", "QwenImageProcessorConfig", "smart_resize",
    "read_png", "to_rgb", "load_image", "resize_bicubic", "resize_bilinear", "resize_pil",
    "rescale", "normalize", "patchify", "process_images",
    "preprocess_image_base", "preprocess_image_lf", "expand_image_placeholders",
]

# LLaMA-Factory's placeholders (extras/constants.py; env vars IMAGE_PLACEHOLDER etc. can override them there).
IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER = "<image>", "<video>", "<audio>"
# The image tokens LF's templates give the plugin (data/template.py): qwen2_vl / qwen3_vl use the plugin's
# defaults, the qwen2_omni template (Qwen2.5-Omni) its own spellings.
LF_TEMPLATE_TOKENS = {
    "qwen2_vl": {"image_token": "<|image_pad|>", "vision_bos_token": "<|vision_start|>",
                 "vision_eos_token": "<|vision_end|>"},
    "qwen3_vl": {"image_token": "<|image_pad|>", "vision_bos_token": "<|vision_start|>",
                 "vision_eos_token": "<|vision_end|>"},
    "qwen2_omni": {"image_token": "<|IMAGE|>", "vision_bos_token": "<|vision_bos|>",
                   "vision_eos_token": "<|vision_eos|>"},
}
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}


@dataclass(frozen=True)
class QwenImageProcessorConfig:
    """preprocessor_config.json's keys; the defaults are `Qwen2VLImageProcessorPil()`'s."""
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56  # HF's size["shortest_edge"]
    max_pixels: int = 28 * 28 * 1280  # HF's size["longest_edge"]
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_resize: bool = True
    resample: int = 3
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    do_convert_rgb: bool = True

    def __post_init__(self):
        assert self.resample == 3, f"resample={self.resample}: only PIL BICUBIC (3), the Qwen-VL processors', is here"

    @property
    def factor(self) -> int:  # the side multiple smart_resize rounds to
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(cls, d: dict) -> "QwenImageProcessorConfig":
        # As Qwen2VLImageProcessorPil.__init__: `size` {shortest_edge, longest_edge}, overridden by min/max_pixels.
        size = dict(d.get("size") or {"shortest_edge": cls.min_pixels, "longest_edge": cls.max_pixels})
        if d.get("min_pixels") is not None:
            size["shortest_edge"] = d["min_pixels"]
        if d.get("max_pixels") is not None:
            size["longest_edge"] = d["max_pixels"]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ValueError(f"`size` dict must contain 'shortest_edge' and 'longest_edge' keys but got {size}.")
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name not in ("min_pixels", "max_pixels")}
        for key in ("image_mean", "image_std"):
            if key in kw:
                kw[key] = tuple(kw[key]) if isinstance(kw[key], (list, tuple)) else (float(kw[key]),) * 3
        return cls(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"], **kw)

    @classmethod
    def qwen2_vl(cls) -> "QwenImageProcessorConfig":
        """The hub preprocessor_config.json of Qwen2-VL, Qwen2.5-VL and Qwen2.5-Omni (not the class defaults:
        max_pixels 12845056 = 16384 * 28 * 28, not 1280 * 28 * 28)."""
        return cls(min_pixels=3136, max_pixels=12845056)

    @classmethod
    def qwen3_vl(cls) -> "QwenImageProcessorConfig":
        """Qwen3-VL's hub preprocessor_config.json (AutoImageProcessor maps qwen3_vl to Qwen2VLImageProcessor)."""
        return cls(patch_size=16, min_pixels=65536, max_pixels=16777216, image_mean=(0.5, 0.5, 0.5),
                   image_std=(0.5, 0.5, 0.5))


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """transformers' smart_resize: sides divisible by `factor`, area within [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor  # Python's round: half to even
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _pil(image: np.ndarray) -> Image.Image:  # uint8[H,W,C] -> PIL image of mode L / RGB / RGBA
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] not in _MODES:
        raise ValueError(f"expected uint8[H,W,C] with C in (1, 3, 4), got {image.dtype}{list(image.shape)}")
    return Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)


def _array(image: Image.Image) -> np.ndarray:  # PIL image -> uint8[H,W,C]
    a = np.asarray(image)
    return a[..., None].copy() if a.ndim == 2 else a.copy()


def read_png(path: str | Path) -> np.ndarray:
    """uint8[H,W,C]: an 8-bit gray (C=1), RGB (3) or RGBA (4) PNG, not interlaced, as PIL decodes it.
    Refuses what the numpy twin's decoder does not read (palette, 16-bit, gray+alpha, tRNS, interlaced)."""
    with Image.open(path) as im:
        if (im.format != "PNG" or im.mode not in _MODES.values() or "transparency" in im.info
                or im.info.get("interlace")):
            raise ValueError(f"{path}: only 8-bit gray/RGB/RGBA non-interlaced PNGs without tRNS are supported "
                             f"(PIL reads format {im.format}, mode {im.mode})")
        return _array(im)


def to_rgb(image: np.ndarray) -> np.ndarray:
    """uint8[H,W,C] -> uint8[H,W,3] as HF's convert_to_rgb does a PIL image: RGBA alpha-composited onto white."""
    im = _pil(image)
    if im.mode == "RGBA":
        im = Image.alpha_composite(Image.new("RGBA", im.size, (255, 255, 255, 255)), im)
    return _array(im.convert("RGB"))


def load_image(path: str | Path) -> np.ndarray:
    """uint8[H,W,3]: read_png then to_rgb, what the HF processor makes of `Image.open(path)`."""
    return to_rgb(read_png(path))


def resize_pil(image: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8[H,W,C] -> uint8[height,width,C]: PIL's `Image.resize((width, height), resample)`, resample 2
    (BILINEAR) or 3 (BICUBIC), RGBA premultiplied. The installed Pillow decides the bits: 13.0 resamples vertically
    first when the height shrinks by more than twice what the width does, <= 12.1 always horizontally first, so
    the last bit of some pixels is version dependent."""
    if resample not in (2, 3):
        raise ValueError(f"resample={resample}: only PIL BILINEAR (2) and BICUBIC (3) are here")
    return _array(_pil(image).resize((width, height), Image.Resampling(resample)))


def resize_bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8[H,W,C] -> uint8[height,width,C]: PIL's `Image.resize((width, height), BICUBIC)`."""
    return resize_pil(image, height, width, 3)


def resize_bilinear(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8[H,W,C] -> uint8[height,width,C]: PIL's `Image.resize((width, height), BILINEAR)`, the resample
    Gemma3ImageProcessorPil uses."""
    return resize_pil(image, height, width, 2)


def rescale(image: torch.Tensor, scale: float) -> torch.Tensor:
    """HF's rescale: upcast to float64, multiply, then cast to float32."""
    return (image.to(torch.float64) * scale).to(torch.float32)


def _check_channels(channels: int, mean, std) -> None:
    """HF's normalize refuses a mean or std of another length than the image's channels (a grey image where
    do_convert_rgb is off); broadcasting would make one channel three."""
    for name, values in (("mean", mean), ("std", std)):
        if len(values) != channels:
            raise ValueError(f"{name} must have {channels} elements if it is an iterable, got {len(values)}")


def normalize(image: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """f32[C,H,W] -> f32[C,H,W]: (x - mean) / std in float32, mean and std cast to float32 first (as HF)."""
    if not image.is_floating_point():
        image = image.to(torch.float32)
    _check_channels(image.shape[0], mean, std)
    mean_t = torch.tensor(mean, dtype=image.dtype)[:, None, None]
    std_t = torch.tensor(std, dtype=image.dtype)[:, None, None]
    return (image - mean_t) / std_t


def patchify(image: torch.Tensor, patch_size: int, temporal_patch_size: int,
             merge_size: int) -> tuple[torch.Tensor, int, int]:
    """f32[C,H,W] -> (f32[gh*gw, C*T*P*P], gh, gw). Rows go merge window by merge window (gh/m, gw/m, m, m) so that
    the merger's 2x2 neighbours are adjacent; each row is (C, T, P, P) with the image repeated over T."""
    image = image.to(torch.float32)
    c, h, w = image.shape
    gh, gw, m, p = h // patch_size, w // patch_size, merge_size, patch_size
    x = image.reshape(c, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    x = x.unsqueeze(5).expand(*x.shape[:5], temporal_patch_size, p, p)  # [gh/m, gw/m, m, m, C, T, P, P]
    return x.reshape(gh * gw, c * temporal_patch_size * p * p), gh, gw


def process_images(images: list[np.ndarray],
                   config: QwenImageProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8[H,W,C] images -> (pixel_values f32[sum(t*h*w), C*T*P*P], image_grid_thw i64[n_images, 3]),
    `Qwen2VLImageProcessorPil(...)(pil_images)` bit for bit."""
    all_patches, grids = [], []
    for image in images:
        if config.do_convert_rgb:
            image = to_rgb(image)
        if config.do_resize:
            height, width = smart_resize(image.shape[0], image.shape[1], config.factor, config.min_pixels,
                                         config.max_pixels)
            image = resize_bicubic(image, height, width)
        x = torch.from_numpy(image).permute(2, 0, 1)  # u8[C,H,W]
        if config.do_rescale:
            x = rescale(x, config.rescale_factor)
        if config.do_normalize:
            x = normalize(x, config.image_mean, config.image_std)
        patches, gh, gw = patchify(x, config.patch_size, config.temporal_patch_size, config.merge_size)
        all_patches.append(patches)
        grids.append([1, gh, gw])
    return torch.cat(all_patches), torch.tensor(grids, dtype=torch.int64)


def preprocess_image_base(image: np.ndarray, image_max_pixels: int = 768 * 768,
                          image_min_pixels: int = 32 * 32) -> np.ndarray:
    """uint8[H,W,C] -> uint8[H',W',3]: LF's base plugin `_preprocess_image` (every plugin's, before its own rules
    and the HF processor). `Image.resize` with its default filter (BICUBIC), sizes truncated by int(); RGBA loses
    its alpha in convert("RGB") (no compositing, unlike HF's own to_rgb)."""
    im = _pil(image)
    if im.width * im.height > image_max_pixels:
        resize_factor = math.sqrt(image_max_pixels / (im.width * im.height))
        im = im.resize((int(im.width * resize_factor), int(im.height * resize_factor)))
    if im.width * im.height < image_min_pixels:
        resize_factor = math.sqrt(image_min_pixels / (im.width * im.height))
        im = im.resize((int(im.width * resize_factor), int(im.height * resize_factor)))
    if im.mode != "RGB":
        im = im.convert("RGB")
    return _array(im)


def preprocess_image_lf(image: np.ndarray, image_max_pixels: int = 768 * 768,
                        image_min_pixels: int = 32 * 32) -> np.ndarray:
    """uint8[H,W,C] -> uint8[H',W',3]: LF's Qwen2VLPlugin._preprocess_image: the base plugin's
    (preprocess_image_base), then the Qwen size rules."""
    im = _pil(preprocess_image_base(image, image_max_pixels, image_min_pixels))
    # Qwen2VLPlugin: sides of at least 28, aspect ratio at most 200 (smart_resize refuses more)
    if min(im.width, im.height) < 28:
        im = im.resize((max(im.width, 28), max(im.height, 28)))
    if im.width / im.height > 200:
        im = im.resize((im.height * 180, im.height))
    if im.height / im.width > 200:
        im = im.resize((im.width, im.width * 180))
    return _array(im)


def expand_image_placeholders(messages: list[dict[str, str]], image_grid_thw: torch.Tensor, merge_size: int, *,
                              image_token: str = "<|image_pad|>", vision_bos_token: str = "<|vision_start|>",
                              vision_eos_token: str = "<|vision_end|>") -> list[dict[str, str]]:
    """LF's Qwen2VLPlugin.process_messages for images: the i-th `<image>` (counted over all messages, prompt and
    response) becomes bos + image_token * (prod(grid_thw[i]) // merge_size**2) + eos. image_grid_thw: i64[n, 3].
    Raises as LF's _validate_messages does when the placeholder counts differ from the media counts."""
    counts = [sum(m["content"].count(p) for m in messages) for p in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER,
                                                                    AUDIO_PLACEHOLDER)]
    for placeholder, kind, n_placeholders, n_media in zip((IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER),
                                                          ("images", "videos", "audios"), counts,
                                                          (len(image_grid_thw), 0, 0)):
        if n_placeholders != n_media:
            raise ValueError(f"The number of {kind} does not match the number of {placeholder} tokens in {messages}.")
    messages = copy.deepcopy(messages)
    merge_length = merge_size**2
    i = 0
    for message in messages:
        content = message["content"]
        while IMAGE_PLACEHOLDER in content:
            image_seqlen = int(image_grid_thw[i].prod()) // merge_length
            content = content.replace(IMAGE_PLACEHOLDER, f"{vision_bos_token}{image_token * image_seqlen}"
                                      f"{vision_eos_token}", 1)
            i += 1
        message["content"] = content
    return messages

