"""PaliGemma: the torch source against transformers' PaliGemmaForConditionalGeneration on the shipped checkpoint
with images (in train mode with labels, as LLaMA-Factory calls it), the JAX twin against the torch source (logits,
and the gradients reaching the pixels and a decoder weight), the prefix-LM mask, the module tree, the conversion both
ways, both config.json forms, the key audit and the refusals, the image processor against SiglipImageProcessorPil,
and the checkpoint's reproducibility."""

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

from conversion import paligemma as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import paligemma as jg  # noqa: E402
from jax_oracles.models import siglip_processing as jproc  # noqa: E402
from jax_oracles.models import vision_processing as jvp  # noqa: E402
from torch_sources.models import paligemma as tg  # noqa: E402
from torch_sources.models import siglip_processing as tproc  # noqa: E402
from torch_sources.models.config_keys import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/paligemma"
IMAGES = sorted((ROOT / "assets/images").glob("*.png"))
TORCH_TOL, JAX_TOL = 1e-5, 1e-4
BOS, PAD, IMG = 400, 402, 403
N_IMG, SIDE = 16, 32  # image tokens per image, pixels a side


def smoke_first(names):  # the first case in CI (make test), the others in make test-full
    return [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(names)]


def _batch(rows, T, seed=0, types="lf", pad_type=1):
    """rows: per row, (images, real length): `<image>*16 per image, <bos>, text` (PaliGemma's prompt), right padding.
    types "lf": token_type_ids 0 at the image tokens, 1 elsewhere (LLaMA-Factory's); "prefix": 0 through a prompt of
    5 tokens after bos (the processor's prefix); None: no token_type_ids. pad_type: the pads' type."""
    rng = np.random.default_rng(seed)
    ids = np.full((len(rows), T), PAD)
    mask = np.zeros_like(ids)
    kinds = np.full_like(ids, pad_type)
    for r, (n, length) in enumerate(rows):
        row = rng.integers(0, 400, length)
        row[:n * N_IMG] = IMG
        row[n * N_IMG] = BOS
        ids[r, :length], mask[r, :length] = row, 1
        kinds[r, :length] = 1
        kinds[r, :n * N_IMG + (6 if types == "prefix" else 0)] = 0
    n_images = sum(n for n, _ in rows)
    pixels = rng.standard_normal((n_images, 3, SIDE, SIDE)).astype(np.float32)
    return ids, mask, pixels, None if types is None else kinds


BATCHES = {
    # two images in a row, a second row with one, LLaMA-Factory's token types
    "two-images": _batch([(2, 45), (1, 30)], 45),
    # an image row beside an image-free row, the processor's prefix, pads of type 0
    "mixed-prefix": _batch([(1, 28), (0, 12)], 28, seed=1, types="prefix", pad_type=0),
    # no token_type_ids: causal
    "no-types": _batch([(1, 24)], 24, seed=2, types=None),
}


@pytest.fixture(scope="module")
def models():
    from transformers import PaliGemmaForConditionalGeneration
    hf = PaliGemmaForConditionalGeneration.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32)
    hf.train()  # LLaMA-Factory's training forward: train mode, dropout 0, labels passed
    return hf, tg.PaliGemmaForConditionalGeneration.from_pretrained(CKPT), conv.load_params(CKPT)


def _t(x):
    return None if x is None else torch.tensor(x)


def _src_logits(src, ids, mask, pixels, types):
    with torch.no_grad():
        return src(_t(ids), _t(mask), pixel_values=_t(pixels), token_type_ids=_t(types)).numpy()


def _jax_model():
    return jg.PaliGemmaForConditionalGeneration(conv.load_config(CKPT))


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


