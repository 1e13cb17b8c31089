"""Qwen2-VL: the torch source against transformers' Qwen2VLForConditionalGeneration on the shipped checkpoint with
images, the JAX twin against the torch source (logits and the gradient reaching the pixels), the conversion both
ways, both config.json forms, the refusals, and the checkpoint's reproducibility."""

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

from conversion import qwen2_vl as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import qwen2_vl as jq  # noqa: E402
from torch_sources.models import qwen2_vl as tq  # noqa: E402
from torch_sources.models.config_keys import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def smoke_first(names):  # the first batch in CI (make test), the others in make test-full
    return [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(names)]

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/qwen2_vl"
TORCH_TOL, JAX_TOL = 1e-5, 1e-4
VS, VE, IMG = 409, 410, 412


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
    pixels = rng.standard_normal((int(grid.prod(1).sum()), 3 * 2 * 14 * 14)).astype(np.float32)
    return ids, mask, pixels, grid


BATCHES = {
    # two images of different grids in one row, a second row with one, right padding
    "two-rows-right": _batch([[1, 4, 4], [1, 6, 8], [1, 4, 6]], [([(2, 0), (10, 1)], 30), ([(1, 2)], 17)], 32),
    # an image-free row beside an image row, left padding
    "mixed-left": _batch([[1, 6, 4]], [([(3, 0)], 20), ([], 9)], 24, side="left", seed=1),
    # a row that ends inside nothing but the image span (the prompt's last tokens are the image)
    "image-last": _batch([[1, 4, 4]], [([(5, 0)], 11)], 11, seed=2),
}


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen2VLForConditionalGeneration
    hf = Qwen2VLForConditionalGeneration.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32).eval()
    src = tq.Qwen2VLForConditionalGeneration.from_pretrained(CKPT)
    params = conv.load_params(CKPT)
    return hf, src, params


def _torch_logits(model, ids, mask, pixels, grid, **extra):
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(mask), pixel_values=torch.tensor(pixels),
                     image_grid_thw=torch.tensor(grid), **extra)


@pytest.mark.parametrize("name", smoke_first(sorted(BATCHES)))
def test_source_matches_transformers(models, name):
    hf, src, _ = models
    ids, mask, pixels, grid = BATCHES[name]
    types = torch.tensor(ids == IMG).long()
    want = _torch_logits(hf, ids, mask, pixels, grid, mm_token_type_ids=types).logits.numpy()
    got = _torch_logits(src, ids, mask, pixels, grid).numpy()
    real = mask.astype(bool)  # pad rows' logits are never read
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("name", smoke_first(sorted(BATCHES)))
def test_jax_matches_source(models, name):
    _, src, params = models
    ids, mask, pixels, grid = BATCHES[name]
    want = _torch_logits(src, ids, mask, pixels, grid).numpy()
    model = jq.Qwen2VLForConditionalGeneration(jq.Qwen2VLConfig.from_pretrained(CKPT))
    positions, _ = model.rope_index(ids, grid, mask)
    fwd = jax.jit(lambda p, i, m, pos, px: model.apply({"params": p}, i, m, pos, px, grid))
    got = np.asarray(fwd(params, ids, mask, positions, pixels))
    assert np.abs(got - want).max() <= JAX_TOL


def test_pixel_gradient_matches(models):
    """The gradient of a loss on the logits with respect to the pixel values: image content flowing through the
    tower, the merge and the attended language model into one number, on both sides."""
    _, src, params = models
    ids, mask, pixels, grid = BATCHES["two-rows-right"]
    w = np.random.default_rng(5).standard_normal((ids.shape[1], src.config.vocab_size)).astype(np.float32)
    px = torch.tensor(pixels, requires_grad=True)
    (src(torch.tensor(ids), torch.tensor(mask), pixel_values=px, image_grid_thw=torch.tensor(grid))
     * torch.tensor(w)).sum().backward()
    model = jq.Qwen2VLForConditionalGeneration(jq.Qwen2VLConfig.from_pretrained(CKPT))
    positions, _ = model.rope_index(ids, grid, mask)
    grad = jax.jit(jax.grad(lambda p: jnp.sum(model.apply({"params": params}, ids, mask, positions, p, grid) * w)))(pixels)
    want = px.grad.numpy()
    assert np.abs(want).max() > 1e-3  # the pixels reach the logits
    assert np.abs(np.asarray(grad) - want).max() <= JAX_TOL * np.abs(want).max()


