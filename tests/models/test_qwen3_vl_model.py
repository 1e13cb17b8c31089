"""Qwen3-VL: the torch source against transformers' Qwen3VLForConditionalGeneration on the shipped checkpoint with
images, the JAX twin against the torch source (logits and the gradient reaching the pixels), the deepstack injection
alone and its teeth, the conversion both ways, both config.json forms, the refusals, and the checkpoint's
reproducibility."""

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

from conversion import qwen3_vl as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import qwen3_vl as jq  # noqa: E402
from torch_sources.models import qwen3_vl as tq  # noqa: E402
from torch_sources.models.config_keys import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def smoke_first(names):  # the first batch in CI (make test), the others in make test-full
    return [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(names)]

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/qwen3_vl"
TORCH_TOL, JAX_TOL = 1e-5, 1e-4
VS, VE, IMG = 409, 410, 412
PATCH = 3 * 2 * 16 * 16  # one flattened patch: C * temporal_patch_size * patch_size^2


def _batch(grids, rows, T, side="right", seed=0):
    """Random text ids with `<|vision_start|> <|image_pad|>*n <|vision_end|>` spans at the given offsets.
    rows: per row, a list of (offset, image index) and a real length."""
    rng = np.random.default_rng(seed)
    grid = np.array(grids, np.int64)
    ids = rng.integers(0, 400, (len(rows), T))
    mask = np.zeros_like(ids)
    for r, (spans, length) in enumerate(rows):
        row = rng.integers(0, 400, length)
        for offset, image in spans:
            n = int(grid[image].prod()) // 4
            row[offset:offset + n + 2] = [VS, *[IMG] * n, VE]
        if side == "right":
            ids[r, :length], mask[r, :length] = row, 1
        else:
            ids[r, T - length:], mask[r, T - length:] = row, 1
    pixels = rng.standard_normal((int(grid.prod(1).sum()), PATCH)).astype(np.float32)
    return ids, mask, pixels, grid


BATCHES = {
    # two images of different grids in one row (the 8x8 position table shrunk and stretched), a second row with one
    "two-rows-right": _batch([[1, 4, 4], [1, 6, 8], [1, 4, 6]], [([(2, 0), (10, 1)], 30), ([(1, 2)], 17)], 32),
    # an image-free row beside an image row, left padding
    "mixed-left": _batch([[1, 6, 4]], [([(3, 0)], 20), ([], 9)], 24, side="left", seed=1),
    # a row whose last tokens are the image span
    "image-last": _batch([[1, 4, 4]], [([(5, 0)], 11)], 11, seed=2),
}


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen3VLForConditionalGeneration
    hf = Qwen3VLForConditionalGeneration.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32).eval()
    src = tq.Qwen3VLForConditionalGeneration.from_pretrained(CKPT)
    params = conv.load_params(CKPT)
    return hf, src, params


def _torch_logits(model, ids, mask, pixels, grid, **extra):
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(mask), pixel_values=torch.tensor(pixels),
                     image_grid_thw=torch.tensor(grid), **extra)


def _hf_logits(hf, ids, mask, pixels, grid) -> np.ndarray:
    types = torch.tensor(ids == IMG).long()  # the processor's mm_token_type_ids: transformers requires them
    return _torch_logits(hf, ids, mask, pixels, grid, mm_token_type_ids=types).logits.numpy()


def _jax_model():
    return jq.Qwen3VLForConditionalGeneration(jq.Qwen3VLConfig.from_pretrained(CKPT))


@pytest.mark.parametrize("name", smoke_first(sorted(BATCHES)))
def test_source_matches_transformers(models, name):
    hf, src, _ = models
    ids, mask, pixels, grid = BATCHES[name]
    want = _hf_logits(hf, ids, mask, pixels, grid)
    got = _torch_logits(src, ids, mask, pixels, grid).numpy()
    real = mask.astype(bool)  # pad rows' logits are never read
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("name", smoke_first(sorted(BATCHES)))
def test_jax_matches_source(models, name):
    _, src, params = models
    ids, mask, pixels, grid = BATCHES[name]
    want = _torch_logits(src, ids, mask, pixels, grid).numpy()
    model = _jax_model()
    positions, _ = model.rope_index(ids, grid, mask)
    fwd = jax.jit(lambda p, i, m, pos, px: model.apply({"params": p}, i, m, pos, px, grid))
    got = np.asarray(fwd(params, ids, mask, positions, pixels))
    assert np.abs(got - want).max() <= JAX_TOL


