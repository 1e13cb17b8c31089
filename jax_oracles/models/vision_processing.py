"""The Qwen-VL image processor and LLaMA-Factory's Qwen2-VL mm plugin in numpy: the torch- and PIL-free twin of
torch_sources/models/vision_processing.py (same public names, same order).

The sandbox that runs this has no Pillow, so what PIL does there is redone here from its C source
(python-pillow/Pillow src/libImaging; Pillow 13.0, the one installed beside transformers): a PNG decoder (stdlib
zlib; 8-bit gray / RGB / RGBA, not interlaced, the five row filters), Resample.c's BICUBIC resize in its fixed-point
arithmetic, Convert.c's RGBA <-> RGBa premultiplication that `Image.resize` wraps around RGBA, and
AlphaComposite.c's compositing onto white that HF's convert_to_rgb applies. tests/models/test_vision_processing.py
holds every piece equal to PIL and the whole to transformers' Qwen2VLImageProcessorPil bit for bit.

Images are uint8[H,W,C] numpy arrays, C = 1 (L), 3 (RGB) or 4 (RGBA).
"""

from __future__ import annotations

import copy
import math
import struct
import zlib
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

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
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_CHANNELS = {0: 1, 2: 3, 6: 4}  # PNG colour type -> channels: gray, truecolour, truecolour + alpha
_PRECISION_BITS = 32 - 8 - 2  # Resample.c: 8 bits of result, 2 of headroom for negative / >1 filter sums


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


def _check(image: np.ndarray) -> np.ndarray:
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
        raise ValueError(f"expected uint8[H,W,C] with C in (1, 3, 4), got {image.dtype}{list(image.shape)}")
    return image


def _unfilter_sequential(kind: int, line: bytes, prior: bytes, bpp: int) -> bytes:
    # Average (3) and Paeth (4) predict from the byte already reconstructed to the left: a recurrence along
    # the row, so a loop over its bytes (the images this reads are small).
    cur = bytearray(line)
    for i in range(len(cur)):
        a = cur[i - bpp] if i >= bpp else 0
        b = prior[i]
        if kind == 3:
            pred = (a + b) >> 1
        else:
            c = prior[i - bpp] if i >= bpp else 0
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
        cur[i] = (cur[i] + pred) & 0xFF
    return bytes(cur)


def read_png(path: str | Path) -> np.ndarray:
    """uint8[H,W,C]: an 8-bit gray (C=1), RGB (3) or RGBA (4) PNG, not interlaced. Anything else (palette,
    16-bit, gray+alpha, a tRNS chunk, interlaced, unknown critical chunks, a bad CRC) raises ValueError."""
    data = Path(path).read_bytes()
    if data[:8] != _PNG_SIGNATURE:
        raise ValueError(f"{path}: not a PNG file")
    header, idat, pos = None, [], 8
    while pos + 12 <= len(data):
        length, tag = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        if zlib.crc32(tag + body) != crc:
            raise ValueError(f"{path}: bad CRC in chunk {tag!r}")
        pos += 12 + length
        if tag == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif tag == b"IDAT":
            idat.append(body)
        elif tag == b"IEND":
            break
        elif tag == b"tRNS":  # a transparent colour would make PIL (and HF's to_rgb) treat the image as RGBA
            raise ValueError(f"{path}: tRNS chunks are not supported")
        elif not tag[0] & 0x20 and tag != b"PLTE":  # lower-case first letter = ancillary, safe to skip
            raise ValueError(f"{path}: unsupported critical chunk {tag!r}")
    if header is None or not idat:
        raise ValueError(f"{path}: no IHDR or IDAT chunk")
    width, height, depth, color, compression, filter_method, interlace = header
    if depth != 8 or color not in _PNG_CHANNELS or interlace != 0 or compression != 0 or filter_method != 0:
        raise ValueError(f"{path}: only 8-bit gray/RGB/RGBA non-interlaced PNGs are supported "
                         f"(bit depth {depth}, colour type {color}, interlace {interlace})")
    bpp = _PNG_CHANNELS[color]
    stride = width * bpp
    raw = zlib.decompress(b"".join(idat))
    if len(raw) != height * (stride + 1):
        raise ValueError(f"{path}: {len(raw)} bytes of image data, expected {height * (stride + 1)}")
    rows = np.frombuffer(raw, np.uint8).reshape(height, stride + 1)
    out = np.empty((height, stride), np.uint8)
    prior = np.zeros(stride, np.uint8)
    for y in range(height):  # each row is predicted from the one above, so rows go in order
        kind, line = int(rows[y, 0]), rows[y, 1:]
        if kind == 0:  # None
            cur = line
        elif kind == 1:  # Sub: a running sum per channel, mod 256
            cur = np.cumsum(line.reshape(width, bpp), axis=0, dtype=np.uint8).reshape(stride)
        elif kind == 2:  # Up
            cur = line + prior  # uint8 wraps mod 256
        elif kind in (3, 4):  # Average, Paeth
            cur = np.frombuffer(_unfilter_sequential(kind, line.tobytes(), prior.tobytes(), bpp), np.uint8)
        else:
            raise ValueError(f"{path}: row {y} has filter type {kind}")
        out[y] = cur
        prior = out[y]
    return out.reshape(height, width, bpp)


