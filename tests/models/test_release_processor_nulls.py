"""The PaliGemma and Gemma 3 releases' preprocessor_config.json ship `"do_convert_rgb": null` (assets/tokenizer/<family>/
hold them). transformers' processor loaded from such a file keeps the null and converts nothing: an RGB image is
processed as before and a grey one is refused (its one channel against a three-value mean). Both sides read the file
the same way and do the same."""
from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from jax_oracles.models import vision_processing as jvp

ROOT = Path(__file__).resolve().parents[2]
IMAGES = sorted((ROOT / "assets/images").glob("*.png"))
# family -> (processing module, its config class, transformers' PIL processor module and class)
FAMILIES = {
    "paligemma": ("siglip_processing", "SiglipImageProcessorConfig", "siglip", "SiglipImageProcessorPil"),
    "gemma3": ("gemma3_processing", "Gemma3ImageProcessorConfig", "gemma3", "Gemma3ImageProcessorPil"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_release_processor_file_converts_nothing(family):
    from PIL import Image

    module, cls, hf_module, hf_cls = FAMILIES[family]
    tproc = importlib.import_module(f"torch_sources.models.{module}")
    jproc = importlib.import_module(f"jax_oracles.models.{module}")
    hf_class = getattr(importlib.import_module(f"transformers.models.{hf_module}.image_processing_pil_{hf_module}"),
                       hf_cls)
    files = ROOT / "assets/tokenizer" / family
    d = json.loads((files / "preprocessor_config.json").read_text())
    assert "do_convert_rgb" in d and d["do_convert_rgb"] is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = hf_class.from_pretrained(files)
    assert hf.do_convert_rgb is None
    configs = (getattr(tproc, cls).from_hf(d), getattr(jproc, cls).from_hf(d))
    assert all(c.do_convert_rgb is None for c in configs)
    rgb = [p for p in IMAGES if "wide" in p.name or "gradient" in p.name]
    want = hf([Image.open(p) for p in rgb], return_tensors="np")["pixel_values"]
    images = [jvp.read_png(p) for p in rgb]
    np.testing.assert_array_equal(tproc.process_images(images, configs[0]).numpy().view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(jproc.process_images(images, configs[1]).view(np.uint32), want.view(np.uint32))
    gray = next(p for p in IMAGES if p.name.startswith("gray"))
    with pytest.raises(ValueError, match="mean must have 1 elements"):
        hf([Image.open(gray)], return_tensors="np")
    for side, config in zip((tproc, jproc), configs):
        with pytest.raises(ValueError, match="mean must have 1 elements"):
            side.process_images([jvp.read_png(gray)], config)