def test_text_only_batch_matches(models):
    """No pixels: no tower, no deepstack; positions count the real tokens on all three rows."""
    hf, src, params = models
    ids, mask, _, _ = _batch([[1, 4, 4]], [([], 12), ([], 7)], 12, seed=3)
    with torch.no_grad():
        want = hf(torch.tensor(ids), torch.tensor(mask)).logits.numpy()
        got = src(torch.tensor(ids), torch.tensor(mask)).numpy()
    real = mask.astype(bool)
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())
    assert np.abs(np.asarray(_jax_model().apply({"params": params}, ids, mask)) - got).max() <= JAX_TOL


@pytest.mark.slow
def test_pixel_gradient_matches(models):
    """The gradient of a loss on the logits with respect to the pixel values: image content flowing through the
    tower, its deepstack mergers, the merge, the injections and the attended language model into one number."""
    _, src, params = models
    ids, mask, pixels, grid = BATCHES["two-rows-right"]
    w = np.random.default_rng(5).standard_normal((ids.shape[1], src.config.vocab_size)).astype(np.float32)
    px = torch.tensor(pixels, requires_grad=True)
    (src(torch.tensor(ids), torch.tensor(mask), pixel_values=px, image_grid_thw=torch.tensor(grid))
     * torch.tensor(w)).sum().backward()
    model = _jax_model()
    positions, _ = model.rope_index(ids, grid, mask)
    loss = lambda p: jnp.sum(model.apply({"params": params}, ids, mask, positions, p, grid) * w)  # noqa: E731
    grad = jax.jit(jax.grad(loss))(pixels)
    want = px.grad.numpy()
    assert np.abs(want).max() > 1e-3  # the pixels reach the logits
    assert np.abs(np.asarray(grad) - want).max() <= JAX_TOL * np.abs(want).max()


def test_add_deepstack_matches_transformers(models):
    """The injection alone: transformers' `_deepstack_process` on random hidden states, both sides, and jitted."""
    hf, _, _ = models
    rng = np.random.default_rng(7)
    hidden = rng.standard_normal((2, 9, 64)).astype(np.float32)
    visual = np.zeros((2, 9), bool)
    visual[0, 2:6], visual[1, [0, 4, 8]] = True, True
    features = rng.standard_normal((int(visual.sum()), 64)).astype(np.float32)
    with torch.no_grad():
        want = hf.model.language_model._deepstack_process(torch.tensor(hidden), torch.tensor(visual),
                                                          torch.tensor(features)).numpy()
    got = tq.add_deepstack(torch.tensor(hidden), torch.tensor(visual), torch.tensor(features)).numpy()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(jq.add_deepstack(hidden, visual, features)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(jq.add_deepstack)(hidden, visual, features)), want)
    assert np.abs(want - hidden).max() > 1  # the features land (in reading order, checked by the equalities)
    for side, args in ((tq, [torch.tensor(x) for x in (hidden, visual, features[1:])]),
                       (jq, [hidden, visual, features[1:]])):
        with pytest.raises(ValueError, match="deepstack"):
            side.add_deepstack(*args)


def test_deepstack_has_teeth(models):
    """Without the deepstack features (or with only the first), the source's logits leave transformers' by far more
    than the tolerance: the injection after each decoder layer is what test_source_matches_transformers holds."""
    hf, src, _ = models
    ids, mask, pixels, grid = BATCHES["two-rows-right"]
    want = _hf_logits(hf, ids, mask, pixels, grid)
    image, text = ids == IMG, mask.astype(bool) & (ids != IMG)
    c = src.config
    with torch.no_grad():
        t_ids, t_mask = torch.tensor(ids), torch.tensor(mask)
        positions, _ = src.rope_index(t_ids, torch.tensor(grid), t_mask)
        merged, deepstack = src.model.visual(torch.tensor(pixels), torch.tensor(grid))
        embeds = tq.merge_image_embeddings(src.model.language_model.embed_tokens(t_ids), t_ids, merged, IMG)
        inputs = tq.layer_inputs(c, t_mask, positions)
        lm = src.model.language_model
        none = src.lm_head(lm(embeds, inputs)).numpy()
        first = src.lm_head(lm(embeds, inputs, torch.tensor(image), deepstack[:1])).numpy()
        both = src.lm_head(lm(embeds, inputs, torch.tensor(image), deepstack)).numpy()
    tol = TORCH_TOL * max(1.0, np.abs(want).max())
    assert np.abs(both - want)[mask.astype(bool)].max() <= tol  # the pieces reassemble the model
    assert np.abs(none - want)[image].max() > 1e4 * tol and np.abs(none - want)[text].max() > 1e3 * tol
    assert np.abs(first - want)[image].max() > 1e4 * tol  # the feature added after the last layer matters too