def to_rgb(image: np.ndarray) -> np.ndarray:
    """uint8[H,W,C] -> uint8[H,W,3] as HF's convert_to_rgb does a PIL image: L replicated, RGBA alpha-composited
    onto opaque white with AlphaComposite.c's integer arithmetic (7 extra bits, rounded divisions by 255)."""
    c = _check(image).shape[-1]
    if c == 1:
        return np.repeat(image, 3, axis=-1)
    if c == 3:
        return image.copy()
    src = image.astype(np.int64)
    src_a, dst, dst_a = src[..., 3:], 255, 255
    outa255 = src_a * 255 + dst_a * (255 - src_a)
    coef1 = src_a * 255 * 255 * (1 << 7) // np.maximum(outa255, 1)
    coef2 = 255 * (1 << 7) - coef1
    tmp = src[..., :3] * coef1 + dst * coef2 + (0x80 << 7)
    out = (((tmp >> 8) + tmp) >> 8) >> 7  # SHIFTFORDIV255 then drop the extra bits
    return np.where(src_a == 0, dst, out).astype(np.uint8)


def load_image(path: str | Path) -> np.ndarray:
    """uint8[H,W,3]: read_png then to_rgb, what the HF processor makes of `Image.open(path)`."""
    return to_rgb(read_png(path))


def _bicubic_filter(x: np.ndarray) -> np.ndarray:
    # Resample.c bicubic_filter, a = -0.5, with the C's operation order (the weights must match to the last bit)
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


def _bilinear_filter(x: np.ndarray) -> np.ndarray:  # Resample.c bilinear_filter: 1 - |x| inside (-1, 1)
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


_FILTERS = {2: (_bilinear_filter, 1.0), 3: (_bicubic_filter, 2.0)}  # PIL Resampling id -> (filter, support)


