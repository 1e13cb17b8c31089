"""InternVL's image processor and LLaMA-Factory's InternVL mm plugin in numpy, PIL-free: the twin of
torch_sources/models/internvl_processing.py (the same public names; PIL's resampling and conversions come from
models/vision_processing.py's bit-exact numpy ports).

transformers 5.24's `GotOcr2ImageProcessorPil` (got_ocr2/image_processing_pil_got_ocr2.py; InternVL's
AutoImageProcessor) on PIL images, step for step: convert to RGB (RGBA composited onto white), then either
- crop_to_patches (and max_patches > 1): the tile grid (columns, rows) with the aspect ratio closest to the image's
  among those of min_patches..max_patches tiles (a tie goes to the later, larger grid while the image's area exceeds
  half the grid's), one PIL BICUBIC resize to that canvas, the tiles cut row-major, plus a thumbnail (the whole
  image resized to one tile) when there is more than one tile; or
- one tile: the image resized to `size` (when do_resize);
then every tile rescaled in float64 and cast to float32, normalized in float32. `pixel_values` f32[N,3,H,W] (all
tiles of all images, in order) equal the HF processor's bit for bit; `num_patches` counts each image's tiles.

LLaMA-Factory (src/llamafactory/data/mm_plugin.py, InternVLPlugin): images first pass the base plugin's
`_preprocess_image` (models/vision_processing.py preprocess_image_base: area over image_max_pixels or under image_min_pixels: `Image.resize` by the square root of the
ratio, sides truncated; `convert("RGB")`), then the image processor is called with crop_to_patches=True,
max_patches=12, min_patches=1 only when LF's `crop_to_patches` model argument is set (`patch_processor` copies it
onto the processor; default False), else with the processor's own preprocessor_config settings (InternVL3-1B-hf:
crop_to_patches false, one 448 tile). Each `<image>` becomes `<img>` + `<IMG_CONTEXT>` * image_seq_length *
num_patches + `</img>`.

Images are uint8[H,W,C] numpy arrays (C = 1, 3 or 4), as in models/vision_processing.py, so both twins take the
same input.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields

import numpy as np

from jax_oracles.models.vision_processing import (IMAGE_PLACEHOLDER, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD,
                                                  VIDEO_PLACEHOLDER, normalize, rescale, resize_bicubic, to_rgb)

__all__ = [
    "IMAGENET_MEAN", "IMAGENET_STD", "LF_CROP_KWARGS", "GotOcr2ImageProcessorConfig",
    "supported_aspect_ratios", "optimal_tiled_canvas", "number_of_patches", "crop_image_to_patches",
    "process_images", "lf_image_processor_kwargs", "expand_image_placeholders",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # InternVL3-1B-hf's preprocessor_config.json
IMAGENET_STD = (0.229, 0.224, 0.225)
LF_CROP_KWARGS = {"crop_to_patches": True, "max_patches": 12, "min_patches": 1}  # InternVLPlugin._get_mm_inputs


@dataclass(frozen=True)
class GotOcr2ImageProcessorConfig:
    """preprocessor_config.json's keys; the defaults are `GotOcr2ImageProcessorPil()`'s."""
    size: tuple[int, int] = (384, 384)  # (height, width): one tile
    crop_to_patches: bool = False
    min_patches: int = 1
    max_patches: int = 12
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    do_resize: bool = True
    resample: int = 3
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    do_convert_rgb: bool = True

    def __post_init__(self):
        assert self.resample == 3, f"resample={self.resample}: only PIL BICUBIC (3), GotOcr2's, is here"

    @classmethod
    def from_hf(cls, d: dict) -> "GotOcr2ImageProcessorConfig":
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name != "size"}
        for key in ("image_mean", "image_std"):
            if key in kw:
                kw[key] = tuple(kw[key]) if isinstance(kw[key], (list, tuple)) else (float(kw[key]),) * 3
        if "size" in d:
            kw["size"] = (int(d["size"]["height"]), int(d["size"]["width"]))
        return cls(**kw)

    @classmethod
    def internvl3(cls) -> "GotOcr2ImageProcessorConfig":
        """OpenGVLab/InternVL3-1B-hf's preprocessor_config.json: 448 tiles, ImageNet statistics, no cropping unless
        the caller asks (InternVLProcessor's own call does; LLaMA-Factory's by default does not)."""
        return cls(size=(448, 448), image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)

    def with_overrides(self, **overrides) -> "GotOcr2ImageProcessorConfig":  # call-time kwargs, as HF merges them
        return GotOcr2ImageProcessorConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)},
                                              **{k: v for k, v in overrides.items() if v is not None}})


def supported_aspect_ratios(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """(columns, rows) grids of min_tiles..max_tiles tiles, by tile count (stable: columns-major within a count)."""
    grids = [(w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1) if min_tiles <= w * h <= max_tiles]
    return sorted(grids, key=lambda g: g[0] * g[1])


def optimal_tiled_canvas(height: int, width: int, tile: tuple[int, int], min_tiles: int,
                         max_tiles: int) -> tuple[int, int]:
    """(columns, rows): the grid whose columns / rows is closest to width / height; on an exact tie the later
    grid wins while the image's area exceeds half the grid's pixel area (transformers' get_optimal_tiled_canvas)."""
    aspect, area = width / height, width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in supported_aspect_ratios(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * tile[0] * tile[1] * grid[0] * grid[1]:
            best = grid
    return best


def number_of_patches(height: int, width: int, config: GotOcr2ImageProcessorConfig) -> int:
    """Tiles one height x width image becomes (transformers' get_number_of_image_patches)."""
    if not (config.crop_to_patches and config.max_patches > 1):
        return 1
    columns, rows = optimal_tiled_canvas(height, width, config.size, config.min_patches, config.max_patches)
    return 1 + columns * rows if columns * rows > 1 else 1


def crop_image_to_patches(image: np.ndarray, config: GotOcr2ImageProcessorConfig) -> list[np.ndarray]:
    """uint8[H,W,3] -> tiles uint8[th,tw,3]: the image resized to the best grid's canvas and cut row-major, then the
    whole image resized to one tile when there are several."""
    th, tw = config.size
    columns, rows = optimal_tiled_canvas(image.shape[0], image.shape[1], config.size, config.min_patches,
                                         config.max_patches)
    canvas = resize_bicubic(image, th * rows, tw * columns)
    tiles = [canvas[r * th:(r + 1) * th, c * tw:(c + 1) * tw] for r in range(rows) for c in range(columns)]
    if len(tiles) != 1:
        tiles.append(resize_bicubic(image, th, tw))
    return tiles


def _to_pixels(tile: np.ndarray, config: GotOcr2ImageProcessorConfig) -> np.ndarray:  # u8[h,w,3] -> f32[3,h,w]
    x = np.ascontiguousarray(tile.transpose(2, 0, 1))
    if config.do_rescale:
        x = rescale(x, config.rescale_factor)
    if config.do_normalize:
        x = normalize(x, config.image_mean, config.image_std)
    return x.astype(np.float32)


def process_images(images: list[np.ndarray], config: GotOcr2ImageProcessorConfig,
                   **overrides) -> tuple[np.ndarray, np.ndarray]:
    """uint8[H,W,C] images -> (pixel_values f32[N,3,th,tw], num_patches i64[n_images]),
    `GotOcr2ImageProcessorPil(...)(pil_images, **overrides)` bit for bit (overrides: crop_to_patches, min_patches,
    max_patches, as the call's kwargs)."""
    config = config.with_overrides(**overrides)
    pixels, counts = [], []
    for image in images:
        if config.do_convert_rgb:
            image = to_rgb(image)
        if config.crop_to_patches and config.max_patches > 1:
            tiles = crop_image_to_patches(image, config)  # resized whatever do_resize says, as transformers
        else:
            tiles = [resize_bicubic(image, *config.size) if config.do_resize else image]
        counts.append(len(tiles))
        pixels += [_to_pixels(t, config) for t in tiles]
    return np.stack(pixels), np.array(counts, dtype=np.int64)


def lf_image_processor_kwargs(crop_to_patches: bool = False) -> dict:
    """The kwargs LLaMA-Factory's InternVLPlugin passes the image processor: its crop settings when LF's
    `crop_to_patches` model argument is set, none otherwise (the processor's own config then decides)."""
    return dict(LF_CROP_KWARGS) if crop_to_patches else {}


def _convert_rgb_pil(image: np.ndarray) -> np.ndarray:  # PIL's convert("RGB"): L replicated, RGBA's alpha dropped
    return np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image[..., :3].copy()


def expand_image_placeholders(messages: list[dict[str, str]], num_patches, image_seq_length: int, *,
                              start_token: str = "<img>", context_token: str = "<IMG_CONTEXT>",
                              end_token: str = "</img>") -> list[dict[str, str]]:
    """LF's InternVLPlugin.process_messages for images: the i-th `<image>` (counted over all messages) becomes
    `<img>` + `<IMG_CONTEXT>` * image_seq_length * num_patches[i] + `</img>`. Raises as LF's _validate_messages
    does when the placeholder and image counts differ."""
    n_images = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if n_images != len(num_patches):
        raise ValueError(f"The number of images does not match the number of {IMAGE_PLACEHOLDER} tokens in {messages}.")
    if any(VIDEO_PLACEHOLDER in m["content"] for m in messages):
        raise ValueError(f"The number of videos does not match the number of {VIDEO_PLACEHOLDER} tokens in {messages}.")
    messages = copy.deepcopy(messages)
    i = 0
    for message in messages:
        content = message["content"]
        while IMAGE_PLACEHOLDER in content:
            span = context_token * (image_seq_length * int(num_patches[i]))
            content = content.replace(IMAGE_PLACEHOLDER, f"{start_token}{span}{end_token}", 1)
            i += 1
        message["content"] = content
    return messages
