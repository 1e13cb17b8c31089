"""The fixed-size towers' data path (issue 34): LLaMA-Factory's gemma3, paligemma, llava_next and intern_vl templates
with their plugins (Gemma3Plugin, PaliGemmaPlugin, LlavaNextPlugin, InternVLPlugin) bound to the processor files
beside the tokenizer. Torch source against its JAX twin on every row of the VL data (processed rows, collated
batches with and without images), both against LF's expansions read off data/mm_plugin.py, and one forward per
family that takes a collated batch's model inputs (token_type_ids, image_sizes) into both models.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
from functools import lru_cache
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
import yaml

jax.config.update("jax_default_matmul_precision", "highest")

from jax_oracles.models import internvl_processing as j_internvl  # noqa: E402
from jax_oracles.models import llava_next_processing as j_llava_next  # noqa: E402
from jax_oracles.training import collator as j_collator, mm_plugin as j_mm, processor as j_processor  # noqa: E402
from jax_oracles.training import sft as j_sft, template as j_template  # noqa: E402
from torch_sources.models import auto  # noqa: E402
from torch_sources.models import internvl_processing as t_internvl  # noqa: E402
from torch_sources.models import llava_next_processing as t_llava_next  # noqa: E402
from torch_sources.training import collator as t_collator, mm_plugin as t_mm, processor as t_processor  # noqa: E402
from torch_sources.training import sft as t_sft, template as t_template  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = {"gemma3": "gemma3", "paligemma": "paligemma", "llava_next": "llava_next", "internvl": "intern_vl"}
FAMILIES = sorted(TEMPLATES)
CUTOFF = 320  # intern_vl's default system prompt is long: at 320 no row of the VL data is cut
SIDES = ("torch", "jax")
MODULES = {"torch": (t_template, t_processor, t_collator, t_mm, t_sft),
           "jax": (j_template, j_processor, j_collator, j_mm, j_sft)}
KINDS = {"supervised": "sft_vl", "pairwise": "dpo_vl", "unsupervised": "ppo_vl"}  # configs/data/<name>.yaml
# the token each image is spelled with in the ids (InternVL's `<img>` and `</img>` frame it)
IMAGE_TOKEN = {"gemma3": "<image_soft_token>", "paligemma": "<image>", "llava_next": "<image>",
               "internvl": "<IMG_CONTEXT>"}
EXTRAS = {"gemma3": {"token_type_ids"}, "paligemma": {"token_type_ids"}, "llava_next": {"image_sizes"},
          "internvl": set()}


def _data_dir(kind: str) -> Path:
    return ROOT / yaml.safe_load((ROOT / "configs/data" / f"{KINDS[kind]}.yaml").read_text())["dir"]


def _rows(kind: str) -> list[dict]:
    return [r for split in ("train", "eval") for r in json.loads((_data_dir(kind) / f"{split}.json").read_text())]


@lru_cache(maxsize=None)
def _bound(family: str, side: str):
    """(bound template, fixed tokenizer) of a side."""
    template_mod = MODULES[side][0]
    template = template_mod.get_template(TEMPLATES[family]).bind(ROOT / "assets/tokenizer" / family)
    return template, template.fix_special_tokens(template_mod.load_tokenizer(ROOT / "assets/tokenizer" / family))


def _features(family: str, side: str, kind: str, rows=None) -> list[dict]:
    template, tokenizer = _bound(family, side)
    processor = MODULES[side][1]
    fn = {"supervised": processor.preprocess_supervised_dataset, "pairwise": processor.preprocess_pairwise_dataset,
          "unsupervised": processor.preprocess_unsupervised_dataset}[kind]
    return fn(_rows(kind) if rows is None else rows, tokenizer, template, CUTOFF, media_dir=_data_dir(kind))


def _collate(family: str, side: str, kind: str, feats: list[dict]) -> dict[str, np.ndarray]:
    template, tokenizer = _bound(family, side)
    collator = MODULES[side][2]
    mm = collator.MultimodalContext(template.mm_plugin, tokenizer, _data_dir(kind))
    if kind == "unsupervised":
        batch = collator.PromptDataCollator(tokenizer.pad_token_id, mm=mm)(feats)
    else:
        cls = collator.SFTDataCollator if kind == "supervised" else collator.PairwiseDataCollator
        batch = cls(tokenizer.pad_token_id, mm=mm)(feats)
    return {k: v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in batch.items()}


def _expansion(family: str, side: str, image: np.ndarray) -> tuple[str, int]:
    """(what LF puts for one regularized `<image>` in the text, the image tokens LF puts before the ids)."""
    plugin = _bound(family, side)[0].mm_plugin
    if family == "gemma3":
        return f"\n\n<start_of_image>{'<image_soft_token>' * 16}<end_of_image>\n\n", 0
    if family == "paligemma":
        return "", 16
    if family == "llava_next":
        llava_next = t_llava_next if side == "torch" else j_llava_next
        return "<image>" * llava_next.num_image_tokens(image.shape[:2], plugin.image_processor, 8), 0
    internvl = t_internvl if side == "torch" else j_internvl
    tiles = int(internvl.process_images([image], plugin.image_processor)[1][0])
    return f"<img>{'<IMG_CONTEXT>' * 4 * tiles}</img>", 0


def _image_token_count(family: str, side: str, paths: list[str], media_dir) -> int:
    mm, plugin = MODULES[side][3], _bound(family, side)[0].mm_plugin
    total = 0
    for image in mm.regularize_images(paths, media_dir, plugin):
        text, prefix = _expansion(family, side, image)
        total += prefix + text.count(IMAGE_TOKEN[family])
    return total


# ---- templates and processed rows ----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_bound_templates_are_twins(family):
    t, j = (_bound(family, side)[0] for side in SIDES)
    assert dataclasses.asdict(t) == dataclasses.asdict(j)
    assert t.mm_plugin.image_processor is not None and type(t.mm_plugin).__name__ == type(j.mm_plugin).__name__


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_processed_rows_are_twins(family, kind):
    want = _features(family, "torch", kind)
    assert want == _features(family, "jax", kind)
    key = "chosen_input_ids" if kind == "pairwise" else "input_ids"
    assert max(len(f[key]) for f in want) < CUTOFF  # nothing cut: every image keeps its tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_image_tokens_are_lfs(family):
    """Each row holds LF's image tokens for its images: Gemma 3's 16 soft tokens framed by `\\n\\n<start_of_image>`
    and `<end_of_image>\\n\\n`; PaliGemma's 16 per image before bos (labels IGNORE_INDEX); InternVL's `<img>` +
    `<IMG_CONTEXT>` * 4 * tiles + `</img>`; LLaVA-NeXT's llava_next_processing.num_image_tokens."""
    media = _data_dir("supervised")
    for side in SIDES:
        template, tokenizer = _bound(family, side)
        image_id, bos = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[family]), tokenizer.bos_token_id
        mm = MODULES[side][3]
        images = mm.regularize_images(["wide_150x90.png"], media, template.mm_plugin)
        text, _ = _expansion(family, side, images[0])
        got = mm.process_messages([{"role": "user", "content": "a<image>b"}], images, template.mm_plugin)
        assert got == [{"role": "user", "content": f"a{text}b"}]
        for kind in KINDS:
            for f in _features(family, side, kind):
                paths = f.get("images") or []
                n = _image_token_count(family, side, paths, media)
                for key in ("chosen_", "rejected_") if kind == "pairwise" else ("",):
                    ids = np.asarray(f[f"{key}input_ids"])
                    assert (ids == image_id).sum() == n
                    if family == "paligemma":  # the image tokens, then bos
                        assert ids[:n].tolist() == [image_id] * n and ids[n] == bos
                        if kind != "unsupervised":
                            assert f[f"{key}labels"][:n + 1] == [-100] * (n + 1)


