"""Gemma 3 (multimodal): the torch source against transformers' Gemma3ForConditionalGeneration on the shipped
checkpoint with images (in train mode with labels, as LLaMA-Factory calls it), the JAX twin against the torch
source (logits, and the gradients reaching the pixels and a decoder weight), the image-block masks, the module tree,
the conversion both ways, both config.json forms, the key audit and the refusals, the image processor against
Gemma3ImageProcessorPil, and the checkpoint's reproducibility."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")

from conversion import gemma3 as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import gemma3 as jg  # noqa: E402
from jax_oracles.models import gemma3_processing as jproc  # noqa: E402
from jax_oracles.models import vision_processing as jvp  # noqa: E402
from torch_sources.models import gemma3 as tg  # noqa: E402
from torch_sources.models import gemma3_processing as tproc  # noqa: E402
from torch_sources.models.config_keys import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/gemma3"
IMAGES = sorted((ROOT / "assets/images").glob("*.png"))
TORCH_TOL, JAX_TOL = 1e-5, 1e-4
BOS, PAD, BOI, EOI, IMG = 400, 402, 405, 406, 407
N_IMG, SIDE = 16, 64  # image tokens per image, pixels a side


def smoke_first(names):  # the first case in CI (make test), the others in make test-full
    return [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(names)]


def _batch(rows, T, n_images, seed=0, types=True):
    """rows: per row, (image offsets, real length): `<start_of_image> <image_soft_token>*16 <end_of_image>` at each
    offset, bos first, random text elsewhere, right padding; token_type_ids 1 at image tokens (the processor's)."""
    rng = np.random.default_rng(seed)
    ids = np.full((len(rows), T), PAD)
    mask = np.zeros_like(ids)
    for r, (offsets, length) in enumerate(rows):
        row = rng.integers(0, 400, length)
        row[0] = BOS
        for o in offsets:
            row[o:o + N_IMG + 2] = [BOI, *[IMG] * N_IMG, EOI]
        ids[r, :length], mask[r, :length] = row, 1
    pixels = rng.standard_normal((n_images, 3, SIDE, SIDE)).astype(np.float32)
    return ids, mask, pixels, (ids == IMG).astype(np.int64) if types else None


BATCHES = {
    # two images in a row (each block longer than the sliding window), a second row with one image
    "two-images": _batch([([2, 22], 50), ([5], 30)], 50, 3),
    # an image-free row beside an image row, padding
    "mixed": _batch([([1], 25), ([], 12)], 25, 1, seed=1),
    # no token_type_ids: transformers' plain causal / sliding masks
    "no-types": _batch([([3], 28)], 28, 1, seed=2, types=False),
}


@pytest.fixture(scope="module")
def models():
    from transformers import Gemma3ForConditionalGeneration
    hf = Gemma3ForConditionalGeneration.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32)
    hf.train()  # LLaMA-Factory's training forward: train mode, dropout 0, labels passed
    return hf, tg.Gemma3ForConditionalGeneration.from_pretrained(CKPT), conv.load_params(CKPT)


def _t(x):
    return None if x is None else torch.tensor(x)


def _src_logits(src, ids, mask, pixels, types):
    with torch.no_grad():
        return src(_t(ids), _t(mask), pixel_values=_t(pixels), token_type_ids=_t(types)).numpy()


def _jax_model():
    return jg.Gemma3ForConditionalGeneration(conv.load_config(CKPT))


@pytest.mark.parametrize("name", smoke_first(list(BATCHES)))
def test_source_matches_transformers(models, name):
    hf, src, _ = models
    ids, mask, pixels, types = BATCHES[name]
    labels = np.where(mask == 1, ids, -100)
    with torch.no_grad():
        want = hf(input_ids=_t(ids), attention_mask=_t(mask), pixel_values=_t(pixels), token_type_ids=_t(types),
                  labels=_t(labels)).logits.numpy()
    got = _src_logits(src, ids, mask, pixels, types)
    real = mask.astype(bool)  # pad rows' logits are never read
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("name", smoke_first(list(BATCHES)))
def test_jax_matches_source(models, name):
    _, src, params = models
    ids, mask, pixels, types = BATCHES[name]
    want = _src_logits(src, ids, mask, pixels, types)
    model = _jax_model()
    got = jax.jit(lambda p, i, m, x, t: model.apply({"params": p}, i, m, x, t))(params, ids, mask, pixels, types)
    assert np.abs(np.asarray(got) - want).max() <= JAX_TOL


