"""Qwen2.5-Omni's audio in the training data path (issue 32): the Whisper log-mel features
(models/audio_processing.py) against transformers' WhisperFeatureExtractor called as LLaMA-Factory 0.9.5 calls it,
the plugin's `<audio>` expansion and LF's fake audio (data/mm_plugin.py Qwen2OmniPlugin, data/collator.py), the
Omni collators torch against JAX on the VL rows, their positions against transformers' thinker index called with
LF's own arguments (the fake image's grid, audio_seqlens, a float mask, then LF's Omni delta shift), and the
qwen2_omni tokenizer. LF's own collator is not run here (it needs LF's environment, `make lf-env`); its Omni
branch is replayed from its source instead (`_lf_omni_positions`)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5OmniThinkerConfig, WhisperFeatureExtractor
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf_omni

from jax_oracles.models import audio as j_audio, audio_processing as j_ap, qwen2_omni as j_omni
from jax_oracles.training import collator as j_collator, mm_plugin as j_mm, processor as j_processor, template as j_template
from torch_sources.models import audio as t_audio, audio_processing as t_ap, qwen2_omni as t_omni
from torch_sources.training import collator as t_collator, mm_plugin as t_mm, processor as t_processor, template as t_template

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER, CKPT = ROOT / "assets/tokenizer/qwen2_omni", ROOT / "assets/checkpoints/qwen2_omni"
MEDIA_DIR = ROOT / "assets/images"
CUTOFF = 128
PAD, IM_END, AUDIO, AUDIO_BOS, AUDIO_EOS, VS, VE, IMG = 400, 402, 403, 404, 405, 409, 410, 412
MEL = 128  # the release's processor, and the tiny checkpoint's audio tower
FAKE_IMAGE, FAKE_AUDIO = [VS] + [IMG] * 4 + [VE], [AUDIO_BOS, AUDIO, AUDIO, AUDIO_EOS]
SIDES = ("torch", "jax")
MODULES = {"torch": (t_template, t_processor, t_collator, t_mm, t_omni),
           "jax": (j_template, j_processor, j_collator, j_mm, j_omni)}
NO_AUDIO_SUPPORT = "This model does not support audio input. Please check whether the correct `template` is used."


def _rows(name: str) -> list[dict]:
    return [r for split in ("train", "eval")
            for r in json.loads((ROOT / "assets" / "data" / name / f"{split}.json").read_text())]


def _np(batch) -> dict[str, np.ndarray]:
    return {k: v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v) for k, v in batch.items()}


@pytest.fixture(scope="module")
def omni():
    """Per side: (template, fixed tokenizer, processor, collator, mm_plugin module, the collator's context)."""
    out = {}
    for side, (template_mod, processor, collator, mm, model_mod) in MODULES.items():
        template = template_mod.get_template("qwen2_omni")
        tokenizer = template.fix_special_tokens(template_mod.load_tokenizer(TOKENIZER))
        model = model_mod.Qwen2OmniThinkerForConditionalGeneration(model_mod.Qwen2OmniConfig.from_pretrained(CKPT))
        context = collator.MultimodalContext(template.mm_plugin, tokenizer, MEDIA_DIR, model.rope_index)
        out[side] = (template, tokenizer, processor, collator, mm, context)
    return out


def _features(omni, side, kind, rows):
    template, tokenizer, processor, *_ = omni[side]
    fn = {"supervised": processor.preprocess_supervised_dataset, "pairwise": processor.preprocess_pairwise_dataset,
          "unsupervised": processor.preprocess_unsupervised_dataset}[kind]
    return fn(rows, tokenizer, template, CUTOFF, media_dir=MEDIA_DIR)


def _collate(omni, side, kind, feats, **kw):
    _, tokenizer, _, collator, _, context = omni[side]
    cls = {"supervised": collator.SFTDataCollator, "pairwise": collator.PairwiseDataCollator,
           "unsupervised": collator.PromptDataCollator}[kind]
    return _np(cls(tokenizer.pad_token_id, mm=context, **kw)(feats))


# ---- the feature extractor ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mel", [MEL, 16])
def test_whisper_features_equal_transformers(mel):
    """LF's call (`feature_extractor(audios, sampling_rate=16000, return_attention_mask=True, padding="max_length",
    return_tensors="pt")`) on the fake audio and a random 0.77 s waveform: the torch source bit for bit (it is
    transformers' torch path), the numpy twin bit for bit on the silence and to 1e-5 elsewhere (another FFT)."""
    audios = [np.zeros(1600), np.random.default_rng(0).standard_normal(12345) * 0.1]
    want = WhisperFeatureExtractor(feature_size=mel)(audios, sampling_rate=16000, return_attention_mask=True,
                                                    padding="max_length", return_tensors="pt")
    features, mask = t_ap.whisper_features(audios, t_ap.WhisperFeatureConfig(feature_size=mel))
    assert torch.equal(features, want["input_features"]) and torch.equal(mask, want["attention_mask"])
    assert features.shape == (2, mel, 3000) and mask.dtype == torch.int32 and mask.sum(-1).tolist() == [10, 78]
    j_features, j_mask = j_ap.whisper_features(audios, j_ap.WhisperFeatureConfig(feature_size=mel))
    assert j_features.dtype == np.float32 and j_mask.dtype == np.int32
    np.testing.assert_array_equal(j_mask, mask.numpy())
    np.testing.assert_array_equal(j_features[0], features[0].numpy())
    assert (j_features[0] == -1.5).all()  # log10 of the 1e-10 floor, (x + 4) / 4
    assert np.abs(j_features[1] - features[1].numpy()).max() <= 1e-5
    filters = WhisperFeatureExtractor(feature_size=mel).mel_filters
    for side in (t_ap, j_ap):
        np.testing.assert_array_equal(side.mel_filter_bank(side.WhisperFeatureConfig(feature_size=mel)), filters)


def test_whisper_config_is_the_releases():
    """Qwen2.5-Omni-7B's preprocessor_config.json (WhisperFeatureExtractor: 128 mel bins, 16 kHz, hop 160, 300 s:
    n_samples 4800000, nb_max_frames 30000, n_fft 400; found by the LF parity harness, LF padding every batch's
    audio to 30000 frames); a longer waveform is cut to 300 s, as `truncation=True` does."""
    fe = WhisperFeatureExtractor(feature_size=128, chunk_length=300)
    assert (fe.n_samples, fe.nb_max_frames) == (4_800_000, 30_000)  # the release file's own numbers
    for side in (t_ap, j_ap):
        c = side.WhisperFeatureConfig.qwen2_omni()
        assert (c.feature_size, c.sampling_rate, c.hop_length, c.chunk_length, c.n_fft, c.padding_value, c.n_samples) \
            == (fe.feature_size, fe.sampling_rate, fe.hop_length, fe.chunk_length, fe.n_fft, fe.padding_value,
                fe.n_samples)
        waveforms, mask = side.pad_waveforms([np.ones(5_000_000)], c)
        assert waveforms.shape == (1, 4_800_000) and mask.all()
    assert t_ap.__all__ == j_ap.__all__


# ---- the plugin --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("side", SIDES)
def test_audio_expansion_and_fake_audio_are_lfs(omni, side):
    """Qwen2OmniPlugin: `<audio>` -> <|audio_bos|> <|AUDIO|> * n <|audio_eos|>, n = ((frames - 1) // 2 + 1 - 2) // 2
    + 1 (12345 samples: 78 frames, 19 tokens; the fake audio's 1600: 10 frames, 2), images expanded as before; the
    collator's fake tokens: the fake image's, then the fake audio's."""
    template, tokenizer, _, _, mm, context = omni[side]
    plugin = template.mm_plugin
    wave = np.random.default_rng(1).standard_normal(12345)
    image = mm.regularize_images(["gradient_64x48.png"], MEDIA_DIR, plugin)
    messages = [{"role": "user", "content": "<audio><image>Hi"}, {"role": "assistant", "content": "<audio>ok"}]
    got = mm.process_messages(messages, image, plugin, [wave, mm.fake_audio()])
    audio = lambda n: "<|audio_bos|>" + "<|AUDIO|>" * n + "<|audio_eos|>"  # noqa: E731
    assert [m["content"] for m in got] == [audio(19) + "<|vision_bos|>" + "<|IMAGE|>" * 4 + "<|vision_eos|>Hi",
                                           audio(2) + "ok"]
    assert messages[0]["content"] == "<audio><image>Hi"  # not changed in place
    assert mm.fake_audio_input_ids(tokenizer, plugin) == FAKE_AUDIO
    assert mm.fake_input_ids(tokenizer, context.plugin) == FAKE_IMAGE + FAKE_AUDIO
    assert mm.fake_input_ids(tokenizer, plugin, image=False) == FAKE_AUDIO
    qwen2_vl = MODULES[side][0].get_template("qwen2_vl").mm_plugin
    assert mm.fake_input_ids(tokenizer, qwen2_vl) == mm.fake_image_input_ids(tokenizer, qwen2_vl)  # no audio token
    # LF's token count is the audio tower's output length, at every frame count
    frames = np.arange(1, 200)
    counts = mm.audio_token_counts((np.arange(200)[None] < frames[:, None]).astype(np.int32))
    lengths = (t_audio.audio_output_lengths(torch.tensor(frames)).tolist() if side == "torch"
               else j_audio.audio_output_lengths(frames).tolist())
    assert counts == lengths


@pytest.mark.parametrize("side", SIDES)
def test_audio_errors_are_lfs(omni, side):
    template_mod, _, _, mm, _ = MODULES[side]
    plugin = template_mod.get_template("qwen2_omni").mm_plugin
    with pytest.raises(ValueError, match="The number of audios does not match the number of <audio> tokens"):
        mm.process_messages([{"role": "user", "content": "<audio><audio>"}], [], plugin, [mm.fake_audio()])
    with pytest.raises(ValueError, match="The number of images does not match"):  # LF checks the images first
        mm.process_messages([{"role": "user", "content": "<image><audio>"}], [], plugin, [])
    for other in (template_mod.get_template("qwen2_vl").mm_plugin, None):
        with pytest.raises(ValueError) as error:
            mm.process_messages([{"role": "user", "content": "<audio>"}], [], other, [mm.fake_audio()])
        assert str(error.value) == NO_AUDIO_SUPPORT
    with pytest.raises(ValueError, match="The number of audios does not match"):  # every plugin validates audio
        mm.process_messages([{"role": "user", "content": "<audio>"}], [], template_mod.get_template("qwen2_vl").mm_plugin)
    with pytest.raises(ValueError, match="Audio feature extractor was not found"):
        mm.MMPlugin("x", image_token="<|IMAGE|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>",
                    image_processor=plugin.image_processor)


# ---- the collators -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, data", [("supervised", "sft_vl"),
                                        pytest.param("unsupervised", "sft_vl", marks=pytest.mark.slow),
                                        pytest.param("pairwise", "dpo_vl", marks=pytest.mark.slow)])
