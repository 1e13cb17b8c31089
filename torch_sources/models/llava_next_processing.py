"""The LLaVA-NeXT image processor and LLaMA-Factory's LlavaNextPlugin: the reference the numpy twin is held against.

transformers 5.24's `LlavaNextImageProcessorPil` (llava_next/image_processing_pil_llava_next.py) on uint8 images,
step for step ("anyres"):
- convert to RGB (RGBA composited onto white), as models/vision_processing.py;
- pick the grid pinpoint (h, w) that keeps the most of the image's pixels, then the least padding
  (`select_best_resolution`), resize the image into it keeping its aspect ratio (PIL BICUBIC, the fitted side
  rounded up) and pad it centred with zeros (uint8 black, before normalisation) to the pinpoint;
- cut the padded image into crop-size tiles, row-major, and put the whole image squashed to shortest_edge x
  shortest_edge in front (the "base" tile);
- every tile: resize its shortest edge to `size` (a no-op for square tiles of that side), centre crop to
  crop_size, rescale in float64 then cast to float32, normalise in float32 (CLIP mean / std);
- a batch pads every image's tile stack with zero tiles to the longest (`do_pad`).
Outputs: pixel_values f32[I, tiles, C, crop, crop] and image_sizes i64[I, 2], each image's (height, width).

The token count (`num_image_tokens`) is LlavaNextProcessor._get_number_of_features minus 1 under the "default"
strategy, what LLaMA-Factory 0.9.5's LlavaNextPlugin expands each `<image>` into (`expand_image_placeholders`);
with the releases' num_additional_image_tokens = 1 it equals the rows the model scatters in (models/llava_next.py).

Images are uint8[H,W,C] numpy arrays, C = 1 (L), 3 (RGB) or 4 (RGBA), so both twins take the same input.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from torch_sources.models.vision_processing import (IMAGE_PLACEHOLDER, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, normalize,
                                                    rescale, resize_pil, to_rgb)

__all__ = [
    "LlavaNextImageProcessorConfig", "select_best_resolution", "fitted_size", "shortest_edge_size", "anyres_tiles",
    "center_crop", "process_images", "unpadded_grid", "num_image_tokens", "expand_image_placeholders",
]

DEFAULT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


@dataclass(frozen=True)
class LlavaNextImageProcessorConfig:
    """preprocessor_config.json's keys; the defaults are `LlavaNextImageProcessorPil()`'s (224 px; the releases
    state 336: `release()`)."""
    shortest_edge: int = 224  # HF's size["shortest_edge"]
    crop_size: tuple[int, int] = (224, 224)  # HF's crop_size (height, width)
    image_grid_pinpoints: tuple[tuple[int, int], ...] = DEFAULT_PINPOINTS
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    resample: int = 3
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    do_convert_rgb: bool = True
    do_pad: bool = True

    def __post_init__(self):
        assert self.resample == 3, f"resample={self.resample}: only PIL BICUBIC (3), LLaVA-NeXT's, is here"

    @property
    def tile(self) -> int:  # the anyres tile side: HF's patch_size for divide_to_patches (crop_size's height)
        return self.crop_size[0]

    @classmethod
    def from_hf(cls, d: dict) -> "LlavaNextImageProcessorConfig":
        size, crop = d.get("size") or {"shortest_edge": cls.shortest_edge}, d.get("crop_size")
        if set(size) != {"shortest_edge"}:
            raise ValueError(f"size {size}: only the releases' {{'shortest_edge': n}} form is mirrored here")
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name not in ("shortest_edge", "crop_size")}
        for key in ("image_mean", "image_std"):
            if key in kw:
                kw[key] = tuple(kw[key]) if isinstance(kw[key], (list, tuple)) else (float(kw[key]),) * 3
        if "image_grid_pinpoints" in kw:
            kw["image_grid_pinpoints"] = tuple(tuple(p) for p in kw["image_grid_pinpoints"])
        if crop is not None:
            kw["crop_size"] = (crop["height"], crop["width"])
        return cls(shortest_edge=size["shortest_edge"], **kw)

    @classmethod
    def release(cls) -> "LlavaNextImageProcessorConfig":
        """llava-hf/llava-v1.6-*-hf's preprocessor_config.json: 336 px tiles and crop, the five default pinpoints."""
        return cls(shortest_edge=336, crop_size=(336, 336))