def test_prefix_block_has_teeth(models):
    """The type-0 block is bidirectional (an image token sees the later image tokens), the rest causal: without
    token_type_ids the image rows leave transformers' by far more than the tolerance."""
    _, src, _ = models
    ids, mask, pixels, types = BATCHES["two-images"]
    with_prefix = _src_logits(src, ids, mask, pixels, types)
    causal = _src_logits(src, ids, mask, pixels, None)
    assert np.abs(with_prefix - causal)[ids == IMG].max() > 1e3 * TORCH_TOL
    m = tg.prefix_lm_mask(torch.tensor(mask), torch.tensor(types))
    np.testing.assert_array_equal(np.asarray(jg.prefix_lm_mask(mask, types)), m.numpy())
    assert m[0, 0, 2 * N_IMG - 1] and not m[0, 2 * N_IMG, 2 * N_IMG + 1] and m[0, 2 * N_IMG + 1, 0]
    assert not m[1, 0, 40]  # a padding key


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
    assert "multi_modal_projector.linear.bias" in state
    # transformers 5's save of a model built from its config writes the tower without vision_model.: both sides read it
    from safetensors.numpy import save_file
    saved = {k.replace("vision_tower.vision_model.", "vision_tower."): v for k, v in state.items()}
    save_file(saved, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_bytes((CKPT / "config.json").read_bytes())
    again = conv.load_params(tmp_path)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    src, src_saved = (tg.PaliGemmaForConditionalGeneration.from_pretrained(d) for d in (CKPT, tmp_path))
    for (n, a), (_, b) in zip(src.state_dict().items(), src_saved.state_dict().items()):
        assert torch.equal(a, b), n
    state.pop("vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias")
    with pytest.raises(ValueError, match="never written"):
        conv.convert_state_dict(state, conv.load_config(CKPT))


def test_both_config_forms_read_the_same(tmp_path):
    """The release's form (top-level copies, hidden_activation, vision projection_dim) and what transformers 5 writes
    (rope_parameters, hidden_act, use_bidirectional_attention)."""
    from transformers import PaliGemmaConfig
    release = json.loads((CKPT / "config.json").read_text())
    PaliGemmaConfig(**release).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved["text_config"] and saved["text_config"]["use_bidirectional_attention"] is True
    for side in (tg, jg):
        assert side.PaliGemmaConfig.from_hf(saved) == side.PaliGemmaConfig.from_hf(release)
    c = tg.PaliGemmaConfig.from_hf(release)
    assert (c.text.num_key_value_heads, c.text.head_dim, c.text.rope.theta, c.text.hidden_act) == \
        (1, 16, 1e4, "gelu_pytorch_tanh")
    assert (c.image_token_id, c.projection_dim, c.vision.num_patches) == (IMG, 64, N_IMG)


def test_release_defaults():
    """paligemma-3b-pt-224's config.json leaves head_dim, image_size and the RoPE to the config classes' defaults."""
    from transformers import PaliGemmaConfig
    release = {"architectures": ["PaliGemmaForConditionalGeneration"], "bos_token_id": 2, "eos_token_id": 1,
               "hidden_size": 2048, "ignore_index": -100, "image_token_index": 257152, "model_type": "paligemma",
               "pad_token_id": 0, "projection_dim": 2048,
               "text_config": {"hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2048,
                               "intermediate_size": 16384, "model_type": "gemma", "num_attention_heads": 8,
                               "num_hidden_layers": 18, "num_image_tokens": 256, "num_key_value_heads": 1,
                               "torch_dtype": "float32", "vocab_size": 257216},
               "torch_dtype": "float32", "transformers_version": "4.41.0.dev0",
               "vision_config": {"hidden_size": 1152, "intermediate_size": 4304, "model_type": "siglip_vision_model",
                                 "num_attention_heads": 16, "num_hidden_layers": 27, "num_image_tokens": 256,
                                 "patch_size": 14, "projection_dim": 2048, "projector_hidden_act": "gelu_fast",
                                 "vision_use_head": False}}
    hf = PaliGemmaConfig(**release)
    for side in (tg, jg):
        c = side.PaliGemmaConfig.from_hf(release)
        assert (c.text.head_dim, c.text.num_key_value_heads, c.text.rope.theta, c.text.hidden_act) == \
            (hf.text_config.head_dim, 1, hf.text_config.rope_parameters["rope_theta"], hf.text_config.hidden_act)
        assert (c.vision.image_size, c.vision.patch_size, c.vision.num_patches) == (hf.vision_config.image_size, 14, 256)


def test_every_transformers_key_is_listed():
    from transformers import GemmaConfig, PaliGemmaConfig, SiglipVisionConfig
    from torch_sources.models.siglip import VISION_KEYS
    from jax_oracles.models.siglip import VISION_KEYS as J_VISION_KEYS
    for audit, keys in ((tg.CONFIG_KEYS, set(PaliGemmaConfig().to_dict()) | {"torch_dtype", "ignore_index"}),
                        (tg.TEXT_KEYS, set(PaliGemmaConfig().text_config.to_dict()) | set(GemmaConfig().to_dict())
                         | {"hidden_activation", "rope_theta", "rope_scaling", "torch_dtype"}),
                        (VISION_KEYS, set(PaliGemmaConfig().vision_config.to_dict()) | set(SiglipVisionConfig().to_dict())
                         | {"projector_hidden_act", "num_image_tokens", "torch_dtype"})):
        assert keys - audit.keys == set(), audit.family
    for t, j in ((tg.CONFIG_KEYS, jg.CONFIG_KEYS), (tg.TEXT_KEYS, jg.TEXT_KEYS), (VISION_KEYS, J_VISION_KEYS)):
        assert (t.family, set(t.honored), dict(t.ignored), {k: (tuple(map(repr, a)), w) for k, (a, w) in t.refused.items()}) == \
            (j.family, set(j.honored), dict(j.ignored), {k: (tuple(map(repr, a)), w) for k, (a, w) in j.refused.items()})


def _edit_text(**edit):
    return lambda d: {**d, "text_config": {**d["text_config"], **edit}}


@pytest.mark.parametrize("edit, match", [
    (_edit_text(model_type="gemma2"), "gemma2"),
    (_edit_text(hidden_act="relu6"), "hidden_act"),
    (_edit_text(rope_scaling={"rope_type": "linear"}), "factor"),
    (lambda d: {**d, "projection_dim": 32}, "projection_dim"),
    (lambda d: {**d, "vision_config": {**d["vision_config"], "vision_use_head": True}}, "vision_use_head"),
    (lambda d: {k: v for k, v in d.items() if k != "text_config"}, "text_config"),
    (lambda d: {**d, "not_a_key": 1}, "not_a_key"),
])
def test_refusals(edit, match):
    d = edit(json.loads((CKPT / "config.json").read_text()))
    for side in (tg, jg):
        with pytest.raises(ValueError, match=match):
            side.PaliGemmaConfig.from_hf(d)
    assert issubclass(ConfigError, ValueError)


def _hf_pixels(size, paths):
    from PIL import Image
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proc = SiglipImageProcessorPil(size={"height": size, "width": size})
        return proc([Image.open(p) for p in paths], return_tensors="np")["pixel_values"]


@pytest.mark.parametrize("size", [SIDE, pytest.param(224, marks=pytest.mark.slow)])
def test_processor_matches_transformers(size):
    """Every image of assets/images (gray, RGBA, strips), at the tiny checkpoint's size and the release's: bit equal."""
    want = _hf_pixels(size, IMAGES)
    config = tproc.SiglipImageProcessorConfig(height=size, width=size)
    assert config == tproc.SiglipImageProcessorConfig.from_hf({"size": {"height": size, "width": size},
                                                                "image_mean": [0.5, 0.5, 0.5], "resample": 3})
    images = [jvp.read_png(p) for p in IMAGES]
    got_t = tproc.process_images(images, config).numpy()
    got_j = jproc.process_images(images, jproc.SiglipImageProcessorConfig(height=size, width=size))
    assert want.shape == (len(IMAGES), 3, size, size)
    np.testing.assert_array_equal(got_t.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(got_j.view(np.uint32), want.view(np.uint32))
    # the release's file ships do_convert_rgb null: kept, as HF's from_pretrained keeps it (test_release_processor_nulls.py)
    assert tproc.SiglipImageProcessorConfig.paligemma() == replace(tproc.SiglipImageProcessorConfig(), do_convert_rgb=None)


def test_checkpoint_is_reproducible(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tools'); from checkpoints_paligemma import make_paligemma; "
            f"make_paligemma({str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name