def test_omni_batches_twins_on_the_vl_data(omni, kind, data):
    feats = _features(omni, "torch", kind, _rows(data))
    assert feats == _features(omni, "jax", kind, _rows(data))
    for s in range(0, len(feats), 4):
        tb, jb = _collate(omni, "torch", kind, feats[s:s + 4]), _collate(omni, "jax", kind, feats[s:s + 4])
        assert tb.keys() == jb.keys() >= {"input_ids", "attention_mask", "pixel_values", "image_grid_thw",
                                          "input_features", "feature_attention_mask", "position_ids", "rope_deltas"}
        for k in tb:
            np.testing.assert_array_equal(tb[k], jb[k], err_msg=k)
        assert tb["input_features"].shape == (1, MEL, 30000) and tb["feature_attention_mask"].sum() == 10
        assert (tb["input_ids"] == AUDIO).sum() == 2  # the fake audio, every batch


def _without_images(omni, side, kind="supervised", data="sft_vl"):
    return _features(omni, side, kind, [r for r in _rows(data) if "images" not in r][:3])


@pytest.mark.parametrize("side", SIDES)
def test_fake_media_literal(omni, side):
    """An image-free batch: row 0 gains the fake image's and the fake audio's tokens (masked, unlabelled); the
    thinker's positions count the real tokens only (masked ones at 1, its pad position), and rope_deltas are LF's
    Omni shift: -(masked tokens of the row) at LF's width. A batch with images gains the fake audio alone."""
    feats = _without_images(omni, side)
    b = _collate(omni, side, "supervised", feats)
    n0, fake = len(feats[0]["input_ids"]), FAKE_IMAGE + FAKE_AUDIO
    width = -(-max(n0 + 10, *(len(f["input_ids"]) for f in feats)) // 8) * 8
    assert b["input_ids"].shape == (3, width)
    assert b["input_ids"][0, :n0 + 10].tolist() == feats[0]["input_ids"] + fake
    assert b["attention_mask"][0, :n0 + 10].tolist() == [1] * n0 + [0] * 10
    assert b["labels"][0, :n0 + 10].tolist() == feats[0]["labels"] + [-100] * 10
    assert b["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert (b["input_features"] == -1.5).all() and b["feature_attention_mask"].tolist() == [[1] * 10 + [0] * 29990]
    real = b["attention_mask"] == 1
    np.testing.assert_array_equal(b["position_ids"], np.broadcast_to(np.where(real, np.cumsum(real, -1) - 1, 1),
                                                                     (3, *real.shape)))
    assert b["rope_deltas"].tolist() == [[int(n) - width] for n in real.sum(-1)]

    with_images = _features(omni, side, "supervised", [r for r in _rows("sft_vl") if r.get("images")][:2])
    b = _collate(omni, side, "supervised", with_images)
    n0 = len(with_images[0]["input_ids"])
    assert b["input_ids"][0, n0:n0 + 4].tolist() == FAKE_AUDIO and (b["input_ids"][1] != AUDIO).all()
    assert len(b["image_grid_thw"]) == sum(len(f["images"]) for f in with_images)

    prompts = _without_images(omni, side, "unsupervised")  # left-padded: the fake tokens go first
    p = _collate(omni, side, "unsupervised", prompts)
    k = len(prompts[0]["input_ids"])
    assert p["input_ids"][0, -k - 10:].tolist() == fake + prompts[0]["input_ids"]
    assert p["attention_mask"][0, -k - 10:].tolist() == [0] * 10 + [1] * k


@functools.cache
def _hf_index():
    """transformers' thinker get_rope_index, bound to the tiny checkpoint's thinker config (no weights needed)."""
    config = Qwen2_5OmniThinkerConfig(**json.loads((CKPT / "config.json").read_text())["thinker_config"])
    cls = hf_omni.Qwen2_5OmniPreTrainedModelForConditionalGeneration
    model = SimpleNamespace(config=config, spatial_merge_size=config.vision_config.spatial_merge_size)
    model.get_llm_pos_ids_for_vision = functools.partial(cls.get_llm_pos_ids_for_vision, model)
    return functools.partial(cls.get_rope_index, model)


def _lf_omni_positions(batch: dict[str, np.ndarray]):
    """LF's _compute_rope_position_ids, Omni branch, on a collated batch: every grid the batch carries (the fake
    image's included), the mask as float, audio_seqlens from feature_attention_mask, then rope_deltas minus each
    row's masked tokens."""
    mask = (torch.tensor(batch["attention_mask"]) >= 1).float()
    positions, deltas = _hf_index()(torch.tensor(batch["input_ids"]), torch.tensor(batch["image_grid_thw"]), None,
                                    mask, False, torch.tensor(batch["feature_attention_mask"]).sum(1))
    return positions.numpy(), (deltas - (1 - mask).sum(dim=-1).unsqueeze(-1)).numpy()


def test_positions_are_lfs(omni):
    """The collators' position_ids and rope_deltas against LF's Omni branch replayed on transformers' index: an
    image-free batch (fake image and audio), batches with images (fake audio alone), a left-padded prompt batch
    and a pairwise one; the JAX twin on a wider static batch keeps LF's deltas (its extra pads counted out)."""
    batches = [("supervised", _without_images(omni, "torch")),
               ("supervised", _features(omni, "torch", "supervised", _rows("sft_vl")[:4])),
               ("unsupervised", _features(omni, "torch", "unsupervised", _rows("sft_vl")[4:8])),
               ("pairwise", _features(omni, "torch", "pairwise", _rows("dpo_vl")[:2]))]
    for kind, feats in batches:
        b = _collate(omni, "torch", kind, feats)
        positions, deltas = _lf_omni_positions(b)
        np.testing.assert_array_equal(b["position_ids"], positions, err_msg=kind)
        np.testing.assert_array_equal(b["rope_deltas"], deltas.astype(np.int64), err_msg=kind)
    wide = _collate(omni, "jax", "supervised", batches[1][1], pad_to_length=160)
    narrow = _collate(omni, "torch", "supervised", batches[1][1])
    T = narrow["input_ids"].shape[1]
    np.testing.assert_array_equal(wide["position_ids"][..., :T], narrow["position_ids"])
    assert (wide["position_ids"][..., T:] == 1).all()
    np.testing.assert_array_equal(wide["rope_deltas"], narrow["rope_deltas"])


# ---- the tokenizer -----------------------------------------------------------------------------------------------

def test_qwen2_omni_tokenizer():
    """The shared BPE plus Omni's specials from 400 (the checkpoint's token ids), the release's bos / eos / pad; the
    template makes <|im_end|> the eos."""
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    from checkpoints_qwen2_omni import OMNI_IDS, QWEN2_OMNI_CONFIG
    hf = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    assert {t: hf.convert_tokens_to_ids(t) for t in OMNI_IDS} == OMNI_IDS
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (None, "<|im_end|>", "<|endoftext|>")
    thinker = QWEN2_OMNI_CONFIG["thinker_config"]
    assert (thinker["audio_token_index"], thinker["audio_start_token_id"], thinker["image_token_index"]) == \
        (AUDIO, AUDIO_BOS, IMG)
    vl = AutoTokenizer.from_pretrained(str(ROOT / "assets/tokenizer/qwen2_vl"), local_files_only=True)
    text = "user\n\nDescribe the four corners."
    assert hf.encode(text) == vl.encode(text)  # ids below 400 are every family's
    for template_mod in (t_template, j_template):
        tok = template_mod.get_template("qwen2_omni").fix_special_tokens(template_mod.load_tokenizer(TOKENIZER))
        assert (tok.eos_token_id, tok.pad_token_id) == (IM_END, PAD)
        assert tok.encode("<|audio_bos|><|AUDIO|><|audio_eos|>") == hf.encode("<|audio_bos|><|AUDIO|><|audio_eos|>")


# ---- training ----------------------------------------------------------------------------------------------------

def test_jax_step_batch_carries_the_audio_rows(omni):
    """The JAX trainer's audio: the frozen tower run outside the step on the collated features, reading only the
    masked frames (the 10 of the fake audio), its rows padded with zeros to the static count like the image features
    (the tower's numbers against the torch source: tests/models/test_qwen2_omni_model.py)."""
    from jax_oracles.training import sft as jsft
    batch = _collate(omni, "jax", "supervised", _without_images(omni, "jax"), pad_to_length=128)
    model = jsft.load_model(CKPT)
    rows = jsft.encode_audio(model, batch["input_features"], batch["feature_attention_mask"])
    noisy = batch["input_features"].copy()
    noisy[..., 10:] = np.random.default_rng(2).standard_normal(noisy[..., 10:].shape)
    assert rows.shape == (2, 64) and np.isfinite(rows).all()
    np.testing.assert_array_equal(jsft.encode_audio(model, noisy, batch["feature_attention_mask"]), rows)
    text = {k: batch[k] for k in ("input_ids", "attention_mask", "labels", "position_ids")}
    padded = jsft._pad_batch({**text, "audio_embeds": rows}, 4, 128, PAD)
    assert padded["audio_embeds"].shape == (4 * 128, 64) and not padded["audio_embeds"][2:].any()
    np.testing.assert_array_equal(padded["audio_embeds"][:2], rows)
    assert jsft._filler(padded)["audio_embeds"].shape == (0, 64)
    with pytest.raises(ValueError, match="leading frames"):
        jsft.encode_audio(model, noisy, batch["feature_attention_mask"][:, ::-1])


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


@pytest.mark.slow
def test_omni_sft_end_to_end_matches():
    """qwen2_omni SFT on the VL rows (LF's fake audio in every batch, the fake image in the image-free ones): the
    torch source runs both towers in its forward, the JAX oracle feeds their outputs computed outside the step."""
    from jax_oracles.training import sft as jsft
    from torch_sources.training import sft as tsft
    kw = dict(template="qwen2_omni", cutoff_len=CUTOFF, num_train_epochs=1)
    want = tsft.train_sft(CKPT, TOKENIZER, ROOT / "assets/data/sft_vl", tsft.TrainArgs(**kw))
    got = jsft.train_sft(CKPT, TOKENIZER, ROOT / "assets/data/sft_vl", jsft.TrainArgs(**kw))
    np.testing.assert_allclose(got.step_losses, want.step_losses, rtol=1e-5)
    np.testing.assert_allclose([got.eval_loss_before, got.eval_loss_after],
                               [want.eval_loss_before, want.eval_loss_after], rtol=1e-5)
    assert _max_diff(got.lora_state_dict, want.lora_state_dict) < 1e-5
    assert want.eval_loss_after < want.eval_loss_before - 0.1


@pytest.mark.slow
def test_omni_dpo_end_to_end_matches():
    """qwen2_omni DPO: the pairwise collator's fake audio on the first chosen row, the audio rows padded with the
    image features through the JAX pairs' static shape."""
    from jax_oracles.training import dpo as jdpo
    from torch_sources.training import dpo as tdpo
    kw = dict(template="qwen2_omni", cutoff_len=CUTOFF, num_train_epochs=2)
    want = tdpo.train_dpo(CKPT, TOKENIZER, ROOT / "assets/data/dpo_vl", tdpo.DPOArgs(**kw))
    got = jdpo.train_dpo(CKPT, TOKENIZER, ROOT / "assets/data/dpo_vl", jdpo.DPOArgs(**kw))
    np.testing.assert_allclose(got.step_losses, want.step_losses, rtol=1e-5, atol=1e-6)
    assert _max_diff(got.lora_state_dict, want.lora_state_dict) < 3e-5
