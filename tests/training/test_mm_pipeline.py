"""The vision-language data path of the training pipeline (issue 32): LLaMA-Factory 0.9.5's Qwen-VL templates, its
mm plugin (placeholder expansion, image regularization, the collator's fake image), the processors on the `images`
column and the multimodal collators, torch source against its JAX twin on every row of the VL datasets, and both
against literals read off LF's source (data/mm_plugin.py, data/collator.py, data/template.py). The text path is
pinned to what it was before any of this (digests of every text family's features and collated batches).
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from jax_oracles.models import qwen2_vl as j_qwen2_vl, vision_processing as j_vision
from jax_oracles.training import collator as j_collator, mm_plugin as j_mm, processor as j_processor, template as j_template
from torch_sources.models import mrope as t_mrope, qwen2_vl as t_qwen2_vl, vision_processing as t_vision
from torch_sources.training import collator as t_collator, mm_plugin as t_mm, processor as t_processor, template as t_template

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "assets" / "tokenizer" / "qwen2_vl"
CHECKPOINT = ROOT / "assets" / "checkpoints" / "qwen2_vl"
MEDIA_DIR = ROOT / "assets" / "images"
CUTOFF = 128  # the VL rows' cutoff (tools/make_vl_datasets.py)
PAD, IM_END, VISION_START, VISION_END, IMAGE_PAD = 400, 402, 409, 410, 412  # assets/tokenizer/qwen2_vl
SIDES = ("torch", "jax")
MODULES = {"torch": (t_template, t_processor, t_collator, t_mm, t_qwen2_vl),
           "jax": (j_template, j_processor, j_collator, j_mm, j_qwen2_vl)}
NO_IMAGE_SUPPORT = "This model does not support image input. Please check whether the correct `template` is used."


def _rows(name: str) -> list[dict]:
    return [r for split in ("train", "eval")
            for r in json.loads((ROOT / "assets" / "data" / name / f"{split}.json").read_text())]


@pytest.fixture(scope="module")
def vl():
    """Per side: (template, fixed tokenizer, processor, collator, mm_plugin module, the model's rope_index)."""
    out = {}
    for side, (template_mod, processor, collator, mm, model_mod) in MODULES.items():
        template = template_mod.get_template("qwen2_vl")
        model = model_mod.Qwen2VLForConditionalGeneration(model_mod.Qwen2VLConfig.from_pretrained(CHECKPOINT))
        out[side] = (template, template.fix_special_tokens(template_mod.load_tokenizer(TOKENIZER)), processor,
                     collator, mm, model.rope_index)
    return out


def _context(vl, side, rope=True):
    template, tokenizer, _, collator, _, rope_index = vl[side]
    return collator.MultimodalContext(template.mm_plugin, tokenizer, MEDIA_DIR, rope_index if rope else None)


def _features(vl, side, kind, rows, cutoff=CUTOFF):
    template, tokenizer, processor, *_ = vl[side]
    fn = {"supervised": processor.preprocess_supervised_dataset, "pairwise": processor.preprocess_pairwise_dataset,
          "unsupervised": processor.preprocess_unsupervised_dataset}[kind]
    return fn(rows, tokenizer, template, cutoff, media_dir=MEDIA_DIR)


def _np(batch) -> dict[str, np.ndarray]:
    return {k: v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in batch.items()}


# ---- templates -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("side", SIDES)
def test_vl_templates_are_lfs(side):
    """LF 0.9.5 template.py: qwen2_vl / qwen3_vl / qwen2_omni are the ChatML slots with <|im_end|> as eos; qwen2_vl and
    qwen2_omni carry "You are a helpful assistant.", qwen3_vl is a ReasoningTemplate; the plugins' tokens."""
    template_mod, _, _, _, _ = MODULES[side]
    vision = t_vision if side == "torch" else j_vision
    chatml = ("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",)
    expected = {"qwen2_vl": ("You are a helpful assistant.", "Template", vision.QwenImageProcessorConfig.qwen2_vl()),
                "qwen3_vl": ("", "ReasoningTemplate", vision.QwenImageProcessorConfig.qwen3_vl()),
                "qwen2_omni": ("You are a helpful assistant.", "Template", vision.QwenImageProcessorConfig.qwen2_vl())}
    for name, (system, cls, processor_config) in expected.items():
        t = template_mod.get_template(name)
        assert (t.format_user, t.format_assistant, t.format_system) == (
            chatml, ("{{content}}<|im_end|>\n",), ("<|im_start|>system\n{{content}}<|im_end|>\n",))
        assert (t.default_system, type(t).__name__, t.stop_words, t.replace_eos) == (system, cls, ("<|im_end|>",), True)
        p = t.mm_plugin
        assert (p.name, p.image_processor, p.image_max_pixels, p.image_min_pixels) == (
            name, processor_config, 768 * 768, 32 * 32)
        tokens = {k: getattr(p, k) for k in ("image_token", "vision_bos_token", "vision_eos_token")}
        assert tokens == vision.LF_TEMPLATE_TOKENS[name]
    omni, qwen2_vl = template_mod.get_template("qwen2_omni").mm_plugin, template_mod.get_template("qwen2_vl").mm_plugin
    assert (omni.video_token, omni.audio_token) == ("<|VIDEO|>", "<|AUDIO|>")
    assert (qwen2_vl.video_token, qwen2_vl.audio_token) == ("<|video_pad|>", None)
    assert all(template_mod.get_template(n).mm_plugin is None
               for n in ("default", "falcon", "llama3", "mistral", "phi4", "qwen", "qwen3"))


def test_templates_are_twins():
    for name in t_template.TEMPLATES:
        t, j = t_template.get_template(name), j_template.get_template(name)
        assert dataclasses.asdict(t) == dataclasses.asdict(j), name
    assert list(t_template.TEMPLATES) == list(j_template.TEMPLATES)


# ---- the plugin ----------------------------------------------------------------------------------------------------

def test_find_medias_is_lfs_converter_rule(tmp_path):
    """_find_medias: media_dir/path when that file exists, else the path as written."""
    (tmp_path / "a.png").write_bytes(b"")
    for mm in (t_mm, j_mm):
        assert mm.find_medias(["a.png", "b.png"], tmp_path) == [str(tmp_path / "a.png"), "b.png"]
        assert mm.find_medias(["a.png"], None) == ["a.png"]


# image tokens per shipped image under Qwen2-VL's processor, by hand from LF's and HF's rules: 64x48 -> smart_resize
# 56x56 (grid 4x4, 16 // 2**2 = 4); 20x60 -> LF's min side 28 -> 28x60 -> 56x84 (4x6: 6); 250x2 -> LF's min_pixels
# 357x2, min side 28 -> 357x28 -> 364x28 (26x2: 13); 150x90 -> 140x84 (10x6: 15)
IMAGE_TOKENS = {"gradient_64x48.png": 4, "gray_20x60.png": 6, "strip_250x2.png": 13, "wide_150x90.png": 15,
                "alpha_56x56.png": 4, "exact_112x84.png": 12, "portrait_40x100.png": 4}


def test_placeholder_expansion_is_lfs():
    plugin = t_template.get_template("qwen2_vl").mm_plugin
    for name, n in IMAGE_TOKENS.items():
        for mm, p in ((t_mm, plugin), (j_mm, j_template.get_template("qwen2_vl").mm_plugin)):
            images = mm.regularize_images([name], MEDIA_DIR, p)
            messages = mm.process_messages([{"role": "user", "content": "<image>Hi"}], images, p)
            assert messages[0]["content"] == "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>Hi", name
    # Qwen3-VL's processor (patch 16, min_pixels 256**2): 64x48 -> 320x224 (20x14 patches: 70 tokens)
    images = t_mm.regularize_images(["gradient_64x48.png"], MEDIA_DIR, t_template.get_template("qwen3_vl").mm_plugin)
    content = t_mm.process_messages([{"role": "user", "content": "<image>"}], images,
                                    t_template.get_template("qwen3_vl").mm_plugin)[0]["content"]
    assert content.count("<|image_pad|>") == 70
    # Qwen2.5-Omni's template spells its tokens its own way
    omni = j_template.get_template("qwen2_omni").mm_plugin
    images = j_mm.regularize_images(["gradient_64x48.png"], MEDIA_DIR, omni)
    assert j_mm.process_messages([{"role": "user", "content": "<image>"}], images, omni)[0]["content"] == \
        "<|vision_bos|>" + "<|IMAGE|>" * 4 + "<|vision_eos|>"


@pytest.mark.parametrize("names", [["gradient_64x48.png"], ["wide_150x90.png", "gray_20x60.png", "alpha_56x56.png"]])
def test_mm_inputs_are_bit_equal(names):
    t_plugin, j_plugin = t_template.get_template("qwen2_vl").mm_plugin, j_template.get_template("qwen2_vl").mm_plugin
    tp, tg = t_mm.get_mm_inputs(t_mm.regularize_images(names, MEDIA_DIR, t_plugin), t_plugin)
    jp, jg = j_mm.get_mm_inputs(j_mm.regularize_images(names, MEDIA_DIR, j_plugin), j_plugin)
    assert (tp.dtype, tg.dtype, jp.dtype, jg.dtype) == (torch.float32, torch.int64, np.float32, np.int64)
    assert tp.shape == (int(tg.prod(-1).sum()), 3 * 2 * 14 * 14)
    np.testing.assert_array_equal(tp.numpy(), jp)
    np.testing.assert_array_equal(tg.numpy(), jg)
    assert tg[:, 1:].prod(-1).div(4).tolist() == [IMAGE_TOKENS[n] for n in names]


def test_plugin_errors_are_lfs():
    plugin = t_template.get_template("qwen2_vl").mm_plugin
    one = t_mm.regularize_images(["gradient_64x48.png"], MEDIA_DIR, plugin)
    with pytest.raises(ValueError, match="The number of images does not match the number of <image> tokens"):
        t_mm.process_messages([{"role": "user", "content": "<image><image>Hi"}], one, plugin)
    with pytest.raises(ValueError, match="The number of images does not match the number of <image> tokens"):
        j_mm.process_messages([{"role": "user", "content": "Hi"}], [np.zeros((28, 28, 3), np.uint8)],
                              j_template.get_template("qwen2_vl").mm_plugin)
    for mm in (t_mm, j_mm):
        with pytest.raises(ValueError) as error:
            mm.process_messages([{"role": "user", "content": "<image>"}], ["x.png"], None)
        assert str(error.value) == NO_IMAGE_SUPPORT
        # LF's base plugin leaves text alone, placeholders included
        assert mm.process_messages([{"role": "user", "content": "<image>"}], [], None)[0]["content"] == "<image>"


# ---- processors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, data", [("supervised", "sft_vl"), ("unsupervised", "sft_vl"), ("pairwise", "dpo_vl")])
def test_features_twins_on_every_vl_row(vl, kind, data):
    rows = _rows(data)
    t_feats, j_feats = _features(vl, "torch", kind, rows), _features(vl, "jax", kind, rows)
    assert t_feats == j_feats
    assert len(t_feats) == len(rows)
    for row, f in zip(rows, t_feats):
        assert f["images"] == row.get("images", [])  # the paths as the row gives them
        ids = [f[k] for k in (("chosen_input_ids", "rejected_input_ids") if kind == "pairwise" else ("input_ids",))]
        for x in ids:  # every image's run whole, in its vision_start / vision_end (no row is cut inside one)
            runs = "".join("I" if t == IMAGE_PAD else "s" if t == VISION_START else "e" if t == VISION_END else "."
                           for t in x)
            assert runs.replace(".", "") == "".join("s" + "I" * IMAGE_TOKENS[n] + "e" for n in f["images"])


def test_supervised_row_literal(vl):
    """One row, token by token: LF's ChatML around the expanded placeholder; labels over the response only."""
    template, tokenizer, *_ = vl["torch"]
    row = {"instruction": "<image>Hi", "input": "", "output": "red", "images": ["gradient_64x48.png"]}
    (f,) = _features(vl, "torch", "supervised", [row])
    system = tokenizer.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    prompt = (system + tokenizer.encode("<|im_start|>user\n") + [VISION_START] + [IMAGE_PAD] * 4 + [VISION_END]
              + tokenizer.encode("Hi") + tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n"))
    response = tokenizer.encode("red") + [IM_END] + tokenizer.encode("\n")
    assert f["input_ids"] == prompt + response
    assert f["labels"] == [-100] * len(prompt) + response
    assert (f["images"], f["attention_mask"]) == (["gradient_64x48.png"], [1] * len(prompt + response))
    assert _features(vl, "jax", "supervised", [row]) == [f]


def test_truncated_row_keeps_its_image_and_cuts_its_response(vl):
    """The describe rows: infer_seqlen(S, T, 128) with 2S < 128 <= 2T keeps the whole source (image tokens counted
    in it, as LF expands before encoding) and 128 - S of the response, which loses its <|im_end|>."""
    rows = [r for r in _rows("sft_vl") if r["instruction"].endswith("Describe the four corners.")]
    assert len(rows) == 2
    for kind in ("supervised", "unsupervised"):
        for side in SIDES:
            full = _features(vl, side, kind, rows, cutoff=10**6)
            cut = _features(vl, side, kind, rows)
            for a, b in zip(full, cut):
                if kind == "supervised":
                    source = sum(1 for x in a["labels"] if x == -100)
                    assert 2 * source < CUTOFF <= 2 * (len(a["input_ids"]) - source)
                    assert b["input_ids"] == a["input_ids"][:CUTOFF]
                    assert b["labels"] == [-100] * source + a["input_ids"][source:CUTOFF]
                    assert b["labels"][-1] != IM_END and b["input_ids"].count(IMAGE_PAD) == 4
                else:  # the prompt whole, the label (response) cut
                    assert b["input_ids"] == a["input_ids"]
                    assert b["labels"] == a["labels"][:CUTOFF - len(a["input_ids"])]
    other = [r for r in _rows("sft_vl") if r not in rows]  # nothing else is cut
    assert _features(vl, "torch", "supervised", other) == _features(vl, "torch", "supervised", other, cutoff=10**6)


def test_processor_errors_are_lfs(vl):
    row = {"instruction": "<image>Hi", "input": "", "output": "red", "images": ["gradient_64x48.png"]}
    for template_mod, processor in ((t_template, t_processor), (j_template, j_processor)):
        text = template_mod.get_template("qwen")
        tok = text.fix_special_tokens(template_mod.load_tokenizer(TOKENIZER))
        with pytest.raises(ValueError, match="does not support image input"):
            processor.preprocess_supervised_dataset([row], tok, text, 64, media_dir=MEDIA_DIR)
        # an empty images list is no image (LF's converter makes it None)
        assert "images" not in processor.preprocess_supervised_dataset([{**row, "images": []}], tok, text, 64)[0]
    for side in SIDES:
        with pytest.raises(ValueError, match="The number of images does not match"):
            _features(vl, side, "pairwise", [{**row, "chosen": "a", "rejected": "b", "images": []}])
        with pytest.raises(ValueError, match="The number of images does not match"):
            _features(vl, side, "unsupervised", [{**row, "instruction": "Hi"}])


# ---- collators -----------------------------------------------------------------------------------------------------

def _collate(vl, side, kind, feats, **kw):
    collator = vl[side][3]
    pad = vl[side][1].pad_token_id
    cls = {"supervised": collator.SFTDataCollator, "pairwise": collator.PairwiseDataCollator,
           "unsupervised": collator.PromptDataCollator}[kind]
    return _np(cls(pad, mm=_context(vl, side), **kw)(feats))


@pytest.mark.parametrize("kind, data", [("supervised", "sft_vl"), ("unsupervised", "sft_vl"), ("pairwise", "dpo_vl")])
def test_collated_batches_twins_on_the_vl_data(vl, kind, data):
    feats = _features(vl, "torch", kind, _rows(data))
    size = 4
    for s in range(0, len(feats), size):
        tb, jb = _collate(vl, "torch", kind, feats[s:s + size]), _collate(vl, "jax", kind, feats[s:s + size])
        assert tb.keys() == jb.keys() == {*(("input_ids", "attention_mask") + (() if kind == "unsupervised"
                                                                                  else ("labels",))),
                                          "pixel_values", "image_grid_thw", "position_ids", "rope_deltas"}
        for k in tb:
            np.testing.assert_array_equal(tb[k], jb[k], err_msg=k)
        assert tb["pixel_values"].dtype == np.float32 and tb["position_ids"].shape == (3, *tb["input_ids"].shape)
        # the grids are the rows' images in row order (pairwise: the chosen rows', then the rejected rows')
        names = [n for f in feats[s:s + size] for n in f["images"]] * (2 if kind == "pairwise" else 1)
        if names:
            assert (tb["image_grid_thw"][:, 1:].prod(-1) // 4).tolist() == [IMAGE_TOKENS[n] for n in names]
            assert (tb["input_ids"] == IMAGE_PAD).sum() == sum(IMAGE_TOKENS[n] for n in names)


def test_position_ids_literal(vl):
    """One 4-token image (grid 1x4x4 -> 2x2 merged): its tokens sit at t = s, h = s + (0 0 1 1), w = s + (0 1 0 1)
    after the vision_start at s - 1; the text after it resumes at s + 2, so rope_deltas = -2; pads sit at 0."""
    row = {"instruction": "<image>Hi", "input": "", "output": "red", "images": ["gradient_64x48.png"]}
    feats = _features(vl, "torch", "supervised", [row])
    for side in SIDES:
        b = _collate(vl, side, "supervised", feats)
        n = len(feats[0]["input_ids"])
        s = feats[0]["input_ids"].index(IMAGE_PAD)
        expected = np.tile(np.arange(b["input_ids"].shape[1]), (3, 1))
        expected[:, s:] -= 2
        expected[:, s:s + 4] = [[s] * 4, [s, s, s + 1, s + 1], [s, s + 1, s, s + 1]]
        expected[:, n:] = 0
        np.testing.assert_array_equal(b["position_ids"][:, 0], expected)
        assert b["rope_deltas"].tolist() == [[-2]]


def _white_pixels(plugin) -> np.ndarray:  # the fake image's rows: (1 - mean) / std per channel, in float32
    c = plugin.image_processor
    value = (np.float32(1.0) - np.float32(c.image_mean)) / np.float32(c.image_std)
    return np.repeat(value, c.temporal_patch_size * c.patch_size**2)[None].repeat(16, 0)


@pytest.mark.parametrize("side", SIDES)
def test_fake_image_on_a_batch_without_images(vl, side):
    """LF's collator: no image in the batch -> a 64x64 white image (56x56 to the processor: 4 tokens), its
    tokens after row 0's (right padding) with attention mask 0 and labels IGNORE_INDEX; the rope index never
    reaches it (masked), so every row's positions are its text positions."""
    template = vl[side][0]
    rows = [r for r in _rows("sft_vl") if "images" not in r][:3]
    feats = _features(vl, side, "supervised", rows)
    fake = [VISION_START] + [IMAGE_PAD] * 4 + [VISION_END]
    b = _collate(vl, side, "supervised", feats)
    n0 = len(feats[0]["input_ids"])
    assert b["input_ids"][0, :n0 + 6].tolist() == feats[0]["input_ids"] + fake
    assert b["attention_mask"][0, :n0 + 6].tolist() == [1] * n0 + [0] * 6
    assert b["labels"][0, :n0 + 6].tolist() == feats[0]["labels"] + [-100] * 6
    assert b["input_ids"].shape[1] == -(-max(n0 + 6, *(len(f["input_ids"]) for f in feats)) // 8) * 8
    for i, f in enumerate(feats[1:], 1):  # the other rows are untouched
        assert b["input_ids"][i, :len(f["input_ids"])].tolist() == f["input_ids"]
        assert (b["input_ids"][i, len(f["input_ids"]):] == PAD).all()
    assert b["image_grid_thw"].tolist() == [[1, 4, 4]]
    np.testing.assert_array_equal(b["pixel_values"], _white_pixels(template.mm_plugin))
    text = np.where(b["attention_mask"] == 1, np.cumsum(b["attention_mask"], -1) - 1, 0)
    np.testing.assert_array_equal(b["position_ids"], np.broadcast_to(text, (3, *text.shape)))
    assert b["rope_deltas"].tolist() == [[0]] * 3
    assert feats == _features(vl, side, "supervised", rows)  # the features were not changed in place

    # PPO's prompt batches are left-padded (LF's workflow sets padding_side "left"): the fake tokens go first
    prompts = _features(vl, side, "unsupervised", rows)
    p = _collate(vl, side, "unsupervised", prompts)
    k = len(prompts[0]["input_ids"])
    assert p["input_ids"][0, -k - 6:].tolist() == fake + prompts[0]["input_ids"]
    assert p["attention_mask"][0, -k - 6:].tolist() == [0] * 6 + [1] * k
    assert p["image_grid_thw"].tolist() == [[1, 4, 4]]

    # a pairwise batch: on the first chosen row only
    pairs = _features(vl, side, "pairwise", [r for r in _rows("dpo_vl") if "images" not in r][:2])
    d = _collate(vl, side, "pairwise", pairs)
    assert d["input_ids"][0, len(pairs[0]["chosen_input_ids"]):][:6].tolist() == fake
    assert (d["input_ids"][1:] == IMAGE_PAD).sum() == 0


def test_fake_image_tokens_follow_the_plugin():
    """Qwen3-VL's processor takes the 64x64 white image up to 256x256 (min_pixels 256**2): 16x16 patches, 64 tokens."""
    for template_mod, mm in ((t_template, t_mm), (j_template, j_mm)):
        template = template_mod.get_template("qwen3_vl")
        tok = template.fix_special_tokens(template_mod.load_tokenizer(TOKENIZER))
        assert mm.fake_image_input_ids(tok, template.mm_plugin) == [VISION_START] + [IMAGE_PAD] * 64 + [VISION_END]


def test_collator_edges(vl):
    feats = _features(vl, "torch", "supervised", _rows("sft_vl")[:4])
    # no rope_index: pixel values and grids only (LF without a get_rope_index, e.g. a value-head wrapper)
    for side in SIDES:
        collator = vl[side][3]
        b = _np(collator.SFTDataCollator(PAD, mm=_context(vl, side, rope=False))(feats))
        assert set(b) == {"input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw"}
    # the JAX twin's static width: the same batch, wider; positions of the real tokens unchanged, pads at 0
    tb = _collate(vl, "torch", "supervised", feats)
    jb = _collate(vl, "jax", "supervised", feats, pad_to_length=160)
    T = tb["input_ids"].shape[1]
    for k in ("input_ids", "attention_mask", "labels"):
        np.testing.assert_array_equal(jb[k][:, :T], tb[k])
    np.testing.assert_array_equal(jb["position_ids"][..., :T], tb["position_ids"])
    assert (jb["position_ids"][..., T:] == 0).all()
    for k in ("pixel_values", "image_grid_thw", "rope_deltas"):
        np.testing.assert_array_equal(jb[k], tb[k])
    # an image whose tokens cutoff_len cut: M-RoPE refuses the batch (LF would fail in the model's merge)
    describe = [r for r in _rows("sft_vl") if r["instruction"].endswith("corners.")][:1]
    cut = _features(vl, "torch", "supervised", describe, cutoff=30)
    with pytest.raises(t_mrope.MropeError):
        _collate(vl, "torch", "supervised", cut)
    # audio in the data is not read (LF decodes files with torchaudio): only LF's fake audio reaches a collator
    with pytest.raises(NotImplementedError, match="fake audio"):
        _collate(vl, "torch", "supervised", [{**feats[0], "audios": ["a.wav"]}])


# ---- the text path is what it was --------------------------------------------------------------------------------

TEXT_FAMILIES = {"bloom": "default", "falcon": "falcon", "llama3": "llama3", "mistral": "mistral", "phi4": "phi4",
                 "qwen2": "qwen", "qwen3": "qwen3", "starcoder2": "default"}
# sha256[:16] of every text family's features (supervised, mask_history, unsupervised, pairwise at cutoff 64 on
# assets/data/sft and dpo) and their collated batches (no context, batches of 4), as the processors and collators
# of commit 2c319f3 (before the VL data path) gave them; regenerate only if the text data or tokenizers change
TEXT_DIGESTS = {"bloom": "22e18f35830a4502", "falcon": "940ba588e1ca237a", "llama3": "0657626e3bf4b486",
                "mistral": "5a0aacabf75879b7", "phi4": "d950426613fbabaf", "qwen2": "89db36530fb7c550",
                "qwen3": "d1de91ad389c820e", "starcoder2": "f57755f07d19ce2d"}


def _text_digest(template_mod, processor, collator, family: str) -> str:
    template = template_mod.get_template(TEXT_FAMILIES[family])
    tokenizer = template.fix_special_tokens(template_mod.load_tokenizer(ROOT / "assets" / "tokenizer" / family))
    sft, dpo = _rows("sft"), _rows("dpo")
    out = {"supervised": processor.preprocess_supervised_dataset(sft, tokenizer, template, 64),
           "mask_history": processor.preprocess_supervised_dataset(sft, tokenizer, template, 64, mask_history=True),
           "unsupervised": processor.preprocess_unsupervised_dataset(sft, tokenizer, template, 64),
           "pairwise": processor.preprocess_pairwise_dataset(dpo, tokenizer, template, 64)}
    collators = {"supervised": collator.SFTDataCollator(tokenizer.pad_token_id),
                 "pairwise": collator.PairwiseDataCollator(tokenizer.pad_token_id),
                 "unsupervised": collator.PromptDataCollator(tokenizer.pad_token_id)}
    for kind, collate in collators.items():
        feats = out[kind]
        out[f"collated_{kind}"] = [{k: np.asarray(v).tolist() for k, v in collate(feats[s:s + 4]).items()}
                                   for s in range(0, len(feats), 4)]
    return hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()[:16]


@pytest.mark.parametrize("side", SIDES)
def test_text_features_and_batches_are_unchanged(side):
    template_mod, processor, collator, _, _ = MODULES[side]
    assert {f: _text_digest(template_mod, processor, collator, f) for f in TEXT_FAMILIES} == TEXT_DIGESTS


# ---- the datasets --------------------------------------------------------------------------------------------------

def test_vl_datasets_are_reproducible_and_well_formed():
    spec = importlib.util.spec_from_file_location("make_vl_datasets", ROOT / "tools" / "make_vl_datasets.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    for (train, held_out), name in ((tool.make_sft_vl(), "sft_vl"), (tool.make_dpo_vl(), "dpo_vl")):
        for rows, split in ((train, "train"), (held_out, "eval")):
            path = ROOT / "assets" / "data" / name / f"{split}.json"
            assert path.read_text() == json.dumps(rows, indent=2, ensure_ascii=False) + "\n"
        kinds = [len(r.get("images", [])) for r in train + held_out]
        assert {0, 1, 2} <= set(kinds)  # rows without an image, with one and with two
        for r in train + held_out:
            assert r["instruction"].count("<image>") == len(r.get("images", []))
            assert all((MEDIA_DIR / n).is_file() for n in r.get("images", []))
    # the corner answers read off the pixels the model is shown (LF's regularization, then the corner block)
    assert [tool.corner_color("gray_20x60.png", c) for c in tool.CORNERS] == ["white", "black", "black", "white"]
    assert [tool.corner_color("portrait_40x100.png", c) for c in tool.CORNERS] == ["red", "green", "green", "black"]