def test_image_blocks_have_teeth(models):
    """The image tokens' bidirectional blocks (and their AND with the sliding window) are what the logits hold:
    without token_type_ids the image rows leave transformers' by far more than the tolerance; each row's runs of
    image tokens are numbered in order."""
    _, src, _ = models
    ids, mask, pixels, types = BATCHES["two-images"]
    with_blocks = _src_logits(src, ids, mask, pixels, types)
    causal = _src_logits(src, ids, mask, pixels, None)
    assert np.abs(with_blocks - causal)[ids == IMG].max() > 1e3 * TORCH_TOL
    blocks = tg.image_block_ids(torch.tensor(types)).numpy()
    assert set(blocks[0][ids[0] == IMG]) == {0, 1} and set(blocks[1][ids[1] == IMG]) == {0}
    np.testing.assert_array_equal(np.asarray(jg.image_block_ids(types)), blocks)
    masks = tg.vision_masks(torch.tensor(mask), torch.tensor(types), 8)
    jmasks = jg.vision_masks(mask, types, 8)
    for t in masks:
        np.testing.assert_array_equal(np.asarray(jmasks[t]), masks[t].numpy())
    first, last = 3, 3 + N_IMG - 1  # row 0's first image: [query, key]
    assert masks["full_attention"][0, last, first] and not masks["sliding_attention"][0, last, first]
    assert masks["sliding_attention"][0, last, last - 7] and not masks["sliding_attention"][0, last, last - 8]
    assert masks["sliding_attention"][0, first, last] and not masks["sliding_attention"][0, first - 1, first]