def test_image_count_mismatch_is_refused(models):
    _, src, _ = models
    ids, mask, pixels, grid = BATCHES["image-last"]
    ids = ids.copy()
    ids[0, 6] = 7  # one image token fewer than the grid's merged patches
    with pytest.raises(Exception, match="image"):
        _torch_logits(src, ids, mask, pixels, grid)
    with pytest.raises(Exception, match="image"):
        jq.Qwen2VLForConditionalGeneration(jq.Qwen2VLConfig.from_pretrained(CKPT)).apply(
            {"params": conv.load_params(CKPT)}, ids, mask, None, pixels, grid)


def test_conversion_both_ways():
    params = conv.load_params(CKPT)
    stored = {k: tuple(v.shape) for k, v in safetensors_io.load_state_dict(CKPT).items()}
    assert conv.hf_layout(params) == stored
    state = safetensors_io.load_state_dict(CKPT)
    state.pop("visual.blocks.1.attn.qkv.bias")
    with pytest.raises(ValueError, match="never written"):
        conv.convert_state_dict(state, conv.load_config(CKPT))


def test_both_config_forms_read_the_same(tmp_path):
    """The release's flat form (the shipped file) and transformers 5's nested form (its save_pretrained)."""
    from transformers import Qwen2VLConfig
    release = json.loads((CKPT / "config.json").read_text())
    Qwen2VLConfig(**release).save_pretrained(tmp_path)
    nested = json.loads((tmp_path / "config.json").read_text())
    assert "text_config" in nested and "rope_scaling" not in nested
    for side in (tq, jq):
        assert side.Qwen2VLConfig.from_hf(nested) == side.Qwen2VLConfig.from_hf(release)
    c = tq.Qwen2VLConfig.from_hf(release)
    assert (c.mrope_section, c.text.head_dim, c.text.rope.theta, c.tie_word_embeddings) == ((2, 3, 3), 16, 1e6, True)


@pytest.mark.parametrize("edit, match", [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"type": "mrope"}}, "mrope_section"),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}}, "mrope_section"),
    ({"not_a_key": 1}, "not_a_key"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "mrope_section": [2, 3, 3]}}, "rope_type"),
])
def test_refusals(edit, match):
    d = {**json.loads((CKPT / "config.json").read_text()), **edit}
    for side in (tq, jq):
        with pytest.raises(ValueError, match=match):
            side.Qwen2VLConfig.from_hf(d)
    assert issubclass(ConfigError, ValueError)


def test_checkpoint_is_reproducible(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tools'); from checkpoints_qwen2_vl import make_qwen2_vl; "
            f"make_qwen2_vl({str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name


def test_tokenizer_ids_are_the_checkpoints():
    """The shipped tokenizer's special ids are the ones config.json names (the tokenizer row spells the tokens
    out as a literal; tools/make_vl_checkpoints.py's VL_IDS is what the config takes)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(ROOT / "assets/tokenizer/qwen2_vl/tokenizer.json"))
    config = json.loads((CKPT / "config.json").read_text())
    for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                       ("eos_token_id", "<|im_end|>")):
        assert tok.token_to_id(token) == config[key], key
    tokenizer_config = json.loads((ROOT / "assets/tokenizer/qwen2_vl/tokenizer_config.json").read_text())
    assert (tokenizer_config["eos_token"], tokenizer_config["pad_token"]) == ("<|im_end|>", "<|endoftext|>")


def test_lora_targets_the_language_model_only(models):
    """LF's patch_target_modules under its defaults: adapters on the language model's projections only (the
    tower, its merger frozen), the same names, shapes and order on both sides."""
    from jax_oracles.training import lora as jlora
    from torch_sources.training import lora as tlora
    _, src, params = models
    want = [(f"base_model.model.model.layers.{i}.{m}", *s) for i in range(2) for m, s in (
        ("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (64, 32)), ("self_attn.v_proj", (64, 32)),
        ("self_attn.o_proj", (64, 64)), ("mlp.gate_proj", (64, 128)), ("mlp.up_proj", (64, 128)),
        ("mlp.down_proj", (128, 64)))]
    assert tlora.lora_target_specs(src, tlora.LoraConfig()) == want
    assert jlora.lora_target_specs(params, jlora.LoraConfig()) == want
