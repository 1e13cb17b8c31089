"""Gemma 3's image processor: transformers 5.24's `Gemma3ImageProcessorPil` with pan-and-scan off (LLaMA-Factory's
default), the reference the numpy twin (jax_oracles/models/gemma3_processing.py) is held against.

With do_pan_and_scan off, Gemma3ImageProcessorPil is the SigLIP processor at Gemma 3's settings (models/
siglip_processing.py): RGB, a BILINEAR resize to the fixed size (896 x 896 in the release), rescale, normalize with
mean and std 0.5; pixel_values f32[I, 3, H, W] and num_crops 0 per image. Pan-and-scan (extra crops of wide or
tall images) is refused, not silently skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_sources.models.siglip_processing import SiglipImageProcessorConfig, process_images

__all__ = ["Gemma3ImageProcessorConfig", "process_images"]

_PAN_AND_SCAN = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
                 "pan_and_scan_min_ratio_to_activate")


@dataclass(frozen=True)
class Gemma3ImageProcessorConfig(SiglipImageProcessorConfig):
    """preprocessor_config.json's keys; the defaults are `Gemma3ImageProcessorPil()`'s (224, BILINEAR)."""
    resample: int = 2  # PIL BILINEAR

    @classmethod
    def from_hf(cls, d: dict) -> "Gemma3ImageProcessorConfig":
        """As SiglipImageProcessorConfig.from_hf; do_pan_and_scan must be off (false or null)."""
        if d.get("do_pan_and_scan"):
            raise ValueError("do_pan_and_scan=True: pan-and-scan crops are not implemented (LLaMA-Factory leaves "
                             "them off)")
        return super().from_hf({k: v for k, v in d.items() if k not in _PAN_AND_SCAN})

    @classmethod
    def gemma3(cls) -> "Gemma3ImageProcessorConfig":
        """google/gemma-3-4b-it's preprocessor_config.json: 896 x 896, BILINEAR, mean and std 0.5, no pan-and-scan,
        do_convert_rgb null."""
        return cls(height=896, width=896, resample=2, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                   do_convert_rgb=None)
