"""SFT and pairwise collators, numpy twins of torch_sources/training/collator.py (int32 arrays instead of
tensors). The pairwise one puts every chosen row first, then every rejected row, padded together.

HF DataCollatorForSeq2Seq with right padding to the longest row rounded up to a multiple of 8;
`pad_to_length` pads every batch to one fixed length instead, so a jitted step sees one shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from ..models.layers import padded_positions

__all__ = ["SFTDataCollator", "PairwiseDataCollator", "PromptDataCollator", "pad_features", "collated_positions"]


def collated_positions(attention_mask, multiple: int = 8):  # i32[B,L] (traced) -> i32[B,L]
    """The positions the torch collator's batch has, on a wider static batch: torch pads the rows to the
    longest, rounded up to `multiple` (LF's pad_to_multiple_of 8), and transformers' longrope picks its table
    from that batch's largest position (layers.padded_positions)."""
    width = -(-jnp.max(jnp.sum(attention_mask, axis=-1)) // multiple) * multiple
    return padded_positions(attention_mask, width)


def pad_features(features: list[dict], length: int, pad_token_id: int, label_pad_token_id: int) -> dict[str, np.ndarray]:
    """Right-pad each feature's input_ids / attention_mask / labels to `length` -> int32 [B, length]."""
    fill = {"input_ids": pad_token_id, "attention_mask": 0, "labels": label_pad_token_id}
    out = {}
    for key, value in fill.items():
        rows = np.full((len(features), length), value, dtype=np.int32)
        for i, f in enumerate(features):
            rows[i, :len(f[key])] = f[key]
        out[key] = rows
    return out


@dataclass(frozen=True)
class SFTDataCollator:
    pad_token_id: int
    label_pad_token_id: int = -100
    pad_to_multiple_of: int | None = 8
    pad_to_length: int | None = None  # a fixed length instead (static shapes under jit)

    def __call__(self, features: list[dict]) -> dict[str, np.ndarray]:
        """[dict(input_ids, attention_mask, labels)] -> dict of int32 arrays [B, T]."""
        length = self.pad_to_length or max(len(f["input_ids"]) for f in features)
        if self.pad_to_length is None and self.pad_to_multiple_of:
            length = -(-length // self.pad_to_multiple_of) * self.pad_to_multiple_of
        return pad_features(features, length, self.pad_token_id, self.label_pad_token_id)


@dataclass(frozen=True)
class PairwiseDataCollator(SFTDataCollator):
    def __call__(self, features: list[dict]) -> dict[str, np.ndarray]:
        """[dict(chosen_*, rejected_*)] of N pairs -> dict of int32 arrays [2N, T]: rows 0..N-1 chosen."""
        rows = [{field: f[f"{key}_{field}"] for field in ("input_ids", "attention_mask", "labels")}
                for key in ("chosen", "rejected") for f in features]
        return super().__call__(rows)


@dataclass(frozen=True)
class PromptDataCollator:
    """PPO's prompt batches: LF's workflow sets the tokenizer's padding_side to "left" for generation, and its
    collator (no pad_to_multiple_of there) pads input_ids with pad_token_id and attention_mask with 0 on the left."""

    pad_token_id: int
    pad_to_length: int | None = None  # a fixed width instead (static shapes)

    def __call__(self, features: list[dict]) -> dict[str, np.ndarray]:
        """[dict(input_ids, ...)] -> dict(input_ids, attention_mask) of int arrays [B, T], left-padded."""
        length = self.pad_to_length or max(len(f["input_ids"]) for f in features)
        out = {"input_ids": np.full((len(features), length), self.pad_token_id, np.int32),
               "attention_mask": np.zeros((len(features), length), np.int32)}
        for i, f in enumerate(features):
            k = len(f["input_ids"])
            out["input_ids"][i, length - k:] = f["input_ids"]
            out["attention_mask"][i, length - k:] = 1
        return out
