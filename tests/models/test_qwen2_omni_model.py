"""Qwen2.5-Omni's thinker: the torch source against transformers' Qwen2_5OmniThinkerForConditionalGeneration on
the shipped checkpoint with images (windows cut, two images back to back, an image-free row, a text-only batch,
left and right padding), the JAX twin against the torch source (logits and the gradient reaching the pixels), the
audio tower on both sides against transformers' and its output shape, audio in the forward (input_features at
the audio tokens) against transformers, the refusals of video and of audio tokens without audio, the conversion
both ways (every `thinker.*` tensor, the audio tower's included), the wrapper and bare thinker config forms, the
config refusals, and the checkpoint's reproducibility."""

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

from conversion import qwen2_omni as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from jax_oracles.models import audio as jaudio  # noqa: E402
from jax_oracles.models import qwen2_omni as jq  # noqa: E402
from torch_sources.models import audio as taudio  # noqa: E402
from torch_sources.models import qwen2_omni as tq  # noqa: E402
from torch_sources.models.config_keys import ConfigError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def smoke_first(names):  # the first batch in CI (make test), the others in make test-full
    return [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(names)]

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/qwen2_omni"
TORCH_TOL, JAX_TOL = 1e-5, 1e-4
AUDIO, AUDIO_BOS, VS, VE, IMG, VIDEO = 403, 404, 409, 410, 412, 413  # Omni's specials, 400 + release id - 151643


def _batch(grids, rows, T, side="right", seed=0):
    """Random text ids with `<|vision_bos|> <|IMAGE|>*n <|vision_eos|>` spans at the given offsets.
    rows: per row, a list of (offset, image index) and a real length. grids=[]: a text-only batch."""
    rng = np.random.default_rng(seed)
    grid = np.array(grids, np.int64).reshape(-1, 3)
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
    if not len(grid):
        return ids, mask, None, None
    pixels = rng.standard_normal((int(grid.prod(1).sum()), 3 * 2 * 14 * 14)).astype(np.float32)
    return ids, mask, pixels, grid


BATCHES = {
    # a row with two images back to back (the second's vision_bos right after the first's vision_eos), the
    # [1,6,8] one cut into 2x2-merged-token windows; a second row with a third image; right padding
    "two-rows-right": _batch([[1, 4, 4], [1, 6, 8], [1, 4, 6]], [([(2, 0), (8, 1)], 30), ([(1, 2)], 17)], 32),
    # an image-free row beside an image row, left padding
    "mixed-left": _batch([[1, 6, 8]], [([(3, 0)], 22), ([], 9)], 24, side="left", seed=1),
    # a row whose last tokens are the image span
    "image-last": _batch([[1, 4, 4]], [([(5, 0)], 11)], 11, seed=2),
    # no image in the batch: the thinker's text-only positions (pads at 1), left padding
    "text-left": _batch([], [([], 12), ([], 7)], 12, side="left", seed=3),
}


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration
    hf = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        CKPT, attn_implementation="eager", dtype=torch.float32).eval()
    src = tq.Qwen2OmniThinkerForConditionalGeneration.from_pretrained(CKPT)
    params = conv.load_params(CKPT)
    jmodel = jq.Qwen2OmniThinkerForConditionalGeneration(jq.Qwen2OmniConfig.from_pretrained(CKPT))
    return hf, src, params, jmodel


def _t(x):
    return None if x is None else torch.tensor(x)


def _torch_logits(model, ids, mask, pixels, grid, **extra):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=_t(pixels),
                     image_grid_thw=_t(grid), **extra)  # by keyword: transformers' second parameter is the audio


@pytest.mark.parametrize("name", smoke_first(sorted(BATCHES)))
def test_source_matches_transformers(models, name):
    hf, src, _, _ = models
    ids, mask, pixels, grid = BATCHES[name]
    want = _torch_logits(hf, ids, mask, pixels, grid).logits.numpy()
    got = _torch_logits(src, ids, mask, pixels, grid).numpy()
    real = mask.astype(bool)  # pad rows' logits are never read
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())
    if pixels is not None:  # the tower's output computed once, passed in: the same forward
        with torch.no_grad():
            embeds = src.encode_images(torch.tensor(pixels), torch.tensor(grid))
            again = src(torch.tensor(ids), torch.tensor(mask), image_grid_thw=torch.tensor(grid), image_embeds=embeds)
        np.testing.assert_array_equal(again.numpy(), got)