def _precompute_coeffs(in_size: int, out_size: int, resample: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Resample.c precompute_coeffs + normalize_coeffs_8bpc for the box (0, in_size) and filter `resample`: per
    output pixel the first source pixel xmin i64[out], the tap count xmax i64[out] and the fixed-point taps
    i64[out, ksize] (0 past xmax)."""
    kernel, kernel_support = _FILTERS[resample]
    scale = in_size / out_size
    filterscale = max(scale, 1.0)  # downscaling widens the filter by the scale
    support = kernel_support * filterscale
    ksize = int(math.ceil(support)) * 2 + 1
    center = (np.arange(out_size) + 0.5) * scale
    xmin = np.maximum(np.trunc(center - support + 0.5), 0).astype(np.int64)  # C's (int) cast truncates
    xmax = np.minimum(np.trunc(center + support + 0.5), in_size).astype(np.int64) - xmin
    taps = np.arange(ksize)
    w = kernel(((taps + xmin[:, None]) - center[:, None] + 0.5) * (1.0 / filterscale))
    w = np.where(taps < xmax[:, None], w, 0.0)
    ww = np.cumsum(w, axis=1)[:, -1:]  # the C adds the taps left to right; cumsum keeps that order
    w = np.divide(w, ww, out=w.copy(), where=ww != 0.0)
    scaled = w * (1 << _PRECISION_BITS)
    return xmin, xmax, np.trunc(np.where(w < 0, -0.5 + scaled, 0.5 + scaled)).astype(np.int64)


def _resample_rows(image: np.ndarray, xmin: np.ndarray, kk: np.ndarray) -> np.ndarray:
    """uint8[N,L,C] -> uint8[N,out,C] along axis 1: sum of taps in fixed point, + 1/2, >> 22, clipped (clip8)."""
    idx = np.minimum(xmin[:, None] + np.arange(kk.shape[1]), image.shape[1] - 1)  # taps past xmax weigh 0
    acc = np.full((image.shape[0], len(xmin), image.shape[2]), 1 << (_PRECISION_BITS - 1), np.int64)
    for j in range(kk.shape[1]):
        acc += image[:, idx[:, j], :].astype(np.int64) * kk[None, :, j, None]
    return np.clip(acc >> _PRECISION_BITS, 0, 255).astype(np.uint8)


def _resample(image: np.ndarray, height: int, width: int, resample: int = 3) -> np.ndarray:
    """Resample.c ImagingResampleInner (Pillow 13.0): two passes with a uint8 image in between; a pass whose size
    is unchanged is skipped. Vertical first iff the height shrinks by more than twice what the width does
    (h - height > 0 and h - height > 2 (w - width); a tie goes horizontal first), else horizontal first; the order
    changes the result by a last bit. The first pass reads only the rows (columns) the second pass reads: Pillow's
    saving, the same result, so the horizontal-first path crops rows and the vertical-first one needs no crop.
    (Pillow <= 12.1 always went horizontal first, 12.2-12.3 vertical first only for images over 100x taller than
    wide: PIL's own output is version dependent.)"""
    h, w, _ = image.shape
    vertical_first = h - height > 0 and h - height > 2 * (w - width)
    ymin, ymax, ky = _precompute_coeffs(h, height, resample)
    xmin, _, kx = _precompute_coeffs(w, width, resample)
    if width != w and not vertical_first:
        ybox_first, ybox_last = int(ymin[0]), int(ymin[-1] + ymax[-1])  # first and one-past-last rows read
        image = _resample_rows(image[ybox_first:ybox_last], xmin, kx)
        ymin = ymin - ybox_first
    if height != h:
        image = _resample_rows(image.transpose(1, 0, 2), ymin, ky).transpose(1, 0, 2)
    if width != w and vertical_first:
        image = _resample_rows(image, xmin, kx)
    return np.ascontiguousarray(image)


def _premultiply(image: np.ndarray) -> np.ndarray:  # Convert.c rgbA2rgba: RGB * alpha / 255, rounded (MULDIV255)
    x = image.astype(np.int64)
    t = x[..., :3] * x[..., 3:] + 128
    return np.concatenate([((t >> 8) + t) >> 8, x[..., 3:]], -1).astype(np.uint8)


def _unpremultiply(image: np.ndarray) -> np.ndarray:  # Convert.c rgba2rgbA: RGB * 255 / alpha, floored, clipped
    x = image.astype(np.int64)
    a = x[..., 3:]
    rgb = np.where((a == 0) | (a == 255), x[..., :3], np.minimum(255 * x[..., :3] // np.maximum(a, 1), 255))
    return np.concatenate([rgb, a], -1).astype(np.uint8)


def resize_pil(image: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8[H,W,C] -> uint8[height,width,C]: PIL 13.0's `Image.resize((width, height), resample)` bit for bit,
    resample 2 (BILINEAR) or 3 (BICUBIC) (Image.resize resamples RGBA premultiplied: RGBA -> RGBa -> resize ->
    RGBA)."""
    if resample not in _FILTERS:
        raise ValueError(f"resample={resample}: only PIL BILINEAR (2) and BICUBIC (3) are here")
    if height <= 0 or width <= 0:
        raise ValueError("height and width must be > 0")
    if (height, width) == _check(image).shape[:2]:  # Image.resize returns a copy
        return image.copy()
    if image.shape[-1] == 4:
        return _unpremultiply(_resample(_premultiply(image), height, width, resample))
    return _resample(image, height, width, resample)


def resize_bicubic(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8[H,W,C] -> uint8[height,width,C]: PIL's `Image.resize((width, height), BICUBIC)` bit for bit."""
    return resize_pil(image, height, width, 3)


def resize_bilinear(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8[H,W,C] -> uint8[height,width,C]: PIL's `Image.resize((width, height), BILINEAR)` bit for bit, the
    resample Gemma3ImageProcessorPil uses."""
    return resize_pil(image, height, width, 2)


def rescale(image: np.ndarray, scale: float) -> np.ndarray:
    """HF's rescale: upcast to float64, multiply, then cast to float32."""
    return (image.astype(np.float64) * scale).astype(np.float32)


def _check_channels(channels: int, mean, std) -> None:
    """HF's normalize refuses a mean or std of another length than the image's channels (a grey image where
    do_convert_rgb is off); broadcasting would make one channel three."""
    for name, values in (("mean", mean), ("std", std)):
        if len(values) != channels:
            raise ValueError(f"{name} must have {channels} elements if it is an iterable, got {len(values)}")


def normalize(image: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """f32[C,H,W] -> f32[C,H,W]: (x - mean) / std in float32, mean and std cast to float32 first (as HF)."""
    if not np.issubdtype(image.dtype, np.floating):
        image = image.astype(np.float32)
    _check_channels(image.shape[0], mean, std)
    mean_a = np.asarray(mean, dtype=image.dtype)[:, None, None]
    std_a = np.asarray(std, dtype=image.dtype)[:, None, None]
    return (image - mean_a) / std_a


def patchify(image: np.ndarray, patch_size: int, temporal_patch_size: int,
             merge_size: int) -> tuple[np.ndarray, int, int]:
    """f32[C,H,W] -> (f32[gh*gw, C*T*P*P], gh, gw). Rows go merge window by merge window (gh/m, gw/m, m, m) so that
    the merger's 2x2 neighbours are adjacent; each row is (C, T, P, P) with the image repeated over T."""
    image = np.asarray(image, dtype=np.float32)
    c, h, w = image.shape
    gh, gw, m, p = h // patch_size, w // patch_size, merge_size, patch_size
    x = image.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal_patch_size, p, p))  # [.., C, T, P, P]
    return x.reshape(gh * gw, c * temporal_patch_size * p * p), gh, gw


def process_images(images: list[np.ndarray],
                   config: QwenImageProcessorConfig) -> tuple[np.ndarray, np.ndarray]:
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
        x = image.transpose(2, 0, 1)  # u8[C,H,W]
        if config.do_rescale:
            x = rescale(x, config.rescale_factor)
        if config.do_normalize:
            x = normalize(x, config.image_mean, config.image_std)
        patches, gh, gw = patchify(x, config.patch_size, config.temporal_patch_size, config.merge_size)
        all_patches.append(patches)
        grids.append([1, gh, gw])
    return np.concatenate(all_patches), np.array(grids, dtype=np.int64)


def _convert_rgb_pil(image: np.ndarray) -> np.ndarray:  # PIL's convert("RGB"): L replicated, RGBA's alpha dropped
    return np.repeat(image, 3, axis=-1) if image.shape[-1] == 1 else image[..., :3].copy()


def preprocess_image_base(image: np.ndarray, image_max_pixels: int = 768 * 768,
                          image_min_pixels: int = 32 * 32) -> np.ndarray:
    """uint8[H,W,C] -> uint8[H',W',3]: LF's base plugin `_preprocess_image` (every plugin's, before its own rules
    and the HF processor). `Image.resize` with its default filter (BICUBIC), sizes truncated by int(); RGBA loses
    its alpha in convert("RGB") (no compositing, unlike HF's own to_rgb)."""
    height, width = _check(image).shape[:2]
    if width * height > image_max_pixels:
        resize_factor = math.sqrt(image_max_pixels / (width * height))
        image = resize_bicubic(image, int(height * resize_factor), int(width * resize_factor))
        height, width = image.shape[:2]
    if width * height < image_min_pixels:
        resize_factor = math.sqrt(image_min_pixels / (width * height))
        image = resize_bicubic(image, int(height * resize_factor), int(width * resize_factor))
    return _convert_rgb_pil(image) if image.shape[-1] != 3 else image


def preprocess_image_lf(image: np.ndarray, image_max_pixels: int = 768 * 768,
                        image_min_pixels: int = 32 * 32) -> np.ndarray:
    """uint8[H,W,C] -> uint8[H',W',3]: LF's Qwen2VLPlugin._preprocess_image: the base plugin's
    (preprocess_image_base), then the Qwen size rules."""
    image = preprocess_image_base(image, image_max_pixels, image_min_pixels)
    height, width = image.shape[:2]
    # Qwen2VLPlugin: sides of at least 28, aspect ratio at most 200 (smart_resize refuses more)
    if min(width, height) < 28:
        width, height = max(width, 28), max(height, 28)
        image = resize_bicubic(image, height, width)
    if width / height > 200:
        width = height * 180
        image = resize_bicubic(image, height, width)
    if height / width > 200:
        height = width * 180
        image = resize_bicubic(image, height, width)
    return image


def expand_image_placeholders(messages: list[dict[str, str]], image_grid_thw: np.ndarray, merge_size: int, *,
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
            image_seqlen = int(np.prod(image_grid_thw[i])) // merge_length
            content = content.replace(IMAGE_PLACEHOLDER, f"{vision_bos_token}{image_token * image_seqlen}"
                                      f"{vision_eos_token}", 1)
            i += 1
        message["content"] = content
    return messages

