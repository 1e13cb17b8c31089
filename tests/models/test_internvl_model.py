"""InternVL: the torch source against transformers' InternVLForConditionalGeneration (as LLaMA-Factory trains it:
train mode, labels, right padding) on the shipped checkpoint with images, the JAX twin against the torch source
(logits, the gradient reaching the pixels and every parameter), the InternViT tower alone in its other release
layout (RMSNorm, qk-norm, final norm, resized positions), the pixel shuffle, the conversion both ways, both
config.json forms, the tie, the refusals, the processor against GotOcr2ImageProcessorPil, LLaMA-Factory's plugin
helpers, and the checkpoint's reproducibility."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")

from conversion import internvl as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from conversion.rules import apply_rules  # noqa: E402
from jax_oracles.models import intern_vit as jv  # noqa: E402
from jax_oracles.models import internvl as jq  # noqa: E402
from jax_oracles.models import internvl_processing as jp  # noqa: E402
from torch_sources.models import intern_vit as tv  # noqa: E402
from torch_sources.models import internvl as tq  # noqa: E402
from torch_sources.models import internvl_processing as tp  # noqa: E402
from torch_sources.models.config_keys import ConfigError  # noqa: E402
from jax_oracles.models import vision_processing as jvp  # noqa: E402
from torch_sources.models import vision_processing as tvp  # noqa: E402
from torch_sources.models.vision_processing import read_png  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def smoke_first(names):  # the first batch in CI (make test), the others in make test-full
    return [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(names)]


ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/internvl"
TOKENIZER = ROOT / "assets/tokenizer/internvl"
IMAGES = sorted((ROOT / "assets/images").glob("*.png"))
TORCH_TOL, JAX_TOL = 1e-5, 1e-4
IMG_START, IMG_END, IMG = 403, 404, 405
PER_TILE = 4  # image_seq_length: (32/8)^2 * 0.5^2
TINY_CROP = tp.GotOcr2ImageProcessorConfig(size=(32, 32), crop_to_patches=True, max_patches=4)


def _batch(tiles, rows, T, seed=0, images=None):
    """Random text ids with `<img> <IMG_CONTEXT>*4*tiles </img>` spans at the given offsets, right padded.
    tiles: per image its tile count; rows: per row a list of (offset, image index) and a real length. Pixels are
    the processor's tiles of `images` (assets/images names) when given, else random."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 400, (len(rows), T))
    mask = np.zeros_like(ids)
    for r, (spans, length) in enumerate(rows):
        row = rng.integers(0, 400, length)
        for offset, image in spans:
            n = PER_TILE * tiles[image]
            row[offset:offset + n + 2] = [IMG_START, *[IMG] * n, IMG_END]
        ids[r, :length], mask[r, :length] = row, 1
    if images is not None:
        pixels, counts = tp.process_images([read_png(ROOT / "assets/images" / name) for name in images], TINY_CROP)
        assert counts.tolist() == list(tiles)
        pixels = pixels.numpy()
    else:
        pixels = rng.standard_normal((sum(tiles), 3, 32, 32)).astype(np.float32)
    return ids, mask, pixels


BATCHES = {
    # two images in one row (the processor's 5 and 4 tiles of two assets), a second row with a third, right padding
    "two-in-a-row": _batch([5, 4, 3], [([(2, 0), (26, 1)], 48), ([(3, 2)], 20)], 48,
                           images=["gradient_64x48.png", "gray_20x60.png", "wide_150x90.png"]),
    # an image-free row beside an image row
    "mixed": _batch([1], [([(4, 0)], 14), ([], 9)], 16, seed=1),
    # a row whose last tokens are the image span, processor pixels
    "image-last": _batch([5], [([(3, 0)], 25)], 25, seed=2, images=["gradient_64x48.png"]),
}


@pytest.fixture(scope="module")
def models():
    from transformers import InternVLForConditionalGeneration
    hf = InternVLForConditionalGeneration.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32)
    hf.train()  # as LLaMA-Factory trains it (every dropout is 0)
    src = tq.InternVLForConditionalGeneration.from_pretrained(CKPT)
    params = conv.load_params(CKPT)
    return hf, src, params


def _jax_model():
    return jq.InternVLForConditionalGeneration(conv.load_config(CKPT))


def _hf_logits(hf, ids, mask, pixels) -> np.ndarray:
    labels = torch.tensor(np.where(mask == 1, ids, -100))
    out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
             pixel_values=None if pixels is None else torch.tensor(pixels), labels=labels)
    return out.logits.detach().numpy()