@pytest.mark.parametrize("name", smoke_first(sorted(BATCHES)))
def test_jax_matches_source(models, name):
    _, src, params, model = models
    ids, mask, pixels, grid = BATCHES[name]
    want = _torch_logits(src, ids, mask, pixels, grid).numpy()
    positions, _ = model.rope_index(ids, grid, mask)
    fwd = jax.jit(lambda p, i, m, pos, px: model.apply({"params": p}, i, m, pos, px, grid))
    got = np.asarray(fwd(params, ids, mask, positions, pixels))
    assert np.abs(got - want).max() <= JAX_TOL


@pytest.mark.slow
def test_pixel_gradient_matches(models):
    """The gradient of a loss on the logits with respect to the pixel values: image content flowing through the
    windowed tower, the merge and the attended language model into one number, on both sides."""
    _, src, params, model = models
    ids, mask, pixels, grid = BATCHES["two-rows-right"]
    w = np.random.default_rng(5).standard_normal((ids.shape[1], src.config.vocab_size)).astype(np.float32)
    px = torch.tensor(pixels, requires_grad=True)
    (src(torch.tensor(ids), torch.tensor(mask), pixel_values=px, image_grid_thw=torch.tensor(grid))
     * torch.tensor(w)).sum().backward()
    positions, _ = model.rope_index(ids, grid, mask)
    loss = lambda p, px: jnp.sum(model.apply({"params": p}, ids, mask, positions, px, grid) * w)  # noqa: E731
    grad = jax.jit(jax.grad(loss, argnums=1))(params, pixels)
    want = px.grad.numpy()
    assert np.abs(want).max() > 1e-3  # the pixels reach the logits
    assert np.abs(np.asarray(grad) - want).max() <= JAX_TOL * np.abs(want).max()


def test_audio_tower_matches_transformers(models):
    """Four audios concatenated along time: 37 frames (two chunks, the second odd), 20 (one full chunk), 8 and 3;
    19 + 10 + 4 + 2 frames after the stem, pooled to 9 + 5 + 2 + 1 tokens of output_dim 64."""
    hf, src, params, model = models
    lens = np.array([37, 20, 8, 3])
    feats = np.random.default_rng(7).standard_normal((128, int(lens.sum()))).astype(np.float32)
    with torch.no_grad():
        want = hf.model.audio_tower(torch.tensor(feats), feature_lens=torch.tensor(lens)).last_hidden_state.numpy()
        got = src.audio_features(torch.tensor(feats), torch.tensor(lens)).numpy()
    assert want.shape == got.shape == (17, 64)
    assert taudio.audio_output_lengths(torch.tensor(lens)).tolist() == jaudio.audio_output_lengths(lens).tolist() \
        == [9, 5, 2, 1]
    assert np.abs(got - want).max() <= TORCH_TOL * max(1.0, np.abs(want).max())
    jgot = jax.jit(lambda p, f: model.apply({"params": p}, f, lens, method="audio_features"))(params, feats)
    assert np.abs(np.asarray(jgot) - got).max() <= JAX_TOL


def test_audio_stem_bookkeeping():
    """The host-side indices, literal: chunks of 2 * n_window = 20 frames, the real frames after the stride-2
    conv, and the averaged pairs (an odd last frame dropped)."""
    for side in (taudio, jaudio):
        lens = np.array([25, 4]) if side is jaudio else torch.tensor([25, 4])
        chunks = side.audio_chunk_lengths(lens, 10)
        assert list(chunks) == [20, 5, 4]
        assert list(side.audio_cu_seqlens(chunks)) == [0, 10, 13, 15]  # 10, 3 and 2 frames after the stem
        assert list(side.valid_index(chunks)) == [*range(10), 10, 11, 12, 20, 21]
        assert list(side.pool_index(lens)) == [0, 2, 4, 6, 8, 10, 13]