# ---- collated batches ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("family", FAMILIES)
def test_collated_batches_are_twins(family, kind):
    """Every batch of 4 over the data (the batches without any image too), and LF's token_type_ids: Gemma 3's mark
    the image tokens, PaliGemma's are 0 over each row's first 16 * images positions and 1 after (pads 0)."""
    feats = _features(family, "torch", kind)
    text_rows = [f for f in feats if not f.get("images")][:3]
    image_id = _bound(family, "torch")[1].convert_tokens_to_ids(IMAGE_TOKEN[family])
    for batch_rows in [feats[s:s + 4] for s in range(0, len(feats), 4)] + [text_rows]:
        tb, jb = (_collate(family, side, kind, batch_rows) for side in SIDES)
        expected = {"input_ids", "attention_mask", "pixel_values"} | EXTRAS[family]
        assert tb.keys() == jb.keys() == expected | (set() if kind == "unsupervised" else {"labels"})
        for k in tb:
            if k == "pixel_values":
                assert tb[k].dtype == jb[k].dtype == np.float32
                np.testing.assert_allclose(jb[k], tb[k], rtol=0, atol=1e-6)
            else:
                np.testing.assert_array_equal(jb[k], tb[k], err_msg=k)
        if family == "gemma3":
            np.testing.assert_array_equal(tb["token_type_ids"], tb["input_ids"] == image_id)
        if family == "paligemma":
            fake = not any(f.get("images") for f in batch_rows)
            rows = batch_rows + batch_rows if kind == "pairwise" else batch_rows
            for i, f in enumerate(rows):
                k = 16 * (1 if fake and i == 0 else len(f.get("images") or []))
                n = int(tb["attention_mask"][i].sum()) + (16 if fake and i == 0 else 0)  # the fake's are masked
                types = [0] * k + [1] * (n - k)
                row = tb["token_type_ids"][i]
                assert (row[-n:] if kind == "unsupervised" else row[:n]).tolist() == types
                assert row.sum() == n - k  # pads 0