def _torch_logits(model, ids, mask, pixels) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(mask),
                     None if pixels is None else torch.tensor(pixels)).numpy()


@pytest.mark.parametrize("name", smoke_first(sorted(BATCHES)))
def test_source_matches_transformers(models, name):
    hf, src, _ = models
    ids, mask, pixels = BATCHES[name]
    want = _hf_logits(hf, ids, mask, pixels)
    got = _torch_logits(src, ids, mask, pixels)
    real = mask.astype(bool)  # pad rows' logits are never read
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())
    assert not src.config.tie_word_embeddings  # the release layout: an untied head, as transformers leaves it
    assert hf.lm_head.weight.data_ptr() != hf.model.language_model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("name", smoke_first(sorted(BATCHES)))
def test_jax_matches_source(models, name):
    _, src, params = models
    ids, mask, pixels = BATCHES[name]
    want = _torch_logits(src, ids, mask, pixels)
    model = _jax_model()
    got = np.asarray(jax.jit(lambda p, i, m, px: model.apply({"params": p}, i, m, px))(params, ids, mask, pixels))
    assert np.abs(got - want).max() <= JAX_TOL


@pytest.mark.slow
def test_text_only_batch_matches(models):
    hf, src, params = models
    ids, mask, _ = _batch([1], [([], 12), ([], 7)], 12, seed=3)
    want = _hf_logits(hf, ids, mask, None)
    got = _torch_logits(src, ids, mask, None)
    real = mask.astype(bool)
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())
    assert np.abs(np.asarray(_jax_model().apply({"params": params}, ids, mask)) - got).max() <= JAX_TOL


@pytest.mark.slow
def test_gradients_match(models):
    """The gradient of a loss on the logits with respect to the pixels (through the tower, the shuffle, the projector
    and the attended language model) and to every parameter, torch against JAX."""
    _, src, params = models
    ids, mask, pixels = BATCHES["two-in-a-row"]
    w = np.random.default_rng(5).standard_normal((ids.shape[1], src.config.vocab_size)).astype(np.float32)
    px = torch.tensor(pixels, requires_grad=True)
    src.zero_grad()
    (src(torch.tensor(ids), torch.tensor(mask), px) * torch.tensor(w)).sum().backward()
    model = _jax_model()
    loss = lambda p, x: jnp.sum(model.apply({"params": p}, ids, mask, x) * w)  # noqa: E731
    g_params, g_pixels = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, pixels)
    want = px.grad.numpy()
    assert np.abs(want).max() > 1e-3  # the pixels reach the logits
    assert np.abs(np.asarray(g_pixels) - want).max() <= JAX_TOL * np.abs(want).max()
    torch_grads = conv.convert_state_dict({n: p.grad.numpy() for n, p in src.named_parameters()}, src.config)
    flat_t = jax.tree_util.tree_leaves_with_path(torch_grads)
    flat_j = dict(jax.tree_util.tree_leaves_with_path(g_params))
    for path, g in flat_t:
        scale = max(1.0, float(np.abs(g).max()))
        assert np.abs(np.asarray(flat_j[path]) - np.asarray(g)).max() <= JAX_TOL * scale, jax.tree_util.keystr(path)


def test_precomputed_image_embeds_match_the_pixels(models):
    """The trainers' path: encode_images (the frozen tower once) gives the image rows f32[n,D]; the forward on them is
    the forward on the pixels (torch: bit for bit; JAX: jitted, padded with rows never read)."""
    _, src, params = models
    ids, mask, pixels = BATCHES["image-last"]
    with torch.no_grad():
        want = src(torch.tensor(ids), torch.tensor(mask), torch.tensor(pixels)).numpy()
        embeds = src.encode_images(torch.tensor(pixels))
        got = src(torch.tensor(ids), torch.tensor(mask), image_embeds=embeds).numpy()
    assert embeds.shape == (int((ids == IMG).sum()), 64)
    np.testing.assert_array_equal(got, want)
    model = _jax_model()

    def encoded_then_forward(p, i, m, px):
        encoded = model.apply({"params": p}, px, method="encode_images")
        padded = jnp.concatenate([encoded, jnp.full((7, encoded.shape[1]), 3.0)])
        return encoded, model.apply({"params": p}, i, m, image_embeds=padded)

    encoded, got_jax = jax.jit(encoded_then_forward)(params, ids, mask, pixels)
    assert np.abs(np.asarray(encoded) - embeds.numpy()).max() <= JAX_TOL
    assert np.abs(np.asarray(got_jax) - want).max() <= JAX_TOL