def _audio_batch(seed=8):
    """Two rows, right-padded: text, an audio span (37 feature frames: 9 tokens), a 2x2-merged image, text; text,
    an audio span (20 frames: 5 tokens), text. Features f32[2, 128, 40] with the frames past each audio masked."""
    rng = np.random.default_rng(seed)
    lens, T = [37, 20], 30
    feats = rng.standard_normal((2, 128, 40)).astype(np.float32)
    fmask = (np.arange(40)[None] < np.array(lens)[:, None]).astype(np.int32)
    spans = [[AUDIO_BOS, *[AUDIO] * 9, AUDIO_BOS + 1], [AUDIO_BOS, *[AUDIO] * 5, AUDIO_BOS + 1]]
    rows = [[7, 8, *spans[0], 9, VS, *[IMG] * 4, VE, 10, 11], [12, *spans[1], 13, 14, 15]]
    ids, mask = np.full((2, T), 400, np.int64), np.zeros((2, T), np.int64)
    for r, row in enumerate(rows):
        ids[r, :len(row)], mask[r, :len(row)] = row, 1
    pixels = rng.standard_normal((16, 3 * 2 * 14 * 14)).astype(np.float32)
    return ids, mask, pixels, np.array([[1, 4, 4]]), feats, fmask


def test_audio_in_the_forward_matches_transformers(models):
    """input_features + feature_attention_mask: each audio's masked frames through the tower, its rows at the audio
    tokens (after an image in the first row), the positions from the thinker's index with audio_seqlens; and the
    tower's output passed in (audio_embeds) gives the same forward."""
    hf, src, _, _ = models
    ids, mask, pixels, grid, feats, fmask = _audio_batch()
    audio = dict(input_features=torch.tensor(feats), feature_attention_mask=torch.tensor(fmask))
    want = _torch_logits(hf, ids, mask, pixels, grid, **audio).logits.numpy()
    got = _torch_logits(src, ids, mask, pixels, grid, **audio).numpy()
    real = mask.astype(bool)
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())
    positions, _ = src.rope_index(torch.tensor(ids), torch.tensor(grid), torch.tensor(mask), torch.tensor([37, 20]))
    with torch.no_grad():
        embeds = src.encode_audio(*audio.values())
        again = src(torch.tensor(ids), torch.tensor(mask), positions, torch.tensor(pixels), torch.tensor(grid),
                    audio_embeds=embeds).numpy()
        silent = src(torch.tensor(ids), torch.tensor(mask), positions, torch.tensor(pixels), torch.tensor(grid),
                     audio_embeds=torch.zeros_like(embeds)).numpy()
    assert embeds.shape == (14, 64)
    np.testing.assert_array_equal(again, got)
    assert np.abs(silent - got)[real].max() > 1e-3  # the audio reaches the logits


@pytest.mark.slow
def test_audio_in_the_jax_forward_matches_source(models):
    """The JAX twin on the same batch: input_features under jit (the frame mask static), and encode_audio's rows
    passed in as audio_embeds padded past the 14 audio tokens (never read)."""
    _, src, params, model = models
    ids, mask, pixels, grid, feats, fmask = _audio_batch()
    want = _torch_logits(src, ids, mask, pixels, grid, input_features=torch.tensor(feats),
                         feature_attention_mask=torch.tensor(fmask)).numpy()
    positions, _ = model.rope_index(ids, grid, mask, fmask.sum(-1))
    fwd = jax.jit(lambda p, f: model.apply({"params": p}, ids, mask, positions, pixels, grid, input_features=f,
                                           feature_attention_mask=fmask))
    assert np.abs(np.asarray(fwd(params, feats)) - want).max() <= JAX_TOL
    encode = jax.jit(lambda p, f: model.apply({"params": p}, f, fmask, method="encode_audio"))
    padded = np.zeros((40, 64), np.float32)
    padded[:14] = np.asarray(encode(params, feats))
    again = jax.jit(lambda p, a: model.apply({"params": p}, ids, mask, positions, pixels, grid, audio_embeds=a))
    assert np.abs(np.asarray(again(params, padded)) - want).max() <= JAX_TOL


@pytest.mark.parametrize("token", [AUDIO, VIDEO])
def test_unplaced_tokens_are_refused(models, token):
    """Video tokens always; audio tokens without audio (their placeholder embedding would stand in)."""
    _, src, params, model = models
    ids, mask, pixels, grid = BATCHES["image-last"]
    ids = ids.copy()
    ids[0, 1] = token
    with pytest.raises(ValueError, match="audio|video"):
        _torch_logits(src, ids, mask, pixels, grid)
    positions = np.zeros((3, *ids.shape), np.int64)  # even with positions given: the ids are checked
    with pytest.raises(ValueError, match="audio|video"):
        model.apply({"params": params}, ids, mask, positions, pixels, grid)


