"""MXFP4 (OCP microscaling FP4) dequantization, as gpt-oss checkpoints store their experts.

A `*_blocks` byte holds two E2M1 codes (element 2j in the low nibble, 2j+1 in the high one; bit 3 of a
code is the sign, bits 0-2 index the magnitudes below). A `*_scales` byte is an E8M0 exponent shared by
32 consecutive elements: value = code * 2^(scale - 127). The result is exact in fp32 (a 3-bit mantissa
times a power of two), so any correct reader agrees bit for bit with transformers' dequantization.
"""
from __future__ import annotations

import torch

__all__ = ["E2M1_VALUES", "dequantize_mxfp4"]

# Code -> value; codes 8..15 are the negatives (8 is -0.0, as in transformers' table).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks u8[..., G, 16], scales u8[..., G] -> f32[..., G*32] (same layout, the last axis unpacked)."""
    assert blocks.shape[:-1] == scales.shape, (blocks.shape, scales.shape)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1)                    # [..., G, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)                                      # f32[..., G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None])  # exact power-of-two scaling
    return values.flatten(-2)