@pytest.mark.slow
def test_image_count_mismatch_is_refused(models):
    _, src, params = models
    ids, mask, pixels = BATCHES["image-last"]
    ids = ids.copy()
    ids[0, 5] = 7  # one image token fewer than the tiles' rows
    with pytest.raises(Exception, match="image"):
        _torch_logits(src, ids, mask, pixels)
    with pytest.raises(Exception, match="image"):
        _jax_model().apply({"params": params}, ids, mask, pixels)


def test_pixel_shuffle_matches_transformers(models):
    hf, _, _ = models
    x = np.random.default_rng(9).standard_normal((2, 6, 6, 5)).astype(np.float32)
    want = hf.model.pixel_shuffle(torch.tensor(x), 0.5).numpy()
    np.testing.assert_array_equal(tq.pixel_shuffle(torch.tensor(x)).numpy(), want)
    np.testing.assert_array_equal(np.asarray(jq.pixel_shuffle(x)), want)
    assert want.shape == (2, 3, 3, 20)


# ---- the tower alone, in InternViT-6B's layout ------------------------------------------------

SIX_B = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48, attention_bias=False,
             use_qk_norm=True, norm_type="rms_norm", use_mean_pooling=False, image_size=[32, 32], patch_size=[8, 8],
             hidden_act="gelu", layer_norm_eps=1e-6)


@pytest.mark.parametrize("height, width, layer", [(32, 32, -1), pytest.param(48, 40, -1, marks=pytest.mark.slow),
                                                  pytest.param(40, 40, -2, marks=pytest.mark.slow),
                                                  pytest.param(32, 32, 0, marks=pytest.mark.slow)])
def test_tower_layouts_match_transformers(height, width, layer):
    """RMSNorm blocks, q/k RMSNorm over the whole vector, no q/k/v bias, the final LayerNorm (use_mean_pooling false),
    the position table resized bicubically (non-square and larger grids) and other feature layers, all three
    implementations on one random tower."""
    from transformers import InternVLVisionConfig as HFConfig
    from transformers.models.internvl.modeling_internvl import InternVLVisionModel as HFTower
    torch.manual_seed(0)
    hf = HFTower(HFConfig(**SIX_B)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():  # every parameter nonzero and away from its init
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 or "position" in name or "cls" in name else 0.3) + (
                1.0 if p.ndim == 1 and ("norm" in name or "lambda" in name) else 0.0))
    config = tv.InternVLVisionConfig.from_hf({**SIX_B, "model_type": "internvl_vision"})
    src = tv.InternVLVisionModel(config).eval()
    src.load_state_dict(hf.state_dict(), strict=True)
    px = np.random.default_rng(4).standard_normal((2, 3, height, width)).astype(np.float32)
    with torch.no_grad():
        out = hf(pixel_values=torch.tensor(px), output_hidden_states=True)
        want = (out.last_hidden_state if layer == -1 else out.hidden_states[layer]).numpy()
        got = src(torch.tensor(px), layer).numpy()
    assert np.abs(got - want).max() <= TORCH_TOL * max(1.0, np.abs(want).max())
    jconfig = jv.InternVLVisionConfig.from_hf({**SIX_B, "model_type": "internvl_vision"})
    tower = jv.InternVLVisionModel(jconfig)
    shapes = jax.eval_shape(lambda: tower.init(jax.random.key(0), jnp.asarray(px)))["params"]
    from flax import traverse_util
    expected = {"model/vision_tower/" + k: tuple(v.shape) for k, v in traverse_util.flatten_dict(shapes, sep="/").items()}
    tree = apply_rules({"vision_tower." + k: v.numpy() for k, v in hf.state_dict().items()}, conv.VISION_RULES,
                       expected)["model"]["vision_tower"]
    got_jax = np.asarray(jax.jit(lambda p, x: tower.apply({"params": p}, x, layer))(tree, jnp.asarray(px)))
    assert np.abs(got_jax - got).max() <= JAX_TOL * max(1.0, np.abs(want).max())


