"""SigLIP's image processor (PaliGemma's): transformers 5.24's `SiglipImageProcessorPil`, the reference the numpy
twin (jax_oracles/models/siglip_processing.py) is held against.

Step for step as the PIL backend runs it: convert to RGB (RGBA composited onto white), PIL resize of the uint8 image
to the fixed size[height, width] (BICUBIC; no aspect ratio kept, no crop), rescale in float64 then cast to float32,
normalize in float32; pixel_values f32[I, 3, H, W]. The pieces are models/vision_processing.py's (PIL, as HF).
Images are uint8[H,W,C] numpy arrays, C = 1, 3 or 4.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from torch_sources.models.vision_processing import normalize, rescale, resize_pil, to_rgb

__all__ = ["IMAGENET_STANDARD_MEAN", "IMAGENET_STANDARD_STD", "SiglipImageProcessorConfig", "process_image",
           "process_images"]

IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class SiglipImageProcessorConfig:
    """preprocessor_config.json's keys; the defaults are `SiglipImageProcessorPil()`'s."""
    height: int = 224
    width: int = 224
    resample: int = 3  # PIL BICUBIC
    image_mean: tuple[float, ...] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, ...] = IMAGENET_STANDARD_STD
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    do_convert_rgb: bool | None = True  # a release file's null is kept: HF converts only when it is truthy

    def __post_init__(self):
        if self.resample not in (2, 3):
            raise ValueError(f"resample={self.resample}: only PIL BILINEAR (2) and BICUBIC (3) are here")

    @classmethod
    def from_hf(cls, d: dict) -> "SiglipImageProcessorConfig":
        """A preprocessor_config.json dict: size {height, width} (nothing else is a fixed size), the flags; a key
        the file leaves out keeps the class default, an explicit null is kept, as HF's from_pretrained does (the
        PaliGemma and Gemma 3 releases ship "do_convert_rgb": null, and their processors then convert nothing)."""
        size = d.get("size") or {"height": cls.height, "width": cls.width}
        if set(size) != {"height", "width"}:
            raise ValueError(f"size={size!r}: only a fixed {{height, width}} is here")
        kw = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name not in ("height", "width")}
        for key in ("image_mean", "image_std"):
            if kw.get(key) is not None:
                kw[key] = tuple(kw[key]) if isinstance(kw[key], (list, tuple)) else (float(kw[key]),) * 3
        return cls(height=size["height"], width=size["width"], **kw)

    @classmethod
    def paligemma(cls) -> "SiglipImageProcessorConfig":
        """google/paligemma-3b-pt-224's preprocessor_config.json: 224 x 224, BICUBIC, mean and std 0.5, do_convert_rgb
        null."""
        return cls(height=224, width=224, resample=3, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                   do_convert_rgb=None)


def process_image(image: np.ndarray, config: SiglipImageProcessorConfig) -> torch.Tensor:
    """uint8[H,W,C] -> f32[3, height, width] (C: the image's channels when do_convert_rgb is off)."""
    if config.do_convert_rgb:
        image = to_rgb(image)
    if config.do_resize:
        image = resize_pil(image, config.height, config.width, config.resample)
    x = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)  # u8[C,H,W]
    if config.do_rescale:
        x = rescale(x, config.rescale_factor)
    if config.do_normalize:
        x = normalize(x, config.image_mean, config.image_std)
    return x.to(torch.float32)


def process_images(images: list[np.ndarray], config: SiglipImageProcessorConfig) -> torch.Tensor:
    """uint8[H,W,C] images -> pixel_values f32[I, 3, height, width], `SiglipImageProcessorPil(...)(pil_images)`."""
    return torch.stack([process_image(image, config) for image in images])
