"""MXFP4 (OCP microscaling FP4) dequantisation in numpy alone: GPT-OSS stores its expert weights so.

A block of 32 values shares one E8M0 scale byte s (the value 2^(s-127)); each value is an E2M1 code
of 4 bits, two per byte: element 2j is the low nibble of byte j, element 2j+1 the high one. Bit 3 is
the sign, bits 0-2 index the magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}. Every code times a power of two
is exact in float32 (np.ldexp), so this equals transformers' dequantisation
(integrations/mxfp4.py: lut[nibble] then torch.ldexp) bit for bit.
"""

from __future__ import annotations

import numpy as np

__all__ = ["E2M1_VALUES", "dequantize_mxfp4"]

# E2M1 code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0.0, as transformers' table).
E2M1_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks u8[..., G, 16], scales u8[..., G] -> f32[..., G*32] (32 values per scale, in order)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise TypeError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape} (expected [..., G, 16] "
                         "and [..., G])")
    values = np.empty((*blocks.shape[:-1], 32), np.float32)  # [..., G, 32]
    values[..., 0::2] = E2M1_VALUES[blocks & 0x0F]
    values[..., 1::2] = E2M1_VALUES[blocks >> 4]
    exponent = scales.astype(np.int32)[..., None] - 127
    return np.ldexp(values, exponent).reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
