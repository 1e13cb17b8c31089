"""Images in a prompt, host side (plain Python): vLLM v1's input processing for the image modality.

A prompt names each image with ONE image token (Qwen2.5-VL: `<|vision_start|><|image_pad|><|vision_end|>`); the
engine expands it to the image's number of embedding rows, as vLLM's prompt replacement does, and records where
they sit (a placeholder: offset, length) and what they hold (the content hash, vLLM's mm_hash). The hash is the
image's identity everywhere downstream: the prefix cache chains it into the key of every block the placeholder
overlaps, and the encoder cache keeps one output per hash, shared by every request holding the same image.

This is the original in torch_sources/serving/; serving_engine/multimodal.py is the JAX engine's own copy.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ImageInput", "image_hash", "expand_image_tokens"]


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One processed image: what the encoder reads (Request.mm_inputs holds one per placeholder)."""
    pixel_values: object  # f32[P, C*t*p*p]: the family's processor output, in the runner's array type
    image_grid_thw: tuple[int, int, int]  # patches along time, height, width
    num_tokens: int  # embedding rows the encoder gives, one per expanded image token


def image_hash(image) -> str:
    """Content hash of a raw image array (uint8[H,W,3]): dtype, shape and bytes, so equal pixels in another
    shape never collide. Computed from the input, not the processed pixels: vLLM hashes the item as given."""
    h = hashlib.sha256()
    h.update(f"{image.dtype.str}|{'x'.join(str(int(d)) for d in image.shape)}|".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def expand_image_tokens(prompt_token_ids: Sequence[int], image_token_id: int,
                        num_tokens: Sequence[int]) -> tuple[list[int], list[tuple[int, int]]]:
    """Each image token of the prompt (one per image, in order) -> num_tokens[i] copies of it ->
    (expanded prompt, (offset, length) of each image's run). The counts must agree: an image token left without
    an image would be embedded as text, an image without a token would never be placed."""
    ids = [int(t) for t in prompt_token_ids]
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(num_tokens):
        raise ValueError(f"the prompt holds {found} image tokens ({image_token_id}) for {len(num_tokens)} images: "
                         f"name each image once, where it goes")
    out, placeholders, k = [], [], 0
    for t in ids:
        if t != image_token_id:
            out.append(t)
            continue
        placeholders.append((len(out), int(num_tokens[k])))
        out.extend([t] * int(num_tokens[k]))
        k += 1
    return out, placeholders