# ---- geometry (pure Python: the model's unpadding reads the same functions) -----------------

def select_best_resolution(original_size, possible_resolutions) -> tuple[int, int]:
    """transformers' select_best_resolution: the (h, w) pinpoint whose aspect-fitted copy of the (h, w) image keeps
    the most pixels (capped at the original's), ties to the least wasted area; the first such in list order."""
    height, width = (int(s) for s in original_size)
    best, most_kept, least_wasted = None, 0, float("inf")
    for h, w in possible_resolutions:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - kept
        if kept > most_kept or (kept == most_kept and wasted < least_wasted):
            best, most_kept, least_wasted = (h, w), kept, wasted
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """get_patch_output_size: the image scaled to fit (h, w) target, aspect kept, the fitted side's partner rounded
    up (and capped at the target)."""
    th, tw = target
    scale_w, scale_h = tw / width, th / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), th), tw
    return th, min(math.ceil(width * scale_h), tw)


def shortest_edge_size(height: int, width: int, size: int) -> tuple[int, int]:
    """get_resize_output_image_size(default_to_square=False): the short side to `size`, the long one truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    return (new_long, size) if width <= height else (size, new_long)


def unpadded_grid(image_size, rows: int, cols: int) -> tuple[int, int, int, int]:
    """unpad_image on a (rows, cols) grid of feature cells: (top, bottom, left, right), the cells that the image
    (h, w) covers once fitted into the grid and centred (the padding removed on the long side only)."""
    height, width = (int(s) for s in image_size)
    if width / height > cols / rows:
        new_rows = int(round(height * (cols / width), 7))
        pad = (rows - new_rows) // 2
        return pad, rows - pad, 0, cols
    new_cols = int(round(width * (rows / height), 7))
    pad = (cols - new_cols) // 2
    return 0, rows, pad, cols - pad


# ---- the processor --------------------------------------------------------------------------

def center_crop(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """HF's center_crop on [..., H, W]: the centred window, zero-padded first where the image is smaller."""
    h, w = image.shape[-2:]
    if h < height or w < width:  # pad to at least the crop, centred (ceil on the top/left), then crop
        new_h, new_w = max(height, h), max(width, w)
        top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
        padded = image.new_zeros((*image.shape[:-2], new_h, new_w))
        padded[..., top_pad:top_pad + h, left_pad:left_pad + w] = image
        image, h, w = padded, new_h, new_w
    top, left = (h - height) // 2, (w - width) // 2
    return image[..., top:top + height, left:left + width]


def anyres_tiles(image: np.ndarray, config: LlavaNextImageProcessorConfig) -> list[np.ndarray]:
    """uint8[H,W,3] -> [uint8[h,w,3]]: the base image (squashed to shortest_edge x shortest_edge), then the tiles of
    the image fitted and zero-padded into its best pinpoint, row-major (get_image_patches)."""
    height, width = image.shape[:2]
    best = select_best_resolution((height, width), config.image_grid_pinpoints)
    fh, fw = fitted_size(height, width, best)
    fitted = resize_pil(image, fh, fw, config.resample)
    (top, rest_y), (left, rest_x) = divmod(best[0] - fh, 2), divmod(best[1] - fw, 2)
    padded = np.pad(fitted, ((top, top + rest_y), (left, left + rest_x), (0, 0)))
    t = config.tile
    tiles = [padded[i:i + t, j:j + t] for i in range(0, best[0], t) for j in range(0, best[1], t)]
    return [resize_pil(image, config.shortest_edge, config.shortest_edge, config.resample)] + tiles