def test_precomputed_image_features_match_the_pixels(models):
    """The trainers' path: encode_images (the frozen tower once, outside a jitted step) gives image_embeds f32[n,D]
    and deepstack_embeds f32[n,K,D], row k the k-th image token's; the forward on them is the forward on the pixels
    (torch: the same ops, bit for bit; JAX: jitted, with zero rows padding both to a static count)."""
    _, src, params = models
    ids, mask, pixels, grid = BATCHES["two-rows-right"]
    t_ids, t_mask, t_grid = torch.tensor(ids), torch.tensor(mask), torch.tensor(grid)
    with torch.no_grad():
        want = src(t_ids, t_mask, pixel_values=torch.tensor(pixels), image_grid_thw=t_grid).numpy()
        features = src.encode_images(torch.tensor(pixels), t_grid)
        merged, deepstack = src.model.visual(torch.tensor(pixels), t_grid)
        got = src(t_ids, t_mask, image_grid_thw=t_grid, **features).numpy()
    n, K = int((ids == IMG).sum()), len(deepstack)
    assert features["image_embeds"].shape == (n, 64) and features["deepstack_embeds"].shape == (n, K, 64) and K == 2
    np.testing.assert_array_equal(features["image_embeds"].numpy(), merged.numpy())
    for k in range(K):
        np.testing.assert_array_equal(features["deepstack_embeds"][:, k].numpy(), deepstack[k].numpy())
    np.testing.assert_array_equal(got, want)

    model = _jax_model()
    positions, _ = model.rope_index(ids, grid, mask)

    def encoded_then_forward(p, i, m, pos, px):  # one compile: encode, pad both parts with rows never read, forward
        encoded = model.apply({"params": p}, px, grid, method="encode_images")
        padded = {k: jnp.concatenate([v, jnp.full((9, *v.shape[1:]), 7.0, v.dtype)]) for k, v in encoded.items()}
        return encoded, model.apply({"params": p}, i, m, pos, **padded)

    encoded, got_jax = jax.jit(encoded_then_forward)(params, ids, mask, positions, pixels)
    for k, v in encoded.items():
        assert np.abs(np.asarray(v) - features[k].numpy()).max() <= JAX_TOL, k
    assert np.abs(np.asarray(got_jax) - want).max() <= JAX_TOL

    # the deepstack features are half of the image input: dropping them changes the logits, so both are required
    with torch.no_grad():
        no_deepstack = src(t_ids, t_mask, image_grid_thw=t_grid, image_embeds=features["image_embeds"],
                           deepstack_embeds=torch.zeros_like(features["deepstack_embeds"])).numpy()
    assert np.abs(no_deepstack - want)[ids == IMG].max() > 1e3 * TORCH_TOL
    with pytest.raises(ValueError, match="deepstack_embeds"):
        src(t_ids, t_mask, image_grid_thw=t_grid, image_embeds=features["image_embeds"])
    with pytest.raises(ValueError, match="deepstack_embeds"):
        model.apply({"params": params}, ids, mask, positions, image_embeds=encoded["image_embeds"])


def test_image_count_mismatch_is_refused(models):
    _, src, params = models
    ids, mask, pixels, grid = BATCHES["image-last"]
    ids = ids.copy()
    ids[0, 6] = 7  # one image token fewer than the grid's merged patches
    with pytest.raises(Exception, match="image"):
        _torch_logits(src, ids, mask, pixels, grid)
    with pytest.raises(Exception, match="image"):
        _jax_model().apply({"params": params}, ids, mask, None, pixels, grid)