def test_audio_count_mismatch_is_refused(models):
    _, src, params, model = models
    ids, mask, pixels, grid, feats, fmask = _audio_batch()
    ids = ids.copy()
    ids[1, 2] = 7  # one audio token fewer than the second audio's 5
    positions = np.zeros((3, *ids.shape), np.int64)
    with pytest.raises(ValueError, match="audio features and audio tokens"):
        _torch_logits(src, ids, mask, pixels, grid, position_ids=torch.tensor(positions),
                      input_features=torch.tensor(feats), feature_attention_mask=torch.tensor(fmask))
    with pytest.raises(ValueError, match="audio features and audio tokens"):  # raised while tracing: the ids are
        jax.jit(lambda p: model.apply({"params": p}, ids, mask, positions, pixels, grid,  # constants, so concrete
                                      input_features=feats, feature_attention_mask=fmask))(params)


def test_image_count_mismatch_is_refused(models):
    _, src, params, model = models
    ids, mask, pixels, grid = BATCHES["image-last"]
    ids = ids.copy()
    ids[0, 6] = 7  # one image token fewer than the grid's merged patches
    with pytest.raises(Exception, match="image"):
        _torch_logits(src, ids, mask, pixels, grid)
    with pytest.raises(Exception, match="image"):
        model.apply({"params": params}, ids, mask, None, pixels, grid)


def test_conversion_both_ways():
    params = conv.load_params(CKPT)
    state = safetensors_io.load_state_dict(CKPT)
    stored = {k: tuple(v.shape) for k, v in state.items()}
    assert conv.hf_layout(params) == stored
    assert {k.split(".")[1] for k in stored} == {"model", "lm_head", "visual", "audio_tower"}
    config = conv.load_config(CKPT)
    extra = {**state, "talker.model.norm.weight": np.ones(8, np.float32)}  # speech output: dropped as transformers
    assert conv.hf_layout(conv.convert_state_dict(extra, config)) == stored
    for name, match in (("thinker.audio_tower.layers.1.self_attn.k_proj.weight", "never written"),
                        ("thinker.visual.blocks.1.attn.v.bias", "never written")):
        cut = dict(state)
        cut.pop(name)
        with pytest.raises(ValueError, match=match):
            conv.convert_state_dict(cut, config)
    with pytest.raises(ValueError, match="unused"):
        conv.convert_state_dict({**state, "thinker.audio_tower.layers.0.self_attn.k_proj.bias": np.zeros(32)}, config)


def test_tied_head_variant(tmp_path):
    """A thinker-level tie_word_embeddings (none of the shipped checkpoint's; read as transformers 5.24 reads it):
    the stored head is dropped, the embedding is the head on both sides."""
    import shutil
    d = json.loads((CKPT / "config.json").read_text())
    d["thinker_config"]["tie_word_embeddings"] = True
    shutil.copy(CKPT / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(d))
    src = tq.Qwen2OmniThinkerForConditionalGeneration.from_pretrained(tmp_path)
    assert src.lm_head.weight is src.model.embed_tokens.weight
    params = conv.load_params(tmp_path)
    assert "lm_head" not in params and "thinker.lm_head.weight" not in conv.hf_layout(params)
    ids, mask, pixels, grid = BATCHES["image-last"]
    want = _torch_logits(src, ids, mask, pixels, grid).numpy()
    embed = src.model.embed_tokens.weight.detach().numpy()
    _, hidden = src(torch.tensor(ids), torch.tensor(mask), pixel_values=torch.tensor(pixels),
                    image_grid_thw=torch.tensor(grid), return_hidden=True)
    assert np.abs(hidden.detach().numpy() @ embed.T - want).max() <= 1e-5
    model = jq.Qwen2OmniThinkerForConditionalGeneration(jq.Qwen2OmniConfig.from_pretrained(tmp_path))
    positions, _ = model.rope_index(ids, grid, mask)
    fwd = jax.jit(lambda p, i, m, pos, px: model.apply({"params": p}, i, m, pos, px, grid))
    assert np.abs(np.asarray(fwd(params, ids, mask, positions, pixels)) - want).max() <= JAX_TOL