@pytest.mark.slow
def test_gradients_match(models):
    """d(sum(logits * w)) with respect to the pixels and to a decoder weight: torch against JAX."""
    _, src, params = models
    ids, mask, pixels, types = BATCHES["two-images"]
    w = np.random.default_rng(5).standard_normal((*ids.shape, src.config.vocab_size)).astype(np.float32)
    px = torch.tensor(pixels, requires_grad=True)
    (src(_t(ids), _t(mask), pixel_values=px, token_type_ids=_t(types)) * torch.tensor(w)).sum().backward()
    model = _jax_model()
    loss = lambda p, x: jnp.sum(model.apply({"params": p}, ids, mask, x, types) * w)  # noqa: E731
    g_params, g_pixels = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, pixels)
    want = px.grad.numpy()
    assert np.abs(want).max() > 1e-3
    assert np.abs(np.asarray(g_pixels) - want).max() <= JAX_TOL * np.abs(want).max()
    t_grad = src.model.language_model.layers[0].self_attn.q_proj.weight.grad.numpy()
    j_grad = np.asarray(g_params["model"]["language_model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]).T
    assert np.abs(j_grad - t_grad).max() <= JAX_TOL * np.abs(t_grad).max()


@pytest.mark.slow
def test_precomputed_image_embeds_match_the_pixels(models):
    """encode_images' rows (the frozen tower once per batch) give the forward on the pixels; JAX: jitted, the rows
    padded with rows never read."""
    _, src, params = models
    ids, mask, pixels, types = BATCHES["two-images"]
    want = _src_logits(src, ids, mask, pixels, types)
    with torch.no_grad():
        embeds = src.encode_images(torch.tensor(pixels))
        got = src(_t(ids), _t(mask), token_type_ids=_t(types), image_embeds=embeds).numpy()
    assert embeds.shape == (3 * N_IMG, 64)
    np.testing.assert_array_equal(got, want)
    model = _jax_model()

    def encoded_then_forward(p, x):
        e = model.apply({"params": p}, x, method="encode_images")
        return model.apply({"params": p}, ids, mask, None, types, image_embeds=jnp.concatenate([e, e[:5] + 7]))

    assert np.abs(np.asarray(jax.jit(encoded_then_forward)(params, pixels)) - want).max() <= JAX_TOL


def test_module_tree_is_transformers(models):
    """Parameter names (what PEFT adapts) equal transformers' in-memory names."""
    hf, src, _ = models
    assert set(src.state_dict()) == set(hf.state_dict())


def test_conversion_both_ways(tmp_path):
    params = conv.load_params(CKPT)
    state = safetensors_io.load_state_dict(CKPT)
    assert conv.hf_layout(params) == {k: tuple(v.shape) for k, v in state.items()}
    assert "vision_tower.vision_model.post_layernorm.weight" in state and "language_model.lm_head.weight" not in state
    # transformers 5's save of a model built from its config writes the tower without vision_model.: both sides read it
    from safetensors.numpy import save_file
    saved = {k.replace("vision_tower.vision_model.", "vision_tower."): v for k, v in state.items()}
    save_file(saved, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((CKPT / "config.json").read_bytes())
    again = conv.load_params(tmp_path)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    src, src_saved = (tg.Gemma3ForConditionalGeneration.from_pretrained(d) for d in (CKPT, tmp_path))
    for (n, a), (_, b) in zip(src.state_dict().items(), src_saved.state_dict().items()):
        assert torch.equal(a, b), n
    state.pop("vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias")
    with pytest.raises(ValueError, match="never written"):
        conv.convert_state_dict(state, conv.load_config(CKPT))


def test_both_config_forms_read_the_same(tmp_path):
    """The release's form (text_config with rope_scaling, sliding_window_pattern, most keys left to defaults) and
    what transformers 5 writes (rope_parameters per layer type, layer_types)."""
    from transformers import Gemma3Config
    release = json.loads((CKPT / "config.json").read_text())
    Gemma3Config(**release).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved["text_config"] and "rope_scaling" not in saved["text_config"]
    for side in (tg, jg):
        assert side.Gemma3Config.from_hf(saved) == side.Gemma3Config.from_hf(release)
    c = tg.Gemma3Config.from_hf(release)
    assert c.text.layer_types == ("sliding_attention", "full_attention") and c.text.query_pre_attn_scalar == 24
    assert (c.text.rope_full.rope_type, c.text.rope_full.factor, c.text.rope_full.theta) == ("linear", 8.0, 1e6)
    assert (c.text.rope_sliding.rope_type, c.text.rope_sliding.theta) == ("default", 1e4)
    assert (c.image_token_id, c.mm_tokens_per_image, c.pool_kernel) == (IMG, N_IMG, 2)


def test_release_defaults():
    """gemma-3-4b-it's config.json leaves most text keys to Gemma3TextConfig's defaults: read as transformers does."""
    from transformers import Gemma3Config
    release = {"architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
               "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
               "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
               "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                               "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                               "sliding_window": 1024},
               "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
               "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                                 "model_type": "siglip_vision_model", "num_attention_heads": 16,
                                 "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
    hf = Gemma3Config(**release).text_config
    for side in (tg, jg):
        c = side.Gemma3Config.from_hf(release)
        t = c.text
        assert (t.vocab_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim, t.query_pre_attn_scalar) == \
            (hf.vocab_size, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.query_pre_attn_scalar)
        assert list(t.layer_types) == hf.layer_types and t.sliding_window == hf.sliding_window
        assert t.rope_full.theta == hf.rope_parameters["full_attention"]["rope_theta"]
        assert t.rope_sliding.theta == hf.rope_parameters["sliding_attention"]["rope_theta"]
        assert (c.pool_kernel, c.vision.num_patches) == (4, 4096)


def test_every_transformers_key_is_listed():
    """Every key transformers' config classes save, and the keys the releases add, is honored, ignored or refused,
    alike on both sides."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig
    from jax_oracles.models.siglip import VISION_KEYS as J_VISION_KEYS
    from torch_sources.models.siglip import VISION_KEYS
    release_only = {"rope_scaling", "rope_theta", "rope_local_base_freq", "sliding_window_pattern",
                    "cache_implementation", "torch_dtype"}
    for audit, keys in ((tg.CONFIG_KEYS, set(Gemma3Config().to_dict()) | {"torch_dtype"}),
                        (tg.TEXT_KEYS, set(Gemma3TextConfig().to_dict()) | release_only),
                        (VISION_KEYS, set(SiglipVisionConfig().to_dict()) | {"torch_dtype"})):
        assert keys - audit.keys == set(), audit.family
    for t, j in ((tg.CONFIG_KEYS, jg.CONFIG_KEYS), (tg.TEXT_KEYS, jg.TEXT_KEYS), (VISION_KEYS, J_VISION_KEYS)):
        assert (t.family, set(t.honored), dict(t.ignored), {k: (tuple(map(repr, a)), w) for k, (a, w) in t.refused.items()}) == \
            (j.family, set(j.honored), dict(j.ignored), {k: (tuple(map(repr, a)), w) for k, (a, w) in j.refused.items()})


def _edit_text(**edit):
    return lambda d: {**d, "text_config": {**d["text_config"], **edit}}


@pytest.mark.parametrize("edit, match", [
    (_edit_text(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (_edit_text(layer_types=["sliding_attention"]), "layer_types"),
    (_edit_text(rope_scaling={"rope_type": "linear"}), "factor"),
    (_edit_text(rope_parameters={"rope_type": "default"}), "rope_parameters"),
    (lambda d: {**d, "vision_config": {**d["vision_config"], "vision_use_head": True}}, "vision_use_head"),
    (lambda d: {**d, "mm_tokens_per_image": 9}, "mm_tokens_per_image"),
    (lambda d: {k: v for k, v in d.items() if k != "vision_config"}, "vision_config"),
    (lambda d: {**d, "not_a_key": 1}, "not_a_key"),
])
def test_refusals(edit, match):
    d = edit(json.loads((CKPT / "config.json").read_text()))
    for side in (tg, jg):
        with pytest.raises(ValueError, match=match):
            side.Gemma3Config.from_hf(d)
    assert issubclass(ConfigError, ValueError)


def _hf_pixels(size, paths):
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proc = Gemma3ImageProcessorPil(size={"height": size, "width": size}, do_pan_and_scan=False)
        return proc([Image.open(p) for p in paths], return_tensors="np")["pixel_values"]


@pytest.mark.parametrize("size", [SIDE, pytest.param(896, marks=pytest.mark.slow)])
def test_processor_matches_transformers(size):
    """Every image of assets/images (gray, RGBA, strips), at the tiny checkpoint's size and the release's: bit equal."""
    want = _hf_pixels(size, IMAGES)
    config = tproc.Gemma3ImageProcessorConfig(height=size, width=size)
    assert config == tproc.Gemma3ImageProcessorConfig.from_hf({"size": {"height": size, "width": size},
                                                                "do_pan_and_scan": None})
    images = [jvp.read_png(p) for p in IMAGES]
    got_t = tproc.process_images(images, config).numpy()
    got_j = jproc.process_images(images, jproc.Gemma3ImageProcessorConfig(height=size, width=size))
    assert want.shape == (len(IMAGES), 3, size, size)
    np.testing.assert_array_equal(got_t.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(got_j.view(np.uint32), want.view(np.uint32))
    # the release's file ships do_convert_rgb null: kept, as HF's from_pretrained keeps it (test_release_processor_nulls.py)
    assert tproc.Gemma3ImageProcessorConfig.gemma3() == replace(tproc.Gemma3ImageProcessorConfig(height=896, width=896), do_convert_rgb=None)
    with pytest.raises(ValueError, match="pan_and_scan"):
        jproc.Gemma3ImageProcessorConfig.from_hf({"do_pan_and_scan": True})


def test_checkpoint_is_reproducible(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tools'); from checkpoints_gemma3 import make_gemma3; "
            f"make_gemma3({str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name