def test_conversion_both_ways():
    params = conv.load_params(CKPT)
    stored = {k: tuple(v.shape) for k, v in safetensors_io.load_state_dict(CKPT).items()}
    assert "lm_head.weight" not in stored and "model.visual.deepstack_merger_list.1.norm.weight" in stored
    assert conv.hf_layout(params) == stored
    state = safetensors_io.load_state_dict(CKPT)
    state.pop("model.visual.deepstack_merger_list.1.linear_fc2.bias")
    with pytest.raises(ValueError, match="never written"):
        conv.convert_state_dict(state, conv.load_config(CKPT))


def test_both_config_forms_read_the_same(tmp_path):
    """The release's form (the shipped file: text_config.rope_scaling + rope_theta, vision model_type qwen3_vl) and
    what transformers 5's save_pretrained writes (text_config.rope_parameters)."""
    from transformers import Qwen3VLConfig
    release = json.loads((CKPT / "config.json").read_text())
    Qwen3VLConfig(**release).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved["text_config"] and "rope_scaling" not in saved["text_config"]
    for side in (tq, jq):
        assert side.Qwen3VLConfig.from_hf(saved) == side.Qwen3VLConfig.from_hf(release)
    c = tq.Qwen3VLConfig.from_hf(release)
    assert (c.mrope_section, c.text.head_dim, c.text.rope.theta, c.tie_word_embeddings) == ((4, 2, 2), 16, 5e6, True)
    assert c.vision.deepstack_visual_indexes == (0, 1) and c.image_token_id == IMG


def test_the_tie_is_the_top_level_key():
    """transformers ties on Qwen3VLConfig.tie_word_embeddings (default False), whatever text_config repeats."""
    from transformers import Qwen3VLConfig
    release = json.loads((CKPT / "config.json").read_text())
    for top in (True, False, None):
        d = {k: v for k, v in release.items() if k != "tie_word_embeddings"}
        if top is not None:
            d["tie_word_embeddings"] = top
        want = Qwen3VLConfig(**d).tie_word_embeddings
        for side in (tq, jq):
            assert side.Qwen3VLConfig.from_hf(d).tie_word_embeddings is want
    assert want is False and release["text_config"]["tie_word_embeddings"] is True


def _edit_text(**edit):
    return lambda d: {**d, "text_config": {**d["text_config"], **edit}}


ROPE = {"rope_type": "default", "mrope_interleaved": True}


@pytest.mark.parametrize("edit, match", [
    (_edit_text(hidden_act="gelu"), "hidden_act"),
    (_edit_text(use_sliding_window=False), "use_sliding_window"),  # not a Qwen3-VL text key
    (_edit_text(rope_scaling={"rope_type": "default"}), "mrope_section"),
    (_edit_text(rope_scaling={**ROPE, "mrope_section": [2, 3, 3]}), "mrope_section"),  # interleaved: t/h/w 3/3/2
    (_edit_text(rope_scaling={**ROPE, "mrope_section": [4, 2, 3]}), "mrope_section"),  # 9 pairs of 8
    (_edit_text(rope_scaling={**ROPE, "mrope_section": [4, 2, 2], "mrope_interleaved": False}), "mrope_interleaved"),
    (_edit_text(rope_scaling={**ROPE, "mrope_section": [4, 2, 2], "rope_type": "linear", "factor": 2.0}), "rope_type"),
    (lambda d: {**d, "vision_config": {**d["vision_config"], "window_size": 112}}, "window_size"),
    (lambda d: {k: v for k, v in d.items() if k != "text_config"}, "text_config"),
    (lambda d: {**d, "not_a_key": 1}, "not_a_key"),
])
def test_refusals(edit, match):
    d = edit(json.loads((CKPT / "config.json").read_text()))
    for side in (tq, jq):
        with pytest.raises(ValueError, match=match):
            side.Qwen3VLConfig.from_hf(d)
    assert issubclass(ConfigError, ValueError)


def test_checkpoint_is_reproducible(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tools'); from checkpoints_qwen3_vl import make_qwen3_vl; "
            f"make_qwen3_vl({str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name