def test_bicubic_matrix_matches_torch():
    """The JAX twin's position-table resize: torch's F.interpolate(bicubic, align_corners=False), up and down."""
    x = np.random.default_rng(2).standard_normal((1, 1 + 16, 6)).astype(np.float32)
    for h, w in ((6, 5), (3, 3), (4, 7)):
        want = tv.interpolate_pos_encoding(torch.tensor(x), h, w).numpy()
        got = np.asarray(jv.interpolate_pos_encoding(jnp.asarray(x), h, w))
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()  # fp32 noise: the taps summed in another order


# ---- checkpoint, conversion, configs ----------------------------------------------------------

def test_conversion_both_ways(tmp_path):
    params = conv.load_params(CKPT)
    state = safetensors_io.load_state_dict(CKPT)
    stored = {k: tuple(v.shape) for k, v in state.items()}
    assert "language_model.lm_head.weight" in stored and "vision_tower.encoder.layer.1.lambda_2" in stored
    assert conv.hf_layout(params) == stored
    # transformers 5's in-memory names (save_original_format=False) convert to the same params
    live = conv.convert_state_dict({tq.in_memory_name(k): v for k, v in state.items()}, conv.load_config(CKPT))
    for a, b in zip(jax.tree_util.tree_leaves(live), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state.pop("multi_modal_projector.linear_2.bias")
    with pytest.raises(ValueError, match="never written"):
        conv.convert_state_dict(state, conv.load_config(CKPT))


def test_module_tree_is_transformers_in_memory_tree(models):
    """Parameter names (so PEFT / LLaMA-Factory adapter names) equal transformers 5's, shapes too."""
    hf, src, _ = models
    want = {n: tuple(p.shape) for n, p in hf.named_parameters()}
    assert {n: tuple(p.shape) for n, p in src.named_parameters()} == want


def test_transformers_saved_checkpoint_loads(models, tmp_path):
    """What transformers 5's save_pretrained writes (its config form, both name layouts) loads into the same model,
    on both sides."""
    hf, src, params = models
    for original in (True, False):
        out = tmp_path / f"saved-{original}"
        hf.save_pretrained(out, save_original_format=original)
        again = tq.InternVLForConditionalGeneration.from_pretrained(out)
        assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False  # as shipped
        assert again.config == src.config
        for (n, a), (_, b) in zip(src.state_dict().items(), again.state_dict().items()):
            assert torch.equal(a, b), n
        assert conv.load_config(out) == conv.load_config(CKPT)
        for a, b in zip(jax.tree_util.tree_leaves(conv.load_params(out)), jax.tree_util.tree_leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_both_config_forms_read_the_same(tmp_path):
    """The release's form (the shipped file: text_config.rope_theta, InternViT's original vision keys; its untied
    head also said at the top level, which the release leaves to its stored head: tests/models/test_internvl_model.py
    test_the_tie) and what transformers 5's save_pretrained writes (rope_parameters, layer_types)."""
    from transformers import InternVLConfig
    release = json.loads((CKPT / "config.json").read_text())
    InternVLConfig(**release).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved["text_config"] and "layer_types" in saved["text_config"]
    assert saved["tie_word_embeddings"] is False
    for side in (tq, jq):
        assert side.InternVLConfig.from_hf(saved) == side.InternVLConfig.from_hf(release)
        assert not side.InternVLConfig.from_hf(release).tie_word_embeddings
    assert conv.load_config(CKPT) == jq.InternVLConfig.from_hf(release)
    c = tq.InternVLConfig.from_hf(release)
    assert (c.image_token_id, c.tokens_per_tile, c.text.rope.theta, c.vision.patch_size) == (IMG, 4, 1e6, (8, 8))


@pytest.mark.parametrize("top, text", [(None, False), (None, True), (None, None), (True, False), (False, True)])
def test_the_tie(top, text, tmp_path):
    """transformers 5 ties on the top-level key (default True) unless the checkpoint stores a head that differs from
    the embedding. A release written by 4.x (no top-level key; it tied on text_config's) stores its head when untied;
    a 5.x file may say True beside a stored head. The sources read the same: transformers' model and both loaders
    agree on each variant of the shipped checkpoint."""
    from transformers import InternVLForConditionalGeneration
    d = json.loads((CKPT / "config.json").read_text())
    d.pop("tie_word_embeddings", None)
    d["text_config"].pop("tie_word_embeddings")
    if top is not None:
        d["tie_word_embeddings"] = top
    if text is not None:
        d["text_config"]["tie_word_embeddings"] = text
    for side in (tq, jq):
        assert side.InternVLConfig.from_hf(d).tie_word_embeddings is (top is not False)
    want = top if top is not None else (text if text is not None else True)  # what the writer did
    state = safetensors_io.load_state_dict(CKPT)
    if want:  # a tied checkpoint stores no head
        state.pop("language_model.lm_head.weight")
    from safetensors.numpy import save_file
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = InternVLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    src = tq.InternVLForConditionalGeneration.from_pretrained(tmp_path)
    hf_tied = hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    assert hf_tied is want and (src.lm_head.weight is src.model.language_model.embed_tokens.weight) is want
    assert src.config.tie_word_embeddings is want and conv.load_config(tmp_path).tie_word_embeddings is want


def _edit_text(**edit):
    return lambda d: {**d, "text_config": {**d["text_config"], **edit}}


def _edit_vision(**edit):
    return lambda d: {**d, "vision_config": {**d["vision_config"], **edit}}


@pytest.mark.parametrize("edit, match", [
    (lambda d: {**d, "vision_feature_select_strategy": "full"}, "vision_feature_select_strategy"),
    (lambda d: {**d, "vision_feature_layer": [-1, -2]}, "vision_feature_layer"),
    (lambda d: {**d, "downsample_ratio": 0.25}, "downsample_ratio"),
    (lambda d: {**d, "projector_hidden_act": "swish_glu"}, "projector_hidden_act"),
    (_edit_text(model_type="qwen3"), "model_type"),
    (_edit_text(hidden_act="gelu"), "hidden_act"),
    (_edit_text(use_sliding_window=True), "use_sliding_window"),
    (_edit_text(not_a_key=1), "not_a_key"),
    (_edit_vision(use_mask_token=True), "use_mask_token"),
    (_edit_vision(norm_type="batch_norm"), "norm_type"),
    (_edit_vision(window_size=8), "window_size"),
    (lambda d: {k: v for k, v in d.items() if k != "vision_config"}, "vision_config"),
    (lambda d: {**d, "not_a_key": 1}, "not_a_key"),
])
def test_refusals(edit, match):
    d = edit(json.loads((CKPT / "config.json").read_text()))
    for side in (tq, jq):
        with pytest.raises(ValueError, match=match):
            side.InternVLConfig.from_hf(d)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("audit, cls_name", [("CONFIG_KEYS", "InternVLConfig"),
                                             ("VISION_KEYS", "InternVLVisionConfig")])
def test_audits_cover_transformers(audit, cls_name):
    """Every key transformers' config class saves is listed, and the torch and JAX audits are the same lists."""
    import transformers
    t = getattr(tv if audit == "VISION_KEYS" else tq, audit)
    j = getattr(jv if audit == "VISION_KEYS" else jq, audit)
    assert (t.family, set(t.honored), dict(t.ignored)) == (j.family, set(j.honored), dict(j.ignored))
    assert {k: (a, w) for k, (a, w) in t.refused.items()} == {k: (a, w) for k, (a, w) in j.refused.items()}
    assert set(getattr(transformers, cls_name)().to_dict()) - t.keys == set()
    assert (tq.TEXT_EXTRA_KEYS.family, set(tq.TEXT_EXTRA_KEYS.honored), dict(tq.TEXT_EXTRA_KEYS.ignored)) == \
        (jq.TEXT_EXTRA_KEYS.family, set(jq.TEXT_EXTRA_KEYS.honored), dict(jq.TEXT_EXTRA_KEYS.ignored))


def test_checkpoint_is_reproducible(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tools'); from checkpoints_internvl import make_internvl; "
            f"make_internvl({str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name


def test_tokenizer_specials_are_the_config_ids():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"])
    assert ids == list(range(400, 406)) and ids[-1] == json.loads((CKPT / "config.json").read_text())["image_token_id"]
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    text = "<img>" + "<IMG_CONTEXT>" * 8 + "</img>"
    assert tok(text, add_special_tokens=False)["input_ids"] == [IMG_START, *[IMG] * 8, IMG_END]


# ---- the processor ----------------------------------------------------------------------------

def _hf_processor(config):
    from transformers import GotOcr2ImageProcessorPil
    return GotOcr2ImageProcessorPil(size={"height": config.size[0], "width": config.size[1]},
                                    crop_to_patches=config.crop_to_patches, min_patches=config.min_patches,
                                    max_patches=config.max_patches, image_mean=list(config.image_mean),
                                    image_std=list(config.image_std))


PROCESSOR_CASES = {  # name: (config, call kwargs)
    "tiny-crop": (TINY_CROP, {}),
    "tiny": (tp.GotOcr2ImageProcessorConfig(size=(32, 32)), {}),
    "release": (tp.GotOcr2ImageProcessorConfig.internvl3(), {}),
    "release-lf-crop": (tp.GotOcr2ImageProcessorConfig.internvl3(), tp.lf_image_processor_kwargs(True)),
}


@pytest.mark.parametrize("case", ["tiny-crop", "tiny", pytest.param("release", marks=pytest.mark.slow),
                                  pytest.param("release-lf-crop", marks=pytest.mark.slow)])
def test_processor_matches_transformers(case):
    """Both twins against GotOcr2ImageProcessorPil on every image: pixel_values bit for bit, num_patches equal."""
    from PIL import Image
    config, kwargs = PROCESSOR_CASES[case]
    hf = _hf_processor(config)
    jconfig = jp.GotOcr2ImageProcessorConfig(**{k: getattr(config, k) for k in config.__dataclass_fields__})
    for path in IMAGES:
        with Image.open(path) as im:
            want = hf([im], return_tensors="np", **kwargs)
        image = read_png(path)
        pixels, counts = tp.process_images([image], config, **kwargs)
        np.testing.assert_array_equal(pixels.numpy(), want["pixel_values"])
        assert counts.tolist() == list(want["num_patches"])
        assert counts.tolist() == [tp.number_of_patches(*image.shape[:2], config.with_overrides(**kwargs))]
        assert hf.get_number_of_image_patches(*image.shape[:2], kwargs) == counts[0]
        j_pixels, j_counts = jp.process_images([image], jconfig, **kwargs)
        assert j_counts.tolist() == counts.tolist()
        np.testing.assert_array_equal(j_pixels, want["pixel_values"])


def test_processor_reads_preprocessor_config():
    d = {"crop_to_patches": False, "data_format": "channels_first", "default_to_square": True, "do_center_crop": None,
         "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
         "image_mean": [0.485, 0.456, 0.406], "image_processor_type": "GotOcr2ImageProcessorFast",
         "image_std": [0.229, 0.224, 0.225], "max_patches": 12, "min_patches": 1, "resample": 3,
         "rescale_factor": 0.00392156862745098, "size": {"height": 448, "width": 448}}
    for side in (tp, jp):
        assert side.GotOcr2ImageProcessorConfig.from_hf(d) == side.GotOcr2ImageProcessorConfig.internvl3()


def test_tiling_grid_matches_transformers():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas
    rng = np.random.default_rng(3)
    for _ in range(200):
        h, w = (int(v) for v in rng.integers(1, 4000, 2))
        lo, hi = sorted(int(v) for v in rng.integers(1, 13, 2))
        want = get_optimal_tiled_canvas((h, w), (448, 448), lo, hi)
        assert tp.optimal_tiled_canvas(h, w, (448, 448), lo, hi) == want
        assert jp.optimal_tiled_canvas(h, w, (448, 448), lo, hi) == want


def test_lf_plugin_helpers():
    """LLaMA-Factory's InternVLPlugin: crop kwargs only under its crop_to_patches argument; the base plugin's image
    resize; `<image>` -> `<img>` + `<IMG_CONTEXT>` * image_seq_length * tiles + `</img>`."""
    assert tp.lf_image_processor_kwargs(False) == {} == jp.lf_image_processor_kwargs(False)
    assert tp.lf_image_processor_kwargs(True) == {"crop_to_patches": True, "max_patches": 12, "min_patches": 1}
    for path in IMAGES:
        image = read_png(path)
        for limits in ((768 * 768, 32 * 32), (100 ** 2, 60 * 60), (30 * 30, 28 * 28)):  # up- and downscales
            np.testing.assert_array_equal(tvp.preprocess_image_base(image, *limits), jvp.preprocess_image_base(image, *limits))
    messages = [{"role": "user", "content": "<image>a<image>"}, {"role": "assistant", "content": "b"}]
    for side in (tp, jp):
        out = side.expand_image_placeholders(messages, [2, 1], 4)
        assert out[0]["content"] == "<img>" + "<IMG_CONTEXT>" * 8 + "</img>a<img>" + "<IMG_CONTEXT>" * 4 + "</img>"
        assert messages[0]["content"] == "<image>a<image>"
        with pytest.raises(ValueError, match="number of images"):
            side.expand_image_placeholders(messages, [2], 4)