def test_config_forms_read_the_same(tmp_path):
    """The shipped wrapper config.json (release keys), transformers 5's save of the wrapper (talker and token2wav
    configs added, rope_parameters) and of the bare thinker read the same."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniThinkerConfig
    release = json.loads((CKPT / "config.json").read_text())
    Qwen2_5OmniConfig(**release).save_pretrained(tmp_path / "wrapper")
    Qwen2_5OmniThinkerConfig(**release["thinker_config"]).save_pretrained(tmp_path / "thinker")
    wrapper = json.loads((tmp_path / "wrapper/config.json").read_text())
    thinker = json.loads((tmp_path / "thinker/config.json").read_text())
    assert "talker_config" in wrapper and thinker["model_type"] == "qwen2_5_omni_thinker"
    for side in (tq, jq):
        want = side.Qwen2OmniConfig.from_hf(release)
        assert side.Qwen2OmniConfig.from_hf(wrapper) == want == side.Qwen2OmniConfig.from_hf(thinker)
    c = tq.Qwen2OmniConfig.from_hf(release)
    assert (c.mrope_section, c.text.head_dim, c.text.rope.theta, c.tie_word_embeddings) == ((2, 3, 3), 16, 1e6, False)
    assert (c.image_token_id, c.video_token_id, c.audio_token_id, c.vision_start_token_id,
            c.audio_start_token_id) == (IMG, VIDEO, AUDIO, VS, AUDIO_BOS)
    assert c.vision.separate_qkv and c.vision.fullatt_block_indexes == (1,) and c.audio.n_window == 10


def _edit(path: str, value):
    d = json.loads((CKPT / "config.json").read_text())
    *keys, last = path.split("/")
    node = d
    for k in keys:
        node = node[k]
    if value is None:
        node.pop(last)
    else:
        node[last] = value
    return d


@pytest.mark.parametrize("path, value, match", [
    ("thinker_config/text_config/use_sliding_window", True, "use_sliding_window"),
    ("thinker_config/text_config/rope_scaling", {"type": "default"}, "mrope_section"),
    ("thinker_config/text_config/rope_scaling", {"rope_type": "default", "mrope_section": [2, 3, 4]}, "mrope_section"),
    ("thinker_config/text_config/rope_scaling", {"type": "yarn", "factor": 2.0, "mrope_section": [2, 3, 3]},
     "rope_type"),
    ("thinker_config/audio_config/activation_function", "not_an_act", "activation_function"),
    ("thinker_config/audio_config/not_a_key", 1, "not_a_key"),
    ("thinker_config/vision_start_token_id", None, "vision_start_token_id"),
    ("thinker_config/not_a_key", 1, "not_a_key"),
    ("not_a_key", 1, "not_a_key"),
])
def test_refusals(path, value, match):
    d = _edit(path, value)
    for side in (tq, jq):
        with pytest.raises(ValueError, match=match):
            side.Qwen2OmniConfig.from_hf(d)
    assert issubclass(ConfigError, ValueError)


def test_checkpoint_is_reproducible(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tools'); from checkpoints_qwen2_omni import make_qwen2_omni; "
            f"make_qwen2_omni({str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name


def test_lora_targets_the_language_model_only(models):
    """LF's patch_target_modules under its defaults: adapters on the language model's projections only (the
    vision tower with its merger and the audio tower, whose q/k/v_proj share the decoder's names, frozen), the
    same names, shapes and order on both sides."""
    from jax_oracles.training import lora as jlora
    from torch_sources.training import lora as tlora
    _, src, params, _ = models
    want = [(f"base_model.model.model.layers.{i}.{m}", *s) for i in range(2) for m, s in (
        ("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (64, 32)), ("self_attn.v_proj", (64, 32)),
        ("self_attn.o_proj", (64, 64)), ("mlp.gate_proj", (64, 128)), ("mlp.up_proj", (64, 128)),
        ("mlp.down_proj", (128, 64)))]
    assert tlora.lora_target_specs(src, tlora.LoraConfig()) == want
    assert jlora.lora_target_specs(params, jlora.LoraConfig()) == want
