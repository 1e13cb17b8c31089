"""models/vision_processing.py on both sides: the Qwen-VL image processor (transformers 5.24's
Qwen2VLImageProcessorPil) and LLaMA-Factory 0.9.5's Qwen2-VL mm plugin rules.

The torch side runs PIL, as HF does; the numpy twin (jax_oracles) redoes PIL's PNG decoding, BICUBIC resize,
premultiplied-RGBA resize and alpha compositing from Pillow's C source. Every comparison of pixel_values is
bit-equal (float32 compared as uint32 bit patterns), against transformers and PIL, and the twins against each other.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from jax_oracles.models import vision_processing as J
from torch_sources.models import vision_processing as T

transformers = pytest.importorskip("transformers")
from transformers.image_transforms import convert_to_rgb as hf_convert_to_rgb  # noqa: E402
from transformers.image_transforms import normalize as hf_normalize  # noqa: E402
from transformers.image_transforms import rescale as hf_rescale  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (  # noqa: E402
    Qwen2VLImageProcessorPil, smart_resize as hf_smart_resize)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
IMAGE_DIR = ROOT / "assets" / "images"
IMAGES = sorted(IMAGE_DIR.glob("*.png"))
# The hub preprocessor_config.json of each family, as HF kwargs (no hub access: built explicitly).
HF_KWARGS = {
    "qwen2_vl": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                 "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                 "image_std": [0.26862954, 0.26130258, 0.27577711]},
    "qwen3_vl": {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
}


def hf_processor(**kwargs) -> Qwen2VLImageProcessorPil:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Qwen2VLImageProcessorPil(**kwargs)


def hf_process(processor, images) -> tuple[np.ndarray, np.ndarray]:
    out = processor(images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def assert_bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def pil_array(im: Image.Image) -> np.ndarray:
    a = np.asarray(im)
    return a[..., None] if a.ndim == 2 else a


def pil_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    im = Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image)
    return pil_array(im.resize((width, height), Image.Resampling.BICUBIC))


def random_image(rng, h, w, c) -> np.ndarray:
    img = rng.integers(0, 256, (h, w, c), dtype=np.uint8)
    if c == 4:  # fully clear, fully opaque and partial alphas
        img[..., 3] = rng.choice(np.array([0, 255, 1, 7, 128, 200, 254], np.uint8), (h, w))
    return img


# ---- the public surface and the torch-free twin ----------------------------------------------------------------

def test_public_names_mirror_torch():
    assert T.__all__ == J.__all__
    assert T.LF_TEMPLATE_TOKENS == J.LF_TEMPLATE_TOKENS and T.OPENAI_CLIP_MEAN == J.OPENAI_CLIP_MEAN


def test_numpy_side_imports_no_torch_transformers_or_pil():
    code = ("import sys, jax_oracles.models.vision_processing; bad = [m for m in ('torch', 'transformers', "
            "'torch_sources', 'PIL') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


# ---- the shipped images ----------------------------------------------------------------------------------------

def _png_row_filters(data: bytes) -> set[int]:
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, tag = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        header = struct.unpack(">IIBBBBB", body) if tag == b"IHDR" else header
        idat += body if tag == b"IDAT" else b""
        pos += 12 + length
    width, height, _, color, *_ = header
    stride = width * {0: 1, 2: 3, 6: 4}[color] + 1
    raw = zlib.decompress(idat)
    return {raw[y * stride] for y in range(height)}


def test_make_images_is_byte_reproducible(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_images.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == [p.name for p in IMAGES]
    for p in IMAGES:
        assert (tmp_path / p.name).read_bytes() == p.read_bytes(), p.name
    assert sum(p.stat().st_size for p in IMAGES) < 80_000
    modes = {Image.open(p).mode for p in IMAGES}
    assert modes == {"L", "RGB", "RGBA"}, modes
    for p in IMAGES:  # every file with 5+ rows carries all five PNG row filters, for the decoder test below
        if Image.open(p).size[1] >= 5:
            assert _png_row_filters(p.read_bytes()) == {0, 1, 2, 3, 4}, p.name


def test_shipped_images_avoid_the_pillow_version_dependent_pass_order():
    # Pillow 13 resamples vertically first when the height shrinks by more than twice what the width does, older ones
    # horizontally first (test_resize_bicubic_pass_order_sweep_matches_pil): the shipped images keep clear of that.
    for p in IMAGES:
        img = J.read_png(p)
        for cfg in (J.QwenImageProcessorConfig.qwen2_vl(), J.QwenImageProcessorConfig.qwen3_vl()):
            for h, w in (img.shape[:2], J.preprocess_image_lf(img).shape[:2]):
                new_h, new_w = J.smart_resize(h, w, cfg.factor, cfg.min_pixels, cfg.max_pixels)
                assert not _vertical_first(h, w, new_h, new_w), (p.name, (h, w), (new_h, new_w))


def test_read_png_matches_pil(tmp_path):
    for p in IMAGES:
        ref = pil_array(Image.open(p))
        for side in (J, T):
            got = side.read_png(p)
            assert got.dtype == np.uint8 and got.shape == ref.shape, (p.name, got.shape, ref.shape)
            np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(J.load_image(p), T.load_image(p))
    # PIL's own encoder (adaptive filters, stored and max compression, ancillary chunks): what a dataset holds
    rng = np.random.default_rng(3)
    for i, (mode, c) in enumerate([("L", 1), ("RGB", 3), ("RGBA", 4)] * 2):
        smooth = np.cumsum(rng.integers(-2, 3, (23, 31, c)), axis=1) + 128
        img = np.clip(smooth, 0, 255).astype(np.uint8) if i < 3 else random_image(rng, 17, 9, c)
        path = tmp_path / f"pil_{i}.png"
        Image.fromarray(img[..., 0] if c == 1 else img, mode).save(path, compress_level=9 * (i % 2), dpi=(72, 72))
        np.testing.assert_array_equal(J.read_png(path), img)


def test_read_png_refuses_what_it_does_not_decode(tmp_path):
    rng = np.random.default_rng(4)
    rgb = random_image(rng, 8, 8, 3)
    cases = {
        "palette": Image.fromarray(rgb).convert("P"),
        "16bit": Image.fromarray(rng.integers(0, 65535, (8, 8), dtype=np.uint16)),
        "gray_alpha": Image.fromarray(rgb).convert("LA"),
    }
    for name, im in cases.items():
        im.save(tmp_path / f"{name}.png")
    Image.fromarray(rgb).save(tmp_path / "trns.png", transparency=(0, 0, 0))
    data = bytearray((IMAGE_DIR / "gradient_64x48.png").read_bytes())
    data[28] = 1  # IHDR's interlace byte (8 signature + 8 chunk head + 12 into IHDR), CRC fixed below
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    (tmp_path / "interlaced.png").write_bytes(bytes(data))
    for name in [*cases, "trns", "interlaced"]:
        for side in (J, T):
            with pytest.raises(ValueError):
                side.read_png(tmp_path / f"{name}.png")
    corrupt = bytearray((IMAGE_DIR / "gradient_64x48.png").read_bytes())
    corrupt[60] ^= 0xFF  # inside IDAT: the CRC no longer matches
    (tmp_path / "corrupt.png").write_bytes(bytes(corrupt))
    with pytest.raises(ValueError, match="CRC"):
        J.read_png(tmp_path / "corrupt.png")


# ---- PIL's BICUBIC resize and HF's RGB conversion in numpy ------------------------------------------------------

SRC_SIZES = [(1, 1), (1, 7), (9, 1), (2, 3), (5, 5), (13, 17), (48, 64), (37, 100), (90, 130)]
DST_SIZES = [(1, 1), (1, 9), (9, 1), (3, 2), (7, 5), (28, 28), (56, 84), (99, 13), (31, 257), (200, 150)]


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_resize_bicubic_matches_pil(channels):
    rng = np.random.default_rng(channels)
    pairs = [(s, d) for s in SRC_SIZES for d in DST_SIZES] + [((200, 300), (3, 7)), ((3, 5), (97, 211)),
                                                              ((64, 64), (64, 29)), ((64, 64), (29, 64))]
    for (h, w), (height, width) in pairs:
        img = random_image(rng, h, w, channels)
        got = J.resize_bicubic(img, height, width)
        assert got.dtype == np.uint8 and got.shape == (height, width, channels)
        np.testing.assert_array_equal(got, pil_resize(img, height, width), err_msg=f"{(h, w)} -> {(height, width)}")
    img = random_image(rng, 6, 4, channels)
    for side in (J, T):
        np.testing.assert_array_equal(side.resize_bicubic(img, 6, 4), img)  # same size: PIL's copy
        with pytest.raises(ValueError):
            side.resize_bicubic(img, 0, 4)


def test_resize_bicubic_pass_order_is_pillow_13s():
    # Height shrinking, width not: Pillow 13 resamples vertically first; with horizontal first the result differs.
    rng = np.random.default_rng(7)
    img = random_image(rng, 90, 130, 3)
    ref = pil_resize(img, 84, 140)
    np.testing.assert_array_equal(J.resize_bicubic(img, 84, 140), ref)
    horizontal_first = J.resize_bicubic(J.resize_bicubic(img, 90, 140), 84, 140)
    assert not np.array_equal(horizontal_first, ref)


def _vertical_first(h, w, height, width):  # Pillow 13.0's rule: the height shrinks by more than twice the width
    return h - height > 0 and h - height > 2 * (w - width)


# (h, w) -> (height, width) where the two pass orders give different bits: each order's side of the rule's edges
PASS_ORDER_EDGES = [((100, 40), (32, 32)),  # both shrink, the height > 2x as much: vertical first
                    ((75, 49), (45, 10)),  # the width shrinks more: horizontal first
                    ((19, 5), (11, 1)),  # h - height == 2 (w - width), a tie: horizontal first
                    ((20, 5), (11, 1)),  # one past the tie: vertical first
                    ((10, 10), (12, 60))]  # h - height > 2 (w - width) < 0, the height grows: horizontal first


def test_resize_bicubic_pass_order_sweep_matches_pil():
    # a seeded sweep over sizes 1..120, each axis down- or upscaled, L, RGB and RGBA (premultiplied), bit for bit
    rng = np.random.default_rng(13)
    cases = [(src, dst, c) for src, dst in PASS_ORDER_EDGES for c in (1, 3, 4)]
    for i in range(360):
        c, h_down, w_down = (1, 3, 4)[i % 3], (i // 3) % 2, (i // 6) % 2
        h, w = (int(x) for x in rng.integers(2, 121, 2))
        height = int(rng.integers(1, h)) if h_down else int(rng.integers(h + 1, 121)) if h < 120 else h
        width = int(rng.integers(1, w)) if w_down else int(rng.integers(w + 1, 121)) if w < 120 else w
        cases.append(((h, w), (height, width), c))
    assert sum(_vertical_first(*src, *dst) for src, dst, _ in cases) > 60  # both orders well represented
    assert sum(not _vertical_first(*src, *dst) for src, dst, _ in cases) > 60
    for (h, w), (height, width), c in cases:
        img = random_image(rng, h, w, c)
        np.testing.assert_array_equal(J.resize_bicubic(img, height, width), pil_resize(img, height, width),
                                      err_msg=f"{(h, w, c)} -> {(height, width)}")
    for (h, w), (height, width) in PASS_ORDER_EDGES:  # the other order is off there: the edges pin the rule down
        img = random_image(rng, h, w, 3)
        other = (J.resize_bicubic(J.resize_bicubic(img, h, width), height, width) if _vertical_first(h, w, height, width)
                 else J.resize_bicubic(J.resize_bicubic(img, height, w), height, width))
        assert not np.array_equal(other, pil_resize(img, height, width)), ((h, w), (height, width))


def test_to_rgb_matches_hf_convert_to_rgb():
    rng = np.random.default_rng(5)
    for c in (1, 3, 4):
        img = random_image(rng, 19, 23, c)
        ref = hf_convert_to_rgb(Image.fromarray(img[..., 0] if c == 1 else img), return_numpy=True)
        for side in (J, T):
            got = side.to_rgb(img)
            assert got.dtype == np.uint8
            np.testing.assert_array_equal(got, ref)
    clear = np.zeros((1, 1, 4), np.uint8)  # fully transparent black composites to white
    assert J.to_rgb(clear).tolist() == [[[255, 255, 255]]]


def test_rescale_normalize_match_hf():
    rng = np.random.default_rng(6)
    img = rng.integers(0, 256, (3, 11, 13), dtype=np.uint8)
    ref = hf_rescale(img, 1 / 255, data_format="channels_first", input_data_format="channels_first")
    assert_bits_equal(J.rescale(img, 1 / 255), ref)
    assert_bits_equal(T.rescale(torch.from_numpy(img), 1 / 255), ref)
    mean, std = T.OPENAI_CLIP_MEAN, T.OPENAI_CLIP_STD
    ref_n = hf_normalize(ref, mean, std, data_format="channels_first", input_data_format="channels_first")
    assert_bits_equal(J.normalize(ref, mean, std), ref_n)
    assert_bits_equal(T.normalize(torch.from_numpy(ref), mean, std), ref_n)
    # rescaling in float32 would differ: HF's float64 product, cast once, is what we match
    assert not np.array_equal(img.astype(np.float32) * np.float32(1 / 255), ref)


# ---- smart_resize and the config ----------------------------------------------------------------------------------

SIDES = [1, 2, 3, 13, 27, 28, 29, 41, 42, 55, 56, 57, 70, 80, 100, 126, 150, 1000, 4000, 9000]  # 70, 126: x.5 ties
SMART_RESIZE_ARGS = [(28, 3136, 12845056), (32, 65536, 16777216), (28, 56 * 56, 28 * 28 * 1280), (28, 3136, 28 * 28 * 4)]


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 (the exception is the outcome compared)
        return type(e), str(e)


def test_smart_resize_matches_transformers():
    errors = 0
    for factor, min_pixels, max_pixels in SMART_RESIZE_ARGS:
        for h in SIDES + [0]:
            for w in SIDES:
                ref = _outcome(hf_smart_resize, h, w, factor, min_pixels, max_pixels)
                assert _outcome(J.smart_resize, h, w, factor, min_pixels, max_pixels) == ref, (h, w, factor)
                assert _outcome(T.smart_resize, h, w, factor, min_pixels, max_pixels) == ref, (h, w, factor)
                errors += isinstance(ref[0], type)
    assert errors > 0  # the aspect-ratio and zero-side errors were exercised
    assert J.smart_resize(90, 130) == (84, 140) and J.smart_resize(100, 40) == (112, 28)
    with pytest.raises(ValueError, match="aspect ratio"):
        J.smart_resize(1, 201)


def test_config_from_hf_matches_hf_processor():
    for name, kwargs in HF_KWARGS.items():
        for side in (J, T):
            cfg = side.QwenImageProcessorConfig.from_hf(kwargs)
            assert cfg == getattr(side.QwenImageProcessorConfig, name)()
            hf = hf_processor(**kwargs)
            assert (hf.size["shortest_edge"], hf.size["longest_edge"]) == (cfg.min_pixels, cfg.max_pixels)
            assert (hf.patch_size, hf.merge_size, hf.temporal_patch_size) == (
                cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size)
            assert tuple(hf.image_mean) == cfg.image_mean and tuple(hf.image_std) == cfg.image_std
            assert (hf.do_resize, hf.do_rescale, hf.rescale_factor, hf.do_normalize, hf.do_convert_rgb, hf.resample) == (
                cfg.do_resize, cfg.do_rescale, cfg.rescale_factor, cfg.do_normalize, cfg.do_convert_rgb, cfg.resample)
    default, hf = J.QwenImageProcessorConfig(), hf_processor()  # the class defaults
    assert (hf.size["shortest_edge"], hf.size["longest_edge"]) == (default.min_pixels, default.max_pixels)
    # min/max_pixels override `size`, as in HF's __init__
    both = {"size": {"shortest_edge": 1, "longest_edge": 2}, "min_pixels": 100, "max_pixels": 200}
    assert (J.QwenImageProcessorConfig.from_hf(both).min_pixels, J.QwenImageProcessorConfig.from_hf(both).max_pixels,
            hf_processor(**both).size["shortest_edge"]) == (100, 200, 100)
    with pytest.raises(ValueError):
        J.QwenImageProcessorConfig.from_hf({"size": {"longest_edge": 1000}})


# ---- the whole processor against transformers --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2_vl", "qwen3_vl"])
def test_process_images_bit_equal_to_hf(name):
    hf = hf_processor(**HF_KWARGS[name])
    jcfg, tcfg = getattr(J.QwenImageProcessorConfig, name)(), getattr(T.QwenImageProcessorConfig, name)()
    for p in IMAGES:
        ref_pv, ref_grid = hf_process(hf, Image.open(p))
        t_pv, t_grid = T.process_images([T.read_png(p)], tcfg)
        j_pv, j_grid = J.process_images([J.read_png(p)], jcfg)
        assert t_pv.dtype == torch.float32 and t_grid.dtype == torch.int64 and j_grid.dtype == np.int64
        assert_bits_equal(t_pv.numpy(), ref_pv)
        assert_bits_equal(j_pv, ref_pv)
        np.testing.assert_array_equal(t_grid.numpy(), ref_grid)
        np.testing.assert_array_equal(j_grid, ref_grid)
        assert ref_pv.shape == (int(ref_grid.prod()), 3 * 2 * jcfg.patch_size**2)
    ref_pv, ref_grid = hf_process(hf, [Image.open(p) for p in IMAGES])  # one batch: concatenated in order
    j_pv, j_grid = J.process_images([J.read_png(p) for p in IMAGES], jcfg)
    assert_bits_equal(j_pv, ref_pv)
    np.testing.assert_array_equal(j_grid, ref_grid)


@pytest.mark.parametrize("overrides", [{"do_rescale": False}, {"do_normalize": False},
                                       {"do_rescale": False, "do_normalize": False}, {"do_resize": False},
                                       {"rescale_factor": 0.5, "image_mean": [0.1, 0.2, 0.3]}])
def test_process_images_flags_match_hf(overrides):
    kwargs = {**HF_KWARGS["qwen2_vl"], **overrides}
    hf = hf_processor(**kwargs)
    cfg = J.QwenImageProcessorConfig.from_hf(kwargs)
    names = ["exact_112x84.png"] if overrides.get("do_resize") is False else ["wide_150x90.png", "alpha_56x56.png"]
    for n in names:
        ref_pv, ref_grid = hf_process(hf, Image.open(IMAGE_DIR / n))
        assert_bits_equal(J.process_images([J.read_png(IMAGE_DIR / n)], cfg)[0], ref_pv)
        assert_bits_equal(T.process_images([T.read_png(IMAGE_DIR / n)], cfg)[0].numpy(), ref_pv)


def test_patch_layout_literal():
    # pixel (c, y, x) = c * 100 + 10 * (y // 14) + (x // 14): each row names its patch; no rescale/normalize
    cfg = J.QwenImageProcessorConfig(do_rescale=False, do_normalize=False, do_resize=False)
    y, x = np.mgrid[0:56, 0:84]
    img = np.stack([c * 100 + 10 * (y // 14) + x // 14 for c in range(3)], -1).astype(np.uint8)
    for side in (J, T):
        pv, grid = side.process_images([img], cfg)
        pv = np.asarray(pv).reshape(-1, 3, 2, 14, 14)
        assert np.asarray(grid).tolist() == [[1, 4, 6]]
        # merge windows first: rows 0-3 are patches (0,0) (0,1) (1,0) (1,1), row 4 starts the next window (0,2)
        heads = [int(pv[i, 0, 0, 0, 0]) for i in range(8)]
        assert heads == [0, 1, 10, 11, 2, 3, 12, 13]
        assert (pv[:, :, 0] == pv[:, :, 1]).all()  # the image repeated over the temporal patch
        assert pv[5, 2, 1, 13, 13] == 200 + 3  # channel 2 of patch (0,3)


# ---- LLaMA-Factory's Qwen2VLPlugin --------------------------------------------------------------------------------

LF_SIZES = [  # (width, height, channels) -> LF's output (width, height), worked out from mm_plugin.py by hand
    ((1000, 700, 3), (917, 642)),  # > 768*768: scaled by sqrt(768^2 / 700000), truncated by int()
    ((30, 20, 3), (39, 28)),  # < 32*32: scaled up to 39x26, then the short side raised to 28
    ((20, 60, 1), (28, 60)),  # grayscale: short side raised to 28
    ((27, 100, 3), (28, 100)),
    ((28, 100, 3), (28, 100)),  # 28 is enough: untouched
    ((250, 2, 3), (357, 28)),  # 500 px: up to 357x2, then 28 rows
    ((6000, 5, 3), (5040, 28)),  # 6000x28 has aspect 214 > 200: width cut to 180 * 28
    ((5, 6000, 3), (28, 5040)),
    ((112, 84, 3), (112, 84)),  # in range: untouched
]


@pytest.mark.parametrize("size,expected", LF_SIZES)
def test_lf_preprocess_sizes_and_twins(size, expected):
    width, height, c = size
    img = random_image(np.random.default_rng(width * height), height, width, c)
    got_t, got_j = T.preprocess_image_lf(img), J.preprocess_image_lf(img)
    assert got_j.shape == got_t.shape == (expected[1], expected[0], 3)
    np.testing.assert_array_equal(got_j, got_t)
    if expected == (width, height) and c == 3:
        np.testing.assert_array_equal(got_j, img)


def test_lf_preprocess_drops_alpha_without_compositing():
    rgba = J.read_png(IMAGE_DIR / "alpha_56x56.png")
    for side in (J, T):
        out = side.preprocess_image_lf(rgba)
        np.testing.assert_array_equal(out, rgba[..., :3])  # LF: convert("RGB") drops alpha
        assert not np.array_equal(out, side.to_rgb(rgba))  # HF alone: composited onto white
    # an RGBA image LF does resize is resampled premultiplied (PIL's RGBa), then loses its alpha
    small = random_image(np.random.default_rng(8), 20, 30, 4)
    np.testing.assert_array_equal(J.preprocess_image_lf(small), T.preprocess_image_lf(small))


def test_lf_then_hf_pipeline_bit_equal():
    for name in ("qwen2_vl", "qwen3_vl"):
        hf, cfg = hf_processor(**HF_KWARGS[name]), getattr(J.QwenImageProcessorConfig, name)()
        lf_images = [T.preprocess_image_lf(T.read_png(p)) for p in IMAGES]
        ref_pv, ref_grid = hf_process(hf, [Image.fromarray(a) for a in lf_images])
        j_pv, j_grid = J.process_images([J.preprocess_image_lf(J.read_png(p)) for p in IMAGES], cfg)
        assert_bits_equal(j_pv, ref_pv)
        np.testing.assert_array_equal(j_grid, ref_grid)


def test_expand_image_placeholders_literal():
    messages = [{"role": "user", "content": "<image>Compare with<image>."},
                {"role": "assistant", "content": "Same as <image>"}]
    grid = np.array([[1, 4, 4], [1, 6, 10], [1, 2, 2]], np.int64)
    vs, pad, ve = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
    expected = [{"role": "user", "content": f"{vs}{pad * 4}{ve}Compare with{vs}{pad * 15}{ve}."},
                {"role": "assistant", "content": f"Same as {vs}{pad}{ve}"}]
    before = [dict(m) for m in messages]
    assert J.expand_image_placeholders(messages, grid, 2) == expected
    assert T.expand_image_placeholders(messages, torch.from_numpy(grid), 2) == expected
    assert messages == before  # LF deep-copies
    omni = J.expand_image_placeholders(messages[:1], grid[:2], 2, **J.LF_TEMPLATE_TOKENS["qwen2_omni"])
    assert omni[0]["content"] == ("<|vision_bos|>" + "<|IMAGE|>" * 4 + "<|vision_eos|>Compare with<|vision_bos|>"
                                  + "<|IMAGE|>" * 15 + "<|vision_eos|>.")
    assert J.expand_image_placeholders([{"role": "user", "content": "hi"}], np.zeros((0, 3), np.int64), 2) == [
        {"role": "user", "content": "hi"}]
    for side, g in ((J, np.array([[2, 4, 4]])), (T, torch.tensor([[2, 4, 4]]))):  # LF counts t*h*w // merge^2
        assert side.expand_image_placeholders([{"role": "user", "content": "<image>"}], g, 2)[0]["content"] == (
            vs + pad * 8 + ve)


@pytest.mark.parametrize("content,n_images,match", [
    ("<image><image>", 1, "number of images"), ("no image", 1, "number of images"), ("<image>", 2, "number of images"),
    ("<image><video>", 1, "number of videos"), ("<audio>", 0, "number of audios")])
def test_expand_image_placeholders_count_errors(content, n_images, match):
    messages = [{"role": "user", "content": content}]
    grid = np.ones((n_images, 3), np.int64)
    errors = []
    for side, g in ((J, grid), (T, torch.from_numpy(grid))):
        with pytest.raises(ValueError, match=match) as e:
            side.expand_image_placeholders(messages, g, 2)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_image_token_counts_match_hf():
    for name in ("qwen2_vl", "qwen3_vl"):
        hf, cfg = hf_processor(**HF_KWARGS[name]), getattr(J.QwenImageProcessorConfig, name)()
        for p in IMAGES:
            img = J.read_png(p)
            _, grid = J.process_images([img], cfg)
            content = J.expand_image_placeholders([{"role": "user", "content": "<image>"}], grid, cfg.merge_size)
            n = content[0]["content"].count("<|image_pad|>")
            assert n == hf.get_number_of_image_patches(img.shape[0], img.shape[1]) // cfg.merge_size**2, p.name
