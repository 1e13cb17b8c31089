"""Qwen2.5-VL: the torch source against transformers' Qwen2_5_VLForConditionalGeneration on the shipped checkpoint
with two shipped images of different sizes (their windows crossed), the JAX twin against the torch source, the
conversion both ways (exact), both config.json forms, the key audits against transformers' config classes, the
refusals (videos among them), and the checkpoint's reproducibility."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import traverse_util

jax.config.update("jax_default_matmul_precision", "highest")

from conversion import qwen2_5_vl as conv  # noqa: E402
from conversion import rules, safetensors_io  # noqa: E402
from jax_oracles.models import qwen2_5_vl as jq  # noqa: E402
from torch_sources.models import qwen2_5_vl as tq  # noqa: E402
from torch_sources.models import vision_processing as tvp  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/qwen2_5_vl"
IMAGES = [ROOT / "assets/images/exact_112x84.png", ROOT / "assets/images/wide_150x90.png"]  # grids 6x8 and 6x10
TORCH_TOL, JAX_TOL = 1e-5, 1e-4
VS, VE, IMG, VID = 409, 410, 412, 413


def _batch():
    """Row 0: text, image 0, text, image 1, text; row 1 (right-padded): image 1 again after a little text. The
    images go through the repo's processor with the release's settings (equal to transformers' below)."""
    images = [tvp.load_image(p) for p in IMAGES]
    pixels, grid = tvp.process_images([images[0], images[1], images[1]], tvp.QwenImageProcessorConfig.qwen2_vl())
    n = (grid.prod(1) // 4).tolist()
    span = [[VS, *[IMG] * k, VE] for k in n]
    rows = [[5, 6, *span[0], 7, 8, 9, *span[1], 10, 11], [12, *span[2], 13, 14]]
    T = max(map(len, rows))
    ids = np.full((2, T), 400, np.int64)  # <|endoftext|>, the pad
    mask = np.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = row, 1
    return ids, mask, pixels.numpy(), grid.numpy()


@pytest.fixture(scope="module")
def batch():
    return _batch()


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen2_5_VLForConditionalGeneration
    hf, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        CKPT, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # the release names load strictly: nothing missing, unexpected or mismatched
    src = tq.Qwen2_5VLForConditionalGeneration.from_pretrained(CKPT)
    return hf.eval(), src, conv.load_params(CKPT)


def _torch_logits(model, ids, mask, pixels, grid, **extra):
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(mask), pixel_values=torch.tensor(pixels),
                     image_grid_thw=torch.tensor(grid), **extra)


def test_processor_is_transformers(batch):
    """The pixels the tests feed are transformers' own (Qwen2VLImageProcessorPil, the release's min/max pixels)."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil
    _, _, pixels, grid = batch
    hf = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)(
        [Image.open(IMAGES[0]), Image.open(IMAGES[1]), Image.open(IMAGES[1])], return_tensors="np")
    assert np.array_equal(hf["image_grid_thw"], grid) and grid.tolist() == [[1, 6, 8], [1, 6, 10], [1, 6, 10]]
    assert np.array_equal(hf["pixel_values"], pixels)


def test_source_matches_transformers(models, batch):
    hf, src, _ = models
    ids, mask, pixels, grid = batch
    types = torch.tensor(ids == IMG).long()
    want = _torch_logits(hf, ids, mask, pixels, grid, mm_token_type_ids=types).logits.numpy()
    got = _torch_logits(src, ids, mask, pixels, grid).numpy()
    real = mask.astype(bool)  # pad rows' logits are never read
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())


def test_jax_matches_source(models, batch):
    _, src, params = models
    ids, mask, pixels, grid = batch
    want = _torch_logits(src, ids, mask, pixels, grid).numpy()
    model = jq.Qwen2_5VLForConditionalGeneration(jq.Qwen2_5VLConfig.from_pretrained(CKPT))
    positions, _ = model.rope_index(ids, grid, mask)
    fwd = jax.jit(lambda p, i, m, pos, px: model.apply({"params": p}, i, m, pos, px, grid))
    got = np.asarray(fwd(params, ids, mask, positions, pixels))
    assert np.abs(got - want).max() <= JAX_TOL


def test_conversion_round_trip_is_exact(models):
    """Every param runs back (its rule's transform is its own inverse) to the stored tensor, bit for bit, under the
    stored name and shape; a tensor missing from the checkpoint is refused."""
    _, _, params = models
    state = safetensors_io.load_state_dict(CKPT)
    back = {}
    for path, leaf in traverse_util.flatten_dict(params, sep="/").items():
        name, fn = rules._source_name(path, conv.RULES)
        back[name] = np.asarray(fn(np.asarray(leaf)))
    assert sorted(back) == sorted(state) and len(state) == 57
    for name, w in state.items():
        assert back[name].dtype == w.dtype and np.array_equal(back[name], w), name
    assert conv.hf_layout(params) == {k: tuple(v.shape) for k, v in state.items()}
    state.pop("visual.blocks.1.attn.qkv.bias")
    with pytest.raises(ValueError, match="never written"):
        conv.convert_state_dict(state, conv.load_config(CKPT))


def test_both_config_forms_read_the_same(tmp_path):
    """The release's flat form (the shipped file) and transformers 5's nested form (its save_pretrained)."""
    from transformers import Qwen2_5_VLConfig
    release = json.loads((CKPT / "config.json").read_text())
    Qwen2_5_VLConfig(**release).save_pretrained(tmp_path)
    nested = json.loads((tmp_path / "config.json").read_text())
    assert "text_config" in nested and "rope_scaling" not in nested
    for side in (tq, jq):
        assert side.Qwen2_5VLConfig.from_hf(nested) == side.Qwen2_5VLConfig.from_hf(release)
    c = tq.Qwen2_5VLConfig.from_hf(release)
    assert (c.mrope_section, c.text.head_dim, c.text.rope.theta, c.tie_word_embeddings) == ((2, 3, 3), 16, 1e6, False)
    v = c.vision
    assert (v.window_size, v.fullatt_block_indexes, v.separate_qkv, v.hidden_act) == (56, (1,), False, "silu")
    assert (c.num_key_value_heads, c.head_dim) == (2, 16)  # what the paged KV cache reads


@pytest.mark.parametrize("audit, config_class", [("TEXT_KEYS", "Qwen2_5_VLTextConfig"),
                                                 ("CONFIG_KEYS", "Qwen2_5_VLConfig")])
def test_audits_cover_transformers(audit, config_class):
    """Every key transformers' config class saves is honored, ignored with why, or refused; the twins agree."""
    from transformers.models.qwen2_5_vl import configuration_qwen2_5_vl
    t, j = getattr(tq, audit), getattr(jq, audit)
    assert (t.family, set(t.honored), dict(t.ignored)) == (j.family, set(j.honored), dict(j.ignored))
    assert {k: (tuple(map(repr, a)), w) for k, (a, w) in t.refused.items()} == \
        {k: (tuple(map(repr, a)), w) for k, (a, w) in j.refused.items()}
    assert set(getattr(configuration_qwen2_5_vl, config_class)().to_dict()) - t.keys == set()
    assert all(why.strip() for why in t.ignored.values())


@pytest.mark.parametrize("edit, match", [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"rope_scaling": {"type": "mrope"}}, "mrope_section"),
    ({"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 4]}}, "mrope_section"),
    ({"not_a_key": 1}, "qwen2_5_vl config: unknown key.*not_a_key"),
    ({"rope_scaling": {"type": "yarn", "factor": 2.0, "mrope_section": [2, 3, 3]}}, "rope_type"),
    ({"vision_config": {"not_a_vision_key": 1}}, "not_a_vision_key"),
])
def test_refusals(edit, match):
    d = {**json.loads((CKPT / "config.json").read_text()), **edit}
    for side in (tq, jq):
        with pytest.raises(ValueError, match=match):
            side.Qwen2_5VLConfig.from_hf(d)


def test_videos_are_refused(models, batch):
    """A video token where the rope index would place it: refused by name on both sides (no video processor)."""
    _, src, params = models
    ids, mask, pixels, grid = (x.copy() for x in batch)
    ids[1, -1] = VID
    with pytest.raises(ValueError, match="video token 413"):
        _torch_logits(src, ids, mask, pixels, grid)
    model = jq.Qwen2_5VLForConditionalGeneration(jq.Qwen2_5VLConfig.from_pretrained(CKPT))
    with pytest.raises(ValueError, match="video token 413"):
        model.rope_index(ids, grid, mask)


def test_checkpoint_is_reproducible(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tools'); from checkpoints_qwen2_5_vl import make_qwen2_5_vl; "
            f"make_qwen2_5_vl({str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name


def test_tokenizer_ids_are_the_checkpoints():
    """The shipped tokenizer's special ids are the ones config.json names."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(ROOT / "assets/tokenizer/qwen2_5_vl/tokenizer.json"))
    config = json.loads((CKPT / "config.json").read_text())
    for key, token in (("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
                       ("eos_token_id", "<|im_end|>")):
        assert tok.token_to_id(token) == config[key], key
    tokenizer_config = json.loads((ROOT / "assets/tokenizer/qwen2_5_vl/tokenizer_config.json").read_text())
    assert (tokenizer_config["eos_token"], tokenizer_config["pad_token"]) == ("<|im_end|>", "<|endoftext|>")


def test_lora_targets_the_language_model_only(models):
    """LF's patch_target_modules under its defaults: adapters on the language model's projections only (the
    tower's gated MLP and its merger frozen), the same names, shapes and order on both sides."""
    from jax_oracles.training import lora as jlora
    from torch_sources.training import lora as tlora
    _, src, params = models
    want = [(f"base_model.model.model.layers.{i}.{m}", *s) for i in range(2) for m, s in (
        ("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (64, 32)), ("self_attn.v_proj", (64, 32)),
        ("self_attn.o_proj", (64, 64)), ("mlp.gate_proj", (64, 128)), ("mlp.up_proj", (64, 128)),
        ("mlp.down_proj", (128, 64)))]
    assert tlora.lora_target_specs(src, tlora.LoraConfig()) == want
    assert jlora.lora_target_specs(params, jlora.LoraConfig()) == want
