"""Write the small test images under assets/images/ (`python tools/make_images.py [--out DIR]`).

Smooth gradients, a disc, a bar and a little noise (numpy RNG, fixed seed), so that a bicubic resize really
changes pixels. The sizes are picked for the Qwen-VL processors (models/vision_processing.py): smart_resize
(factor 28) takes 150x90 down to 140x84 and 40x100 to 28x112 (one side rounded down, one up), 112x84 is already a
multiple of 28 (PIL's same-size copy), 20x60 trips LLaMA-Factory's min-side-28 rule, 250x2 its min_pixels upscale,
and Qwen3-VL's min_pixels (256^2) upsamples every one of them. One grayscale (L) and one RGBA image exercise the RGB
conversions. No resize of these shrinks the height while keeping or growing the width, the one case where Pillow
versions order the two resampling passes differently (13.0 vertical first, <= 12.1 horizontal first): every Pillow
resamples these images the same way.

The PNG encoder is our own (stdlib zlib + numpy): row i uses filter i % 5, so every file carries all five
filter types (None, Sub, Up, Average, Paeth) for jax_oracles/models/vision_processing.py's decoder. Two runs
write byte-identical files (the same zlib).
"""

from __future__ import annotations

import argparse
import struct
import zlib
from pathlib import Path

import numpy as np

__all__ = ["IMAGES", "SEED", "make_image", "encode_png", "main"]

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "assets" / "images"
SEED = 20240917
# (file name, width, height, channels): 1 = L, 3 = RGB, 4 = RGBA
IMAGES = (
    ("gradient_64x48.png", 64, 48, 3),
    ("exact_112x84.png", 112, 84, 3),
    ("portrait_40x100.png", 40, 100, 3),
    ("wide_150x90.png", 150, 90, 3),
    ("gray_20x60.png", 20, 60, 1),
    ("alpha_56x56.png", 56, 56, 4),
    ("strip_250x2.png", 250, 2, 3),
)
_COLOR_TYPE = {1: 0, 3: 2, 4: 6}  # PNG colour types: gray, truecolour, truecolour + alpha


def make_image(width: int, height: int, channels: int, rng: np.random.Generator) -> np.ndarray:
    """uint8[H,W,C]: per-channel gradients at random angles, a disc and a bar, plus +-3 noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    u, v = x / max(width - 1, 1), y / max(height - 1, 1)
    planes = []
    for _ in range(min(channels, 3)):
        a, b, c = rng.uniform(-1.0, 1.0, 3)
        planes.append(128 + 90 * np.sin(3.0 * (a * u + b * v) + 2.0 * c))
    img = np.stack(planes, -1)
    cx, cy, r = rng.uniform(0.3, 0.7) * width, rng.uniform(0.3, 0.7) * height, 0.3 * min(width, height) + 1
    img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.uniform(0, 255, img.shape[-1])
    img[:, int(0.15 * width):int(0.15 * width) + max(1, width // 12)] = rng.uniform(0, 255, img.shape[-1])
    img += rng.integers(-3, 4, img.shape)
    if channels == 4:  # alpha: opaque at the top, clear at the bottom, a fully transparent corner
        alpha = 255 * (1 - v) + rng.integers(-3, 4, v.shape)
        alpha[: height // 4, : width // 4] = 0
        img = np.concatenate([img, alpha[..., None]], -1)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def _paeth(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a + b - c
    pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
    return np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))


def encode_png(image: np.ndarray) -> bytes:
    """uint8[H,W,C] (C in 1, 3, 4) -> PNG bytes, 8-bit, not interlaced, row filter = row index % 5."""
    h, w, c = image.shape
    raw = image.reshape(h, w * c).astype(np.int32)
    prior = np.vstack([np.zeros((1, w * c), np.int32), raw[:-1]])  # the row above (zeros above row 0)
    left = np.hstack([np.zeros((h, c), np.int32), raw[:, :-c]])  # the byte one pixel to the left
    upleft = np.hstack([np.zeros((h, c), np.int32), prior[:, :-c]])
    predictors = [np.zeros_like(raw), left, prior, (left + prior) // 2, _paeth(left, prior, upleft)]
    rows = []
    for i in range(h):
        kind = i % 5
        rows.append(bytes([kind]) + ((raw[i] - predictors[kind][i]) % 256).astype(np.uint8).tobytes())

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, _COLOR_TYPE[c], 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"".join(rows), 9))
            + chunk(b"IEND", b""))


def main(out_dir: Path = OUT_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    paths = []
    for name, width, height, channels in IMAGES:
        path = out_dir / name
        path.write_bytes(encode_png(make_image(width, height, channels, rng)))
        paths.append(path)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    for p in main(parser.parse_args().out):
        print(f"{p} {p.stat().st_size} bytes")
