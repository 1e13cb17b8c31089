"""SFT and pairwise collators, numpy twins of torch_sources/training/collator.py (int32 arrays instead of
tensors). The pairwise one puts every chosen row first, then every rejected row, padded together.

HF DataCollatorForSeq2Seq with right padding to the longest row rounded up to a multiple of 8;
`pad_to_length` pads every batch to one fixed length instead, so a jitted step sees one shape.

Given a multimodal context, LF's MultiModalDataCollatorForSeq2Seq as in the torch twin: the rows' images in row
order (the fake image on row 0 when there is none), pixel_values f32[P, C*T*ps*ps], image_grid_thw i64[I,3] and,
given the model's (host) rope_index, position_ids [3,B,T] and rope_deltas [B,1] of the padded batch. A tower
plugin's batch (Gemma 3, PaliGemma, LLaVA-NeXT, InternVL) gains its processor's pixel_values and extras
(image_sizes) instead, and Gemma's token_type_ids [B,T], padded with 0 like the ids.

A plugin with an audio token (Qwen2.5-Omni's) also gets LF's fake audio on every batch (the data carries no
audio): its tokens follow the fake image's on row 0 (or stand alone when the batch has images), the batch gains
input_features f32[1, mel, 3000] and feature_attention_mask i32[1, 3000] (10 frames set), and the positions take
LF's Omni branch: the thinker's rope index (the fake media are masked, so it never reaches them: every real token
keeps its place), then rope_deltas minus each row's masked tokens, counted at the width LF pads to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from ..models.layers import padded_positions
from .mm_plugin import (MMPlugin, TowerPlugin, add_fake_image, fake_audio_inputs, fake_image, fake_input_ids,
                        get_mm_inputs, preprocess_image, regularize_images)
from .template import ChatTokenizer

__all__ = ["MultimodalContext", "SFTDataCollator", "PairwiseDataCollator", "PromptDataCollator", "pad_features",
           "collated_positions"]


def collated_positions(attention_mask, multiple: int = 8):  # i32[B,L] (traced) -> i32[B,L]
    """The positions the torch collator's batch has, on a wider static batch: torch pads the rows to the
    longest, rounded up to `multiple` (LF's pad_to_multiple_of 8), and transformers' longrope picks its table
    from that batch's largest position (layers.padded_positions)."""
    width = -(-jnp.max(jnp.sum(attention_mask, axis=-1)) // multiple) * multiple
    return padded_positions(attention_mask, width)


def pad_features(features: list[dict], length: int, pad_token_id: int, label_pad_token_id: int) -> dict[str, np.ndarray]:
    """Right-pad each feature's input_ids / attention_mask / labels (and token_type_ids, with 0: the tokenizer's
    pad_token_type_id, where a plugin gave them) to `length` -> int32 [B, length]."""
    fill = {"input_ids": pad_token_id, "attention_mask": 0, "labels": label_pad_token_id}
    if "token_type_ids" in features[0]:
        fill["token_type_ids"] = 0
    out = {}
    for key, value in fill.items():
        rows = np.full((len(features), length), value, dtype=np.int32)
        for i, f in enumerate(features):
            rows[i, :len(f[key])] = f[key]
        out[key] = rows
    return out


@dataclass(frozen=True)
class MultimodalContext:
    """What LF's multimodal collator reads off its template, tokenizer and model."""

    plugin: MMPlugin  # template.mm_plugin
    tokenizer: ChatTokenizer  # the template-fixed tokenizer: it encodes the fake image's tokens
    media_dir: str | Path | None = None  # DataArguments.media_dir (LF's default: the dataset dir)
    # model.rope_index: (input_ids [B,T], image_grid_thw i64[I,3] or None, attention_mask [B,T]) ->
    # (position_ids i64[3,B,T], rope_deltas i64[B,1]); None: no position_ids (LF without a get_rope_index)
    rope_index: Callable | None = None


@dataclass(frozen=True)
class _Media:
    """A batch's media for LF's collator: its regularized images in row order, which fakes stand in, and a tower
    plugin's inputs (computed on the rows with the fake's tokens, as LF's get_mm_inputs sees them)."""

    images: list
    fake_image: bool
    fake_audio: bool
    tower_inputs: dict | None = None  # a tower plugin's get_mm_inputs of the batch


def _mm_rows(features: list[dict], mm: MultimodalContext, padding_side: str) -> tuple[list[dict], _Media]:
    """(rows, their media): LF's __call__ up to padding, the fake media's tokens on row 0 where the batch lacks
    images (any plugin) or audio (a plugin with an audio token: always, the data has none)."""
    if any(f.get("audios") for f in features):
        raise NotImplementedError("audio files in the data are not read (LF decodes them with torchaudio): only "
                                  "LF's fake audio reaches the collator")
    images = [image for f in features for image in regularize_images(f.get("images") or [], mm.media_dir, mm.plugin)]
    imglens = [len(f.get("images") or []) for f in features]
    fake = not images
    fake_ids = fake_input_ids(mm.tokenizer, mm.plugin, image=fake, audio=mm.plugin.audio_token is not None)
    rows = add_fake_image(features, fake_ids, padding_side) if fake_ids else features
    images = images or [preprocess_image(fake_image(), mm.plugin)]
    tower = None
    if isinstance(mm.plugin, TowerPlugin):  # LF sets each row's token_type_ids before padding
        tower = mm.plugin.get_mm_inputs(images, [1] + imglens[1:] if fake else imglens,
                                        [list(r["input_ids"]) for r in rows], mm.tokenizer)
        if "token_type_ids" in tower:
            rows = [{**r, "token_type_ids": types} for r, types in zip(rows, tower.pop("token_type_ids"))]
    return rows, _Media(images, fake_image=fake, fake_audio=mm.plugin.audio_token is not None, tower_inputs=tower)


def _omni_deltas(rope_deltas, attention_mask, lf_width: int):  # i64[B,1], [B,T] -> i64[B,1]
    """LF's Omni branch: rope_deltas - (1 - attention_mask).sum(-1), the masked tokens (pads, fake media) of the
    batch as LF pads it (`lf_width` columns; a wider static batch counts its extra pads out)."""
    return rope_deltas - (lf_width - attention_mask.sum(-1, keepdims=True))


def _mm_inputs(batch: dict, media: _Media, mm: MultimodalContext, lf_width: int) -> dict[str, np.ndarray]:
    """pixel_values, image_grid_thw, (a plugin with an audio token) input_features, feature_attention_mask, and
    (with a rope_index) position_ids, rope_deltas of the padded batch; a tower plugin's pixel_values and extras
    (image_sizes; its token_type_ids went into the rows before padding)."""
    if media.tower_inputs is not None:
        return dict(media.tower_inputs)
    pixel_values, image_grid_thw = get_mm_inputs(media.images, mm.plugin)
    out = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
    if media.fake_audio:
        out["input_features"], out["feature_attention_mask"] = fake_audio_inputs(mm.plugin)
    if mm.rope_index is None:
        return out
    # transformers' get_rope_index takes a grid per image-token run it meets and never meets the fake image's
    # (masked) tokens; mrope.get_rope_index checks that every grid given is placed, so it gets none then
    grid = None if media.fake_image else image_grid_thw
    if mm.plugin.audio_token is None:
        out["position_ids"], out["rope_deltas"] = mm.rope_index(batch["input_ids"], grid, batch["attention_mask"])
        return out
    # LF's Omni branch (model_type qwen2_5_omni_thinker, the model an audio plugin serves): audio_seqlens are the
    # frames of the fake audio, masked like the fake image, so the index never reads them
    seqlens = out["feature_attention_mask"].sum(-1)
    positions, deltas = mm.rope_index(batch["input_ids"], grid, batch["attention_mask"], audio_seqlens=seqlens)
    out["position_ids"], out["rope_deltas"] = positions, _omni_deltas(deltas, batch["attention_mask"], lf_width)
    return out


def _round_up(n: int, multiple: int | None) -> int:
    return -(-n // multiple) * multiple if multiple else n


@dataclass(frozen=True)
class SFTDataCollator:
    pad_token_id: int
    label_pad_token_id: int = -100
    pad_to_multiple_of: int | None = 8
    pad_to_length: int | None = None  # a fixed length instead (static shapes under jit)
    mm: MultimodalContext | None = None  # a vision-language template's

    def __call__(self, features: list[dict]) -> dict[str, np.ndarray]:
        """[dict(input_ids, attention_mask, labels[, images])] -> dict of int32 arrays [B, T] (+ the mm inputs)."""
        if self.mm is not None:
            features, media = _mm_rows(features, self.mm, "right")
        lf_width = _round_up(max(len(f["input_ids"]) for f in features), self.pad_to_multiple_of)
        batch = pad_features(features, self.pad_to_length or lf_width, self.pad_token_id, self.label_pad_token_id)
        if self.mm is not None:
            batch.update(_mm_inputs(batch, media, self.mm, lf_width))
        return batch


@dataclass(frozen=True)
class PairwiseDataCollator(SFTDataCollator):
    def __call__(self, features: list[dict]) -> dict[str, np.ndarray]:
        """[dict(chosen_*, rejected_*[, images])] of N pairs -> dict of int32 arrays [2N, T]: rows 0..N-1 chosen
        (with images, each pair's images come twice: every chosen row's, then every rejected row's)."""
        rows = [{field: f[f"{key}_{field}"] for field in ("input_ids", "attention_mask", "labels")}
                for key in ("chosen", "rejected") for f in features]
        if self.mm is not None:
            rows = [{**row, "images": f.get("images")} for row, f in zip(rows, features + features)]
        return super().__call__(rows)


@dataclass(frozen=True)
class PromptDataCollator:
    """PPO's prompt batches: LF's workflow sets the tokenizer's padding_side to "left" for generation, and its
    collator (no pad_to_multiple_of there) pads input_ids with pad_token_id and attention_mask with 0 on the left."""

    pad_token_id: int
    pad_to_length: int | None = None  # a fixed width instead (static shapes)
    mm: MultimodalContext | None = None  # a vision-language template's

    def __call__(self, features: list[dict]) -> dict[str, np.ndarray]:
        """[dict(input_ids, ...[, images])] -> dict(input_ids, attention_mask) of int arrays [B, T], left-padded
        (+ the mm inputs)."""
        if self.mm is not None:
            features, media = _mm_rows(features, self.mm, "left")
        lf_width = max(len(f["input_ids"]) for f in features)
        length = self.pad_to_length or lf_width
        out = {"input_ids": np.full((len(features), length), self.pad_token_id, np.int32),
               "attention_mask": np.zeros((len(features), length), np.int32)}
        if "token_type_ids" in features[0]:
            out["token_type_ids"] = np.zeros((len(features), length), np.int32)
        for i, f in enumerate(features):
            k = len(f["input_ids"])
            out["input_ids"][i, length - k:] = f["input_ids"]
            out["attention_mask"][i, length - k:] = 1 if self.mm is None else f["attention_mask"]  # fake image: 0
            if "token_type_ids" in out:
                out["token_type_ids"][i, length - k:] = f["token_type_ids"]
        if self.mm is not None:
            out.update(_mm_inputs(out, media, self.mm, lf_width))
        return out