@pytest.mark.parametrize("family", FAMILIES)
def test_fake_image_on_a_batch_without_images(family):
    """LF's collator: no image in the batch -> a 64x64 white image, its tokens (PaliGemma's image tokens included)
    after row 0's (before them in the left-padded prompt batch; on the first chosen row of a pairwise one), masked
    and unlabelled; the processor's inputs are the fake's."""
    for side in SIDES:
        template, tokenizer = _bound(family, side)
        mm = MODULES[side][3]
        white = mm.preprocess_image(mm.fake_image(), template.mm_plugin)
        text, prefix = _expansion(family, side, white)
        fake = [tokenizer.convert_tokens_to_ids(IMAGE_TOKEN[family])] * prefix + tokenizer.encode(text)
        assert mm.fake_image_input_ids(tokenizer, template.mm_plugin) == fake
        m = len(fake)
        for kind in KINDS:
            feats = [f for f in _features(family, side, kind) if not f.get("images")][:2]
            b = _collate(family, side, kind, feats)
            key = "chosen_input_ids" if kind == "pairwise" else "input_ids"
            n = len(feats[0][key])
            if kind == "unsupervised":
                assert b["input_ids"][0, -n - m:].tolist() == fake + feats[0][key]
                assert b["attention_mask"][0, -n - m:].tolist() == [0] * m + [1] * n
            else:
                assert b["input_ids"][0, :n + m].tolist() == feats[0][key] + fake
                assert b["attention_mask"][0, :n + m].tolist() == [1] * n + [0] * m
                assert b["labels"][0, n:n + m].tolist() == [-100] * m
            assert len(b["pixel_values"]) == 1
            if family == "llava_next":
                assert b["image_sizes"].tolist() == [[64, 64]]