def _tile_pixels(tile: np.ndarray, config: LlavaNextImageProcessorConfig) -> torch.Tensor:  # -> f32[C,h,w]
    if config.do_resize:
        height, width = shortest_edge_size(tile.shape[0], tile.shape[1], config.shortest_edge)
        tile = resize_pil(tile, height, width, config.resample)
    x = torch.from_numpy(tile).permute(2, 0, 1)  # u8[C,H,W]
    if config.do_center_crop:
        x = center_crop(x, *config.crop_size)
    if config.do_rescale:
        x = rescale(x, config.rescale_factor)
    if config.do_normalize:
        x = normalize(x, config.image_mean, config.image_std)
    return x.to(torch.float32)


def process_images(images: list[np.ndarray],
                   config: LlavaNextImageProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8[H,W,C] images -> (pixel_values f32[I, tiles, C, crop_h, crop_w], image_sizes i64[I, 2]),
    `LlavaNextImageProcessorPil(...)(pil_images)` bit for bit (tile stacks zero-padded to the longest: do_pad)."""
    stacks, sizes = [], []
    for image in images:
        if config.do_convert_rgb:
            image = to_rgb(image)
        stacks.append(torch.stack([_tile_pixels(t, config) for t in anyres_tiles(image, config)]))
        sizes.append(list(image.shape[:2]))
    if config.do_pad:
        longest = max(len(s) for s in stacks)
        stacks = [torch.cat([s, s.new_zeros((longest - len(s), *s.shape[1:]))]) for s in stacks]
    return torch.stack(stacks), torch.tensor(sizes, dtype=torch.int64)


# ---- LLaMA-Factory's LlavaNextPlugin --------------------------------------------------------

def num_image_tokens(image_size, config: LlavaNextImageProcessorConfig, patch_size: int,
                     num_additional_image_tokens: int = 1, vision_feature_select_strategy: str = "default") -> int:
    """The `<image>` tokens of one (h, w) image: LlavaNextProcessor._get_number_of_features(h, w, *crop_size) (the
    unpadded grid with one newline per row, plus the base tile's patches and num_additional_image_tokens), minus 1
    under the "default" strategy. The releases' processor_config says num_additional_image_tokens = 1 (the CLS)."""
    tile_h, tile_w = config.crop_size
    best_h, best_w = select_best_resolution(image_size, config.image_grid_pinpoints)
    per_h, per_w = tile_h // patch_size, tile_w // patch_size
    top, bottom, left, right = unpadded_grid(image_size, per_h * (best_h // tile_h), per_w * (best_w // tile_w))
    count = (bottom - top) * (right - left + 1) + per_h * per_w + num_additional_image_tokens
    return count - 1 if vision_feature_select_strategy == "default" else count


def expand_image_placeholders(messages: list[dict[str, str]], image_sizes, config: LlavaNextImageProcessorConfig,
                              patch_size: int, image_token: str = "<image>",
                              num_additional_image_tokens: int = 1) -> list[dict[str, str]]:
    """LF's LlavaNextPlugin.process_messages: the i-th `<image>` (over all messages) becomes image_token *
    num_image_tokens(image_sizes[i]). image_sizes: [I, 2]. Raises as LF's _validate_messages when the counts differ."""
    sizes = [tuple(int(v) for v in s) for s in np.asarray(image_sizes).tolist()]
    n_placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if n_placeholders != len(sizes):
        raise ValueError(f"The number of images does not match the number of {IMAGE_PLACEHOLDER} tokens in {messages}.")
    messages, i = copy.deepcopy(messages), 0
    for message in messages:
        content = message["content"]
        while IMAGE_PLACEHOLDER in content:  # through "{{image}}": LF's image token is the placeholder itself
            n = num_image_tokens(sizes[i], config, patch_size, num_additional_image_tokens)
            content = content.replace(IMAGE_PLACEHOLDER, "{{image}}" * n, 1)
            i += 1
        message["content"] = content.replace("{{image}}", image_token)
    return messages
