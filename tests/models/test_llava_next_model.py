"""LLaVA-NeXT: the torch source against transformers' LlavaNextForConditionalGeneration on the shipped checkpoint with
images (as LLaMA-Factory trains it: train mode, labels, right padding), the JAX twin against the torch source (logits,
the gradient reaching the pixels and the trained parameters), the anyres packing alone, the conversion both ways
(and transformers 5's save layouts), both config.json forms, the refusals, the config audits, the image processor and
the token count against transformers' (both twins, tiny and release sizes), and the checkpoint's reproducibility."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")

from conversion import llava_next as conv  # noqa: E402
from conversion import safetensors_io  # noqa: E402
from flax import traverse_util  # noqa: E402
from jax_oracles.models import clip as jclip  # noqa: E402
from jax_oracles.models import llava_next as jq  # noqa: E402
from jax_oracles.models import llava_next_processing as JP  # noqa: E402
from jax_oracles.models import vision_processing as JV  # noqa: E402
from torch_sources.models import clip as tclip  # noqa: E402
from torch_sources.models import llava_next as tq  # noqa: E402
from torch_sources.models import llava_next_processing as TP  # noqa: E402
from torch_sources.models import vision_processing as TV  # noqa: E402
from torch_sources.models.config_keys import ConfigError  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def smoke_first(names):  # the first batch in CI (make test), the others in make test-full
    return [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(names)]


ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/llava_next"
TOKENIZER = ROOT / "assets/tokenizer/llava_next"
IMAGES = sorted((ROOT / "assets/images").glob("*.png"))
TORCH_TOL, JAX_TOL = 1e-5, 1e-4
IMG = 403
TINY_PROCESSOR = {"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32},
                  "image_grid_pinpoints": [[32, 64], [64, 32], [64, 64]]}
RELEASE_PROCESSOR = {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336},
                     "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]}


def _config():
    return tq.LlavaNextConfig.from_pretrained(CKPT)


def _batch(sizes, rows, T, side="right", seed=0):
    """Random text ids with the images' `<image>` runs at the given offsets, and random tiles (each image's stack
    padded to the longest with random tiles the model must not read). rows: per row, [(offset, image)] and a length."""
    rng = np.random.default_rng(seed)
    c = _config()
    counts = [tq.num_image_features(s, c) for s in sizes]
    ids = rng.integers(0, 400, (len(rows), T))
    mask = np.zeros_like(ids)
    for r, (spans, length) in enumerate(rows):
        row = rng.integers(0, 400, length)
        for offset, image in spans:
            row[offset:offset + counts[image]] = IMG
        if side == "right":
            ids[r, :length], mask[r, :length] = row, 1
        else:
            ids[r, T - length:], mask[r, T - length:] = row, 1
    tiles = max(tq.image_num_tiles(s, c) for s in sizes)
    pixels = rng.standard_normal((len(sizes), tiles, 3, 32, 32)).astype(np.float32)
    return ids, mask, pixels, np.array(sizes, np.int64)


# image sizes covering the three pinpoints and both unpadding directions (a 4 x 4 feature map a tile): (48, 64) ->
# 2 x 2 tiles, grid rows 1..7 kept; (100, 30) -> 2 x 1, columns 1..3; (60, 60) -> 2 x 2, nothing cropped; (16, 64) ->
# 1 x 2, rows 1..3; (40, 100) and (30, 100) -> 1 x 2, all rows / rows 1..3
BATCHES = {
    # two images in one row, a second row with a third, right padding (LF's)
    "two-images-right": _batch([(48, 64), (100, 30), (60, 60)], [([(2, 0), (80, 1)], 126), ([(1, 2)], 95)], 128),
    # an image-free row beside an image row
    "mixed-right": _batch([(16, 64)], [([(3, 0)], 40), ([], 9)], 44, seed=1),
    # a row ending in its image, left padding (positions still 0..T-1, as transformers numbers them)
    "image-last-left": _batch([(40, 100), (30, 100)], [([(5, 0)], 57), ([(0, 1)], 40)], 60, side="left", seed=2),
}


@pytest.fixture(scope="module")
def models():
    from transformers import LlavaNextForConditionalGeneration
    hf = LlavaNextForConditionalGeneration.from_pretrained(CKPT, attn_implementation="eager", dtype=torch.float32)
    hf.train()  # as LLaMA-Factory trains it (dropout 0 in the config: nothing random)
    src = tq.LlavaNextForConditionalGeneration.from_pretrained(CKPT)
    return hf, src, conv.load_params(CKPT)


def _torch_logits(model, ids, mask, pixels, sizes, **extra):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), pixel_values=torch.tensor(pixels),
                     image_sizes=torch.tensor(sizes), **extra)


def _hf_logits(hf, ids, mask, pixels, sizes) -> np.ndarray:
    labels = torch.tensor(np.where(mask.astype(bool) & (ids != IMG), ids, -100))
    return _torch_logits(hf, ids, mask, pixels, sizes, labels=labels).logits.numpy()


def _jax_model():
    return jq.LlavaNextForConditionalGeneration(jq.LlavaNextConfig.from_pretrained(CKPT))


@pytest.mark.parametrize("name", smoke_first(list(BATCHES)))
def test_source_matches_transformers(models, name):
    hf, src, _ = models
    ids, mask, pixels, sizes = BATCHES[name]
    want = _hf_logits(hf, ids, mask, pixels, sizes)
    got = _torch_logits(src, ids, mask, pixels, sizes).numpy()
    real = mask.astype(bool)  # pad rows' logits are never read
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("name", smoke_first(list(BATCHES)))
def test_jax_matches_source(models, name):
    _, src, params = models
    ids, mask, pixels, sizes = BATCHES[name]
    want = _torch_logits(src, ids, mask, pixels, sizes).numpy()
    model = _jax_model()
    got = np.asarray(jax.jit(lambda p, i, m, px: model.apply({"params": p}, i, m, px, sizes))(params, ids, mask, pixels))
    assert np.abs(got - want).max() <= JAX_TOL


def test_text_only_batch_matches(models):
    hf, src, params = models
    ids, mask, _, _ = _batch([(32, 32)], [([], 12), ([], 7)], 12, seed=3)
    with torch.no_grad():
        want = hf(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        got = src(torch.tensor(ids), torch.tensor(mask)).numpy()
    real = mask.astype(bool)
    assert np.abs(got - want)[real].max() <= TORCH_TOL * max(1.0, np.abs(want).max())
    assert np.abs(np.asarray(_jax_model().apply({"params": params}, ids, mask)) - got).max() <= JAX_TOL


@pytest.mark.slow
def test_gradients_match(models):
    """The gradient of a loss on the logits with respect to the pixels (through the tower, the projector, the
    regrid, the unpadding and the attended language model) and to the parameters a trainer can reach: the newline,
    the projector, a tower block, a decoder projection. The last tower block feeds nothing (layer -2): zero on both."""
    _, src, params = models
    ids, mask, pixels, sizes = BATCHES["two-images-right"]
    w = np.random.default_rng(5).standard_normal((ids.shape[1], src.config.vocab_size)).astype(np.float32)
    px = torch.tensor(pixels, requires_grad=True)
    src.zero_grad()
    (src(torch.tensor(ids), torch.tensor(mask), px, torch.tensor(sizes)) * torch.tensor(w)).sum().backward()
    model = _jax_model()
    loss = lambda p, x: jnp.sum(model.apply({"params": p}, ids, mask, x, sizes) * w)  # noqa: E731
    g_params, g_pixels = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, pixels)
    want = px.grad.numpy()
    assert np.abs(want).max() > 1e-3  # the pixels reach the logits
    assert np.abs(np.asarray(g_pixels) - want).max() <= JAX_TOL * np.abs(want).max()
    m, flat = src.model, {k: np.asarray(v) for k, v in traverse_util.flatten_dict(g_params, sep="/").items()}
    pairs = [("model/image_newline", m.image_newline.grad, False),
             ("model/multi_modal_projector/linear_1/kernel", m.multi_modal_projector.linear_1.weight.grad, True),
             ("model/vision_tower/encoder/layers_0/self_attn/q_proj/kernel",
              m.vision_tower.encoder.layers[0].self_attn.q_proj.weight.grad, True),
             ("model/vision_tower/embeddings/class_embedding", m.vision_tower.embeddings.class_embedding.grad, False),
             ("model/language_model/layers_1/self_attn/v_proj/kernel",
              m.language_model.layers[1].self_attn.v_proj.weight.grad, True)]
    for path, grad, transposed in pairs:
        want = grad.numpy().T if transposed else grad.numpy()
        assert np.abs(want).max() > 0, path
        assert np.abs(flat[path] - want).max() <= JAX_TOL * np.abs(want).max(), path
    assert m.vision_tower.encoder.layers[1].mlp.fc2.weight.grad is None
    assert np.abs(flat["model/vision_tower/encoder/layers_1/mlp/fc2/kernel"]).max() == 0


def test_pack_image_features_matches_transformers(models):
    """The anyres packing alone (regrid, unpad, newline, base first) on random projected features, both twins, for
    every pinpoint and unpadding direction; and the count the processor expands `<image>` into agrees."""
    hf, src, _ = models
    c = src.config
    newline = torch.tensor(np.random.default_rng(0).standard_normal(64).astype(np.float32))
    for size in [(48, 64), (100, 30), (60, 60), (16, 64), (64, 32), (33, 31), (7, 250)]:
        tiles = tq.image_num_tiles(size, c)
        features = torch.tensor(np.random.default_rng(1).standard_normal((tiles, 16, 64)).astype(np.float32))
        with torch.no_grad():
            want, _ = hf.model.pack_image_features([features], torch.tensor([size]), "default", newline)
        got = tq.pack_image_features(features, size, c, newline)
        np.testing.assert_array_equal(got.numpy(), want[0].numpy())
        np.testing.assert_array_equal(np.asarray(jq.pack_image_features(features.numpy(), size, c, newline.numpy())),
                                      want[0].numpy())
        assert tq.num_image_features(size, c) == jq.num_image_features(size, c) == want[0].shape[0]


def test_precomputed_image_features_match_the_pixels(models):
    """The trainers' path: encode_images (the frozen tower once, outside a jitted step) gives image_embeds f32[n,D];
    the forward on them is the forward on the pixels (torch: the same ops, bit for bit; JAX: jitted, the rows padded
    to a static count with rows never read)."""
    _, src, params = models
    ids, mask, pixels, sizes = BATCHES["two-images-right"]
    t_ids, t_mask = torch.tensor(ids), torch.tensor(mask)
    with torch.no_grad():
        want = src(t_ids, t_mask, torch.tensor(pixels), torch.tensor(sizes)).numpy()
        embeds = src.encode_images(torch.tensor(pixels), torch.tensor(sizes))
        got = src(t_ids, t_mask, image_embeds=embeds).numpy()
    assert embeds.shape == (int((ids == IMG).sum()), 64)
    np.testing.assert_array_equal(got, want)

    model = _jax_model()

    def encoded_then_forward(p, i, m, px):  # one compile: encode, pad with rows never read, forward
        encoded = model.apply({"params": p}, px, sizes, method="encode_images")
        padded = jnp.concatenate([encoded, jnp.full((9, encoded.shape[1]), 7.0)])
        return encoded, model.apply({"params": p}, i, m, image_embeds=padded)

    encoded, got_jax = jax.jit(encoded_then_forward)(params, ids, mask, pixels)
    assert np.abs(np.asarray(encoded) - embeds.numpy()).max() <= JAX_TOL
    assert np.abs(np.asarray(got_jax) - want).max() <= JAX_TOL


def test_image_count_mismatch_is_refused(models):
    _, src, params = models
    ids, mask, pixels, sizes = BATCHES["mixed-right"]
    ids = ids.copy()
    ids[0, 4] = 7  # one image token fewer than the image's rows
    with pytest.raises(Exception, match="image"):
        _torch_logits(src, ids, mask, pixels, sizes)
    with pytest.raises(Exception, match="image"):
        _jax_model().apply({"params": params}, ids, mask, pixels, sizes)


def test_conversion_both_ways():
    params = conv.load_params(CKPT)
    state = safetensors_io.load_state_dict(CKPT)
    stored = {k: tuple(v.shape) for k, v in state.items()}
    assert "language_model.lm_head.weight" in stored and "vision_tower.vision_model.post_layernorm.bias" in stored
    assert conv.hf_layout(params) == stored
    state.pop("vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias")
    with pytest.raises(ValueError, match="never written"):
        conv.convert_state_dict(state, conv.load_config(CKPT))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["original", "in-memory", "no-clip-prefix"])
def test_transformers_saved_layouts_load(models, tmp_path, layout):
    """What transformers 5's save_pretrained writes (the release's names, or with save_original_format=False the
    in-memory `model.*` ones; a model built from a config saves CLIP without its `vision_model.`): both sides load
    each to the same numbers."""
    from safetensors.numpy import save_file
    hf, src, params = models
    hf.save_pretrained(tmp_path, save_original_format=layout != "in-memory")
    if layout == "no-clip-prefix":
        state = {k.replace("vision_tower.vision_model.", "vision_tower."): np.array(v)
                 for k, v in safetensors_io.load_state_dict(tmp_path).items()}
        save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    names = set(safetensors_io.load_state_dict(tmp_path))
    assert ("model.vision_tower.embeddings.class_embedding" in names) == (layout == "in-memory")
    assert ("vision_tower.embeddings.class_embedding" in names) == (layout == "no-clip-prefix")
    loaded = tq.LlavaNextForConditionalGeneration.from_pretrained(tmp_path).state_dict()
    for k, v in src.state_dict().items():
        np.testing.assert_array_equal(loaded[k].numpy(), v.numpy())
    again = traverse_util.flatten_dict(conv.load_params(tmp_path), sep="/")
    for path, leaf in traverse_util.flatten_dict(params, sep="/").items():
        np.testing.assert_array_equal(np.asarray(again[path]), leaf)


def test_both_config_forms_read_the_same(tmp_path):
    """The release's form (the shipped file: sparse vicuna text_config, the 4.39 extras) and what transformers 5's
    save_pretrained writes (every key, text_config.rope_parameters)."""
    from transformers import LlavaNextConfig
    release = json.loads((CKPT / "config.json").read_text())
    LlavaNextConfig(**release).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved["text_config"] and "image_seq_length" in saved
    for side in (tq, jq):
        assert side.LlavaNextConfig.from_hf(saved) == side.LlavaNextConfig.from_hf(release)
    c = tq.LlavaNextConfig.from_hf(release)
    assert (c.text.num_key_value_heads, c.text.head_dim, c.text.rope.theta, c.text.rms_norm_eps) == (4, 16, 1e4, 1e-5)
    assert (c.image_token_id, c.vision_feature_layer, c.tie_word_embeddings) == (IMG, -2, False)
    assert c.image_grid_pinpoints == ((32, 64), (64, 32), (64, 64)) and c.vision.hidden_act == "quick_gelu"


# llava-hf/llava-v1.6-vicuna-7b-hf's config.json (transformers 4.39's writer): the vicuna text_config states only what
# differs from LlamaConfig's defaults, the vision_config only what differs from CLIPVisionConfig's
VICUNA_7B_RELEASE = {
    "architectures": ["LlavaNextForConditionalGeneration"], "ignore_index": -100,
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "image_token_index": 32000, "model_type": "llava_next", "projector_hidden_act": "gelu",
    "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                    "max_position_embeddings": 4096, "model_type": "llama", "pad_token_id": 0, "rms_norm_eps": 1e-05,
                    "torch_dtype": "float16", "vocab_size": 32064},
    "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.39.0.dev0",
    "use_image_newline_parameter": True,
    "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                      "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                      "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}


def test_the_release_config_reads_as_transformers_does():
    """The 7B release's sparse config: every absent key at transformers' default (Llama 7B's widths, MHA, theta 1e4;
    CLIP's quick_gelu and eps), as LlavaNextConfig(**release) resolves them."""
    from transformers import LlavaNextConfig
    hf = LlavaNextConfig(**VICUNA_7B_RELEASE)
    for side in (tq, jq):
        c = side.LlavaNextConfig.from_hf(VICUNA_7B_RELEASE)
        t, ht = c.text, hf.text_config
        assert (t.vocab_size, t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads,
                t.num_key_value_heads, t.head_dim, t.rms_norm_eps, t.rope.theta, t.max_position_embeddings) == \
            (ht.vocab_size, ht.hidden_size, ht.intermediate_size, ht.num_hidden_layers, ht.num_attention_heads,
             ht.num_key_value_heads, ht.head_dim, ht.rms_norm_eps, ht.rope_parameters["rope_theta"],
             ht.max_position_embeddings) == (32064, 4096, 11008, 32, 32, 32, 128, 1e-5, 1e4, 4096)
        v, hv = c.vision, hf.vision_config
        assert (v.hidden_size, v.num_hidden_layers, v.image_size, v.patch_size, v.hidden_act, v.layer_norm_eps) == \
            (hv.hidden_size, hv.num_hidden_layers, hv.image_size, hv.patch_size, hv.hidden_act, hv.layer_norm_eps)
        assert c.image_grid_pinpoints[0] == (336, 672) and c.image_token_id == 32000 and not c.tie_word_embeddings


def test_the_tie_is_the_top_level_key():
    """transformers ties on LlavaNextConfig.tie_word_embeddings (default False), whatever text_config says."""
    from transformers import LlavaNextConfig
    release = json.loads((CKPT / "config.json").read_text())
    for top, inner in ((True, False), (None, True), (False, True)):
        d = {k: v for k, v in release.items() if k != "tie_word_embeddings"}
        d["text_config"] = {**d["text_config"], "tie_word_embeddings": inner}
        if top is not None:
            d["tie_word_embeddings"] = top
        for side in (tq, jq):
            assert side.LlavaNextConfig.from_hf(d).tie_word_embeddings is bool(LlavaNextConfig(**d).tie_word_embeddings)


def _edit(**edit):
    return lambda d: {**d, **edit}


def _edit_text(**edit):
    return lambda d: {**d, "text_config": {**d["text_config"], **edit}}


def _edit_vision(**edit):
    return lambda d: {**d, "vision_config": {**d["vision_config"], **edit}}


@pytest.mark.parametrize("edit, match", [
    (_edit(vision_feature_select_strategy="full"), "vision_feature_select_strategy"),
    (_edit(use_image_newline_parameter=False), "use_image_newline_parameter"),
    (_edit(vision_feature_layer=[-2, -1]), "vision_feature_layer"),
    (_edit(vision_feature_layer=-4), "vision_feature_layer"),  # 3 hidden states in a 2-block tower
    (_edit(image_grid_pinpoints=[[32, 48]]), "image_grid_pinpoints"),
    (_edit(projector_hidden_act="swish_glu"), "projector_hidden_act"),
    (_edit_text(hidden_act="gelu"), "hidden_act"),
    (_edit_text(model_type="mistral"), "model_type"),
    (_edit_text(sliding_window=4096), "sliding_window"),  # not a Llama key
    (_edit_vision(model_type="siglip_vision_model"), "model_type"),
    (_edit_vision(vision_use_head=False), "vision_use_head"),  # not a CLIP key
    (_edit_vision(hidden_act="relu6"), "hidden_act"),
    (lambda d: {k: v for k, v in d.items() if k != "vision_config"}, "vision_config"),
    (_edit(not_a_key=1), "not_a_key"),
])
def test_refusals(edit, match):
    d = edit(json.loads((CKPT / "config.json").read_text()))
    for side in (tq, jq):
        with pytest.raises(ValueError, match=match):
            side.LlavaNextConfig.from_hf(d)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("module, audit, cls", [
    (tq, "CONFIG_KEYS", "LlavaNextConfig"), (tq, "TEXT_KEYS", "LlamaConfig"), (tclip, "CLIP_VISION_KEYS",
                                                                               "CLIPVisionConfig")])
def test_audits_cover_transformers(module, audit, cls):
    """Every key the transformers config class saves is honored, ignored with why, or refused; the twins list
    the same."""
    twin = {tq: jq, tclip: jclip}[module]
    t, j = getattr(module, audit), getattr(twin, audit)
    assert (t.family, set(t.honored), dict(t.ignored)) == (j.family, set(j.honored), dict(j.ignored))
    assert {k: (a, w) for k, (a, w) in t.refused.items()} == {k: (a, w) for k, (a, w) in j.refused.items()}
    assert set(getattr(transformers, cls)().to_dict()) - t.keys == set()
    assert all(why.strip() for why in t.ignored.values())


# ---- the image processor and the token count --------------------------------------------------

def _hf_image_processor(kwargs):
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LlavaNextImageProcessorPil(**kwargs)


def _bits(a):
    return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


@pytest.mark.parametrize("kwargs", [TINY_PROCESSOR, RELEASE_PROCESSOR],
                         ids=["tiny", "release"])
def test_processor_matches_transformers(kwargs):
    """Every image of assets/images, one by one and as one padded batch: pixel_values bit for bit, both twins."""
    from PIL import Image
    hf = _hf_image_processor(kwargs)
    config = TP.LlavaNextImageProcessorConfig.from_hf(kwargs)
    assert dataclasses.asdict(config) == dataclasses.asdict(JP.LlavaNextImageProcessorConfig.from_hf(kwargs))
    if kwargs is RELEASE_PROCESSOR:
        assert config == TP.LlavaNextImageProcessorConfig.release()
    batches = [[p] for p in IMAGES] + [IMAGES]
    for paths in batches:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = hf([Image.open(p) for p in paths], return_tensors="np")
        t_px, t_sizes = TP.process_images([TV.read_png(p) for p in paths], config)
        j_px, j_sizes = JP.process_images([JV.read_png(p) for p in paths], config)
        np.testing.assert_array_equal(_bits(t_px.numpy()), _bits(want["pixel_values"]), err_msg=str(paths))
        np.testing.assert_array_equal(_bits(j_px), _bits(want["pixel_values"]), err_msg=str(paths))
        np.testing.assert_array_equal(t_sizes.numpy(), want["image_sizes"])
        np.testing.assert_array_equal(j_sizes, want["image_sizes"])


@pytest.mark.parametrize("kwargs, patch_size", [(TINY_PROCESSOR, 8), (RELEASE_PROCESSOR, 14)],
                         ids=["tiny", "release"])
def test_token_count_matches_transformers(kwargs, patch_size):
    """num_image_tokens is LlavaNextProcessor's count for `<image>` (num_additional_image_tokens 1, "default"), as
    LF's plugin expands it; at the tiny sizes it is the rows the model packs; the placeholder expansion."""
    from transformers import AutoTokenizer, LlavaNextProcessor
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    assert tokenizer.convert_tokens_to_ids("<image>") == IMG
    processor = LlavaNextProcessor(image_processor=_hf_image_processor(kwargs), tokenizer=tokenizer,
                                   patch_size=patch_size, vision_feature_select_strategy="default",
                                   num_additional_image_tokens=1)
    config = TP.LlavaNextImageProcessorConfig.from_hf(kwargs)
    c = _config()
    for size in [(48, 64), (100, 40), (60, 60), (20, 60), (33, 31), (7, 250), (336, 336), (500, 375), (90, 150)]:
        want = processor._get_number_of_features(*size, *config.crop_size) - 1
        assert TP.num_image_tokens(size, config, patch_size) == JP.num_image_tokens(size, config, patch_size) == want
        if kwargs is TINY_PROCESSOR:
            assert want == tq.num_image_features(size, c)
    messages = [{"role": "user", "content": "<image>look<image>"}, {"role": "assistant", "content": "ok"}]
    sizes = np.array([[48, 64], [100, 40]])
    for side in (TP, JP):
        out = side.expand_image_placeholders(messages, sizes, config, patch_size)
        assert out[0]["content"] == ("<image>" * side.num_image_tokens((48, 64), config, patch_size) + "look"
                                     + "<image>" * side.num_image_tokens((100, 40), config, patch_size))
        with pytest.raises(ValueError, match="number of images"):
            side.expand_image_placeholders(messages, sizes[:1], config, patch_size)


@pytest.mark.slow
def test_processed_images_through_both_models(models):
    """End to end: two assets images through the tiny processor, their `<image>` runs as LF expands them, transformers
    and both twins on the result."""
    hf, src, params = models
    config = TP.LlavaNextImageProcessorConfig.from_hf(TINY_PROCESSOR)
    px, sizes = TP.process_images([TV.read_png(IMAGES[2]), TV.read_png(IMAGES[4])], config)
    counts = [TP.num_image_tokens(tuple(s), config, 8) for s in sizes.tolist()]
    rng = np.random.default_rng(9)
    ids = np.concatenate([[400], rng.integers(0, 400, 3), [IMG] * counts[0], rng.integers(0, 400, 4),
                          [IMG] * counts[1], rng.integers(0, 400, 5)])[None]
    mask = np.ones_like(ids)
    want = _hf_logits(hf, ids, mask, px.numpy(), sizes.numpy())
    got = _torch_logits(src, ids, mask, px.numpy(), sizes.numpy()).numpy()
    assert np.abs(got - want).max() <= TORCH_TOL * max(1.0, np.abs(want).max())
    got_jax = np.asarray(_jax_model().apply({"params": params}, ids, mask, px.numpy(), sizes.numpy()))
    assert np.abs(got_jax - got).max() <= JAX_TOL


def test_checkpoint_is_reproducible(tmp_path):
    code = ("import sys; sys.path.insert(0, 'tools'); from checkpoints_llava_next import make_llava_next; "
            f"make_llava_next({str(tmp_path)!r})")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (CKPT / name).read_bytes(), name