# ---- refusals ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_an_unbound_template_refuses_to_collate(family):
    feats = _features(family, "torch", "supervised")[:4]
    for side in SIDES:
        template_mod, _, collator, *_ = MODULES[side]
        template, tokenizer = template_mod.get_template(TEMPLATES[family]), _bound(family, side)[1]
        mm = collator.MultimodalContext(template.mm_plugin, tokenizer, _data_dir("supervised"))
        with pytest.raises(ValueError, match=r"Template\.bind"):
            collator.SFTDataCollator(tokenizer.pad_token_id, mm=mm)(feats)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unbound_template_refuses_to_process(family):
    for side in SIDES:
        template_mod, processor, *_ = MODULES[side]
        template, tokenizer = template_mod.get_template(TEMPLATES[family]), _bound(family, side)[1]
        with pytest.raises(ValueError, match=r"Template\.bind"):
            processor.preprocess_supervised_dataset(_rows("supervised")[:2], tokenizer, template, CUTOFF,
                                                    media_dir=_data_dir("supervised"))


@pytest.mark.parametrize("side", SIDES)
def test_missing_processor_files_refuse(side, tmp_path):
    template_mod, *_, mm, sft = MODULES[side]
    shutil.copy(ROOT / "assets/tokenizer/gemma3/tokenizer.json", tmp_path)
    shutil.copy(ROOT / "assets/tokenizer/gemma3/tokenizer_config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        template_mod.get_template("gemma3").bind(tmp_path)
    shutil.copy(ROOT / "assets/tokenizer/gemma3/preprocessor_config.json", tmp_path)
    with pytest.raises(FileNotFoundError, match="processor_config.json"):
        mm.read_processor_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="processor_config.json"):
        sft._fixed_tokenizer(tmp_path, sft.TrainArgs(template="gemma3"))
    assert template_mod.get_template("llama3").bind(tmp_path) == template_mod.get_template("llama3")  # no plugin


# ---- the models take the collated batch ----------------------------------------------------------------------------

JAX_CLASSES = {"gemma3": "Gemma3ForConditionalGeneration", "paligemma": "PaliGemmaForConditionalGeneration",
               "llava_next": "LlavaNextForConditionalGeneration", "internvl": "InternVLForConditionalGeneration"}


@pytest.mark.parametrize("family", [f if f == "paligemma" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_forward_on_a_collated_batch(family):
    """sft.model_inputs of each side's collated SFT batch (rows with one image, two, none) into its model: the torch
    source's logits and the JAX oracle's agree at the attended positions. Gemma's token types have teeth: without
    them the torch logits move far more than the tolerance."""
    ckpt, tok, data = ROOT / "assets/checkpoints" / family, ROOT / "assets/tokenizer" / family, _data_dir("supervised")
    rows = t_sft.load_processed_dataset(tok, data, "train", t_sft.TrainArgs(template=TEMPLATES[family],
                                                                           cutoff_len=CUTOFF))[:4]
    tb = t_sft.make_collator(t_sft.TrainArgs(template=TEMPLATES[family], cutoff_len=CUTOFF), tok, data_dir=data)(rows)
    jb = j_sft.make_collator(j_sft.TrainArgs(template=TEMPLATES[family], cutoff_len=CUTOFF), tok, data_dir=data)(rows)
    assert set(t_sft.model_inputs(tb)) == set(j_sft.model_inputs(jb)) == {"pixel_values"} | EXTRAS[family]
    model = auto.from_pretrained(ckpt)
    with torch.no_grad():
        want = model(tb["input_ids"], tb["attention_mask"], **t_sft.model_inputs(tb)).numpy()
    conversion = importlib.import_module(f"conversion.{family}")
    jmodel = getattr(importlib.import_module(f"jax_oracles.models.{family}"), JAX_CLASSES[family])
    got = jmodel(conversion.load_config(ckpt)).apply({"params": conversion.load_params(ckpt)}, jb["input_ids"],
                                                      jb["attention_mask"], **j_sft.model_inputs(jb))
    real = tb["attention_mask"].numpy().astype(bool)
    assert np.abs(np.asarray(got) - want)[real].max() <= 1e-4
    if "token_type_ids" in tb:
        with torch.no_grad():
            causal = model(tb["input_ids"], tb["attention_mask"], pixel_values=tb["pixel_values"]).numpy()
        assert np.abs(causal - want)[real].max() > 1e-2

