"""M-RoPE, the multimodal rotary positions of the Qwen vision-language families: the torch-free twin of
torch_sources/models/mrope.py (same names, same integers, same cos/sin).

The position index is data-dependent, so it runs on the host before jit: numpy in, numpy out
(`get_rope_index`, `get_rope_index_omni`, `text_positions`, `decode_positions`). `mrope_cos_sin` is jnp
and jittable with the positions traced (the section layout, `mrope_axes`, is a numpy constant).

See the torch file's docstring for the rules: Qwen2-VL / 2.5-VL / 3-VL place each run of
`mm_token_type_ids == 1` on its image grid, pads at 0; Qwen2.5-Omni's thinker finds images from token ids,
pads at 1, has its own text-only path and places an audio span as text (its length checked against
audio_seqlens); the text after an image resumes at start + max(h, w);
`rope_deltas` = largest position + 1 - real tokens.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np

from jax_oracles.models.rope import rope_cos_sin

__all__ = ["MropeError", "token_types", "get_rope_index", "audio_spans", "get_rope_index_omni", "text_positions",
           "decode_positions", "mrope_axes", "mrope_cos_sin"]

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values (the processor also writes 3 for audio)


class MropeError(ValueError):
    """Inputs M-RoPE will not place: the message names the row, the image or the key."""


# ---- position index (host numpy) ------------------------------------------------------------

def token_types(input_ids, *, image_token_id: int, video_token_id: int | None = None):  # i64[B,T] -> i64[B,T]
    """The processor's `mm_token_type_ids`: 1 at image tokens, 2 at video tokens, 0 elsewhere."""
    input_ids = np.asarray(input_ids)
    types = (input_ids == image_token_id).astype(np.int64)
    if video_token_id is not None:
        types[input_ids == video_token_id] = VIDEO
    return types


def _llm_grids(image_grid_thw, spatial_merge_size: int) -> list[tuple[int, int, int]]:
    """i64[I,3] -> the (t, h, w) grid of merged patches of each image, as the language model sees it."""
    if image_grid_thw is None:
        return []
    grids = []
    for i, (t, h, w) in enumerate(np.asarray(image_grid_thw).tolist()):
        if t != 1:
            raise MropeError(f"image {i}: grid t={t}; a still image is one temporal patch (t > 1 is a video, "
                             f"which M-RoPE here does not place)")
        if h % spatial_merge_size or w % spatial_merge_size:
            raise MropeError(f"image {i}: grid h={h}, w={w} is not divisible by spatial_merge_size="
                             f"{spatial_merge_size}")
        grids.append((t, h // spatial_merge_size, w // spatial_merge_size))
    return grids


def _vision_positions(start: int, grid: tuple[int, int, int]) -> np.ndarray:  # -> i64[3, t*h*w]
    """The image's patches in reading order (t, then h, then w), each row offset by `start`."""
    t, h, w = grid
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1).astype(np.int64) + start


def _text_block(start: int, n: int) -> np.ndarray:  # -> i64[3,n]
    return np.broadcast_to(np.arange(n, dtype=np.int64) + start, (3, n))


def _real_rows(attention_mask, B: int, T: int) -> np.ndarray:  # -> bool[B,T]: the tokens a row's positions count
    if attention_mask is None:
        return np.ones((B, T), dtype=bool)
    attention_mask = np.asarray(attention_mask)
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise MropeError("attention_mask must hold only 0 and 1")
    keep = attention_mask.astype(bool)
    empty = np.flatnonzero(~keep.any(-1)).tolist()
    if empty:
        raise MropeError(f"rows {empty} have no real token (transformers fails on an empty row)")
    return keep


def get_rope_index(input_ids, image_grid_thw, attention_mask, *, mm_token_type_ids, spatial_merge_size: int):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: input_ids i64[B,T], image_grid_thw i64[I,3] (every image of the
    batch in reading order, or None), attention_mask {0,1}[B,T] (or None), mm_token_type_ids i64[B,T] ->
    (position_ids i64[3,B,T], rope_deltas i64[B,1]). Each run of type-1 tokens takes the next grid."""
    B, T = np.shape(input_ids)
    types = np.asarray(mm_token_type_ids)
    if types.shape != (B, T):
        raise MropeError(f"mm_token_type_ids {types.shape} and input_ids {(B, T)} differ in shape")
    found = sorted(set(np.unique(types).tolist()) - {TEXT, IMAGE})
    if found:
        raise MropeError(f"mm_token_type_ids holds {found}: only text (0) and images (1) are placed (2 video, "
                         f"3 audio are out of scope)")
    grids = _llm_grids(image_grid_thw, spatial_merge_size)
    keep = _real_rows(attention_mask, B, T)
    position_ids = np.zeros((3, B, T), dtype=np.int64)  # pads keep 0
    deltas, image = [], 0
    for b in range(B):
        row = types[b][keep[b]].tolist()
        blocks, start = [], 0
        for kind, run in itertools.groupby(row):
            n = len(list(run))
            if kind == TEXT:
                blocks.append(_text_block(start, n))
                start += n
                continue
            if image == len(grids):
                raise MropeError(f"row {b}: more image-token runs than image_grid_thw has grids ({len(grids)})")
            t, h, w = grids[image]
            if n != t * h * w:
                raise MropeError(f"row {b}: image {image} has {n} image tokens, its grid {grids[image]} of merged "
                                 f"patches needs {t * h * w}")
            blocks.append(_vision_positions(start, grids[image]))
            start += max(h, w)  # transformers: the text resumes after the longer side, whatever t is
            image += 1
        positions = np.concatenate(blocks, axis=1)  # i64[3, real tokens]
        position_ids[:, b, keep[b]] = positions
        deltas.append(int(positions.max()) + 1 - len(row))
    if image != len(grids):
        raise MropeError(f"image_grid_thw has {len(grids)} grids, the tokens hold {image} images")
    return position_ids, np.asarray(deltas, dtype=np.int64)[:, None]


def audio_spans(ids: list[int], *, audio_token_id: int, audio_start_token_id: int) -> list[int]:
    """The audio-token count of each audio span of a row's real tokens, in order: audio_start, then a run of audio
    tokens, then one more token (the audio_end); anything else is refused (transformers would read past it)."""
    runs = [(k, len(list(g))) for k, g in itertools.groupby(ids)]
    spans, at = [], 0
    for i, (tok, n) in enumerate(runs):
        if tok == audio_token_id:
            if i == 0 or runs[i - 1] != (audio_start_token_id, 1) or i == len(runs) - 1:
                raise MropeError(f"the audio tokens at {at} are not one audio_start, the run, then one more token")
            spans.append(n)
        elif tok == audio_start_token_id and (n != 1 or i == len(runs) - 1 or runs[i + 1][0] != audio_token_id):
            raise MropeError(f"the audio_start at {at} is not followed by audio tokens")
        at += n
    return spans


def _check_audio(rows: list[list[int]], audio_seqlens, audio_token_id: int, audio_start_token_id: int) -> None:
    """Every real audio span holds its audio's tower length (audio_seqlens in reading order, one per span). With
    no real span the lengths are never read (LF passes its masked fake audio's)."""
    spans = [n for ids in rows for n in audio_spans(ids, audio_token_id=audio_token_id,
                                                     audio_start_token_id=audio_start_token_id)]
    if not spans:
        return
    if audio_seqlens is None:
        raise MropeError("audio tokens present but no audio_seqlens (transformers walks the row by them)")
    frames = [int(x) for x in audio_seqlens]
    want = [((f - 1) // 2 + 1 - 2) // 2 + 1 for f in frames]  # the tower's stride-2 conv, then pairwise pooling
    if spans != want:
        raise MropeError(f"audio spans of {spans} tokens, audio_seqlens {frames} give {want} (one per span, in "
                         f"reading order)")


def get_rope_index_omni(input_ids, image_grid_thw, attention_mask, *, image_token_id: int,
                        vision_start_token_id: int, video_token_id: int, audio_token_id: int,
                        audio_start_token_id: int, spatial_merge_size: int, audio_seqlens=None):
    """Qwen2.5-Omni's thinker, images and audio: input_ids i64[B,T], image_grid_thw i64[I,3] (or None: the
    text-only path), attention_mask {0,1}[B,T] (or None: every token real; transformers' thinker forward
    without a mask skips this index and counts 0..T-1 on all three rows instead, which differs once an image is
    present), audio_seqlens i64[A] (each audio's feature frames; needed for real audio tokens when images are
    present) -> (position_ids i64[3,B,T], rope_deltas i64[B,1]). Only real tokens are read: masked ones (LF's
    fake image and audio) keep the pad position, and a masked audio's length is never read."""
    input_ids = np.asarray(input_ids)
    B, T = input_ids.shape
    keep = _real_rows(attention_mask, B, T)
    real = input_ids[keep]
    if (real == video_token_id).any():
        raise MropeError(f"video token {video_token_id} present: the thinker places videos by rules not mirrored "
                         f"here")
    if image_grid_thw is None:
        if (real == image_token_id).any():
            raise MropeError(f"image tokens ({image_token_id}) present but no image_grid_thw")
        position_ids = np.cumsum(keep.astype(np.int64), axis=-1) - 1
        position_ids = np.where(keep, position_ids, 1)  # the thinker's pads sit at 1
        deltas = position_ids.max(-1, keepdims=True) + 1 - keep.sum(-1, keepdims=True)
        return np.broadcast_to(position_ids[None], (3, B, T)).copy(), deltas.astype(np.int64)
    rows = [input_ids[b][keep[b]].tolist() for b in range(B)]
    _check_audio(rows, audio_seqlens, audio_token_id, audio_start_token_id)  # then audio is text to the walk below
    grids = _llm_grids(image_grid_thw, spatial_merge_size)
    position_ids = np.ones((3, B, T), dtype=np.int64)  # pads keep 1
    deltas, image = [], 0
    for b, ids in enumerate(rows):
        if ids[-1] == vision_start_token_id:
            raise MropeError(f"row {b} ends in vision_start (transformers reads past the row)")
        starts = sum(1 for x, y in zip(ids, ids[1:]) if x == vision_start_token_id and y == image_token_id)
        blocks, st, used = [], 0, 0

        def after():  # where the next block starts: one past the largest position so far
            return int(blocks[-1].max()) + 1 if blocks else 0
        for _ in range(starts):
            ed = ids.index(image_token_id, st)
            text_len = ed - st - 1  # the text before this image's vision_start
            if ids[ed - 1] != vision_start_token_id or text_len < 0:
                raise MropeError(f"row {b}: the image tokens at {ed} do not follow a vision_start")
            if image == len(grids):
                raise MropeError(f"row {b}: more images than image_grid_thw has grids ({len(grids)})")
            t, h, w = grids[image]
            n = t * h * w
            if ids[ed:ed + n] != [image_token_id] * n or ed + n >= len(ids):
                raise MropeError(f"row {b}: image {image} needs {n} image tokens then vision_end from {ed}")
            if text_len:
                blocks.append(_text_block(after(), text_len))
            blocks.append(_text_block(after(), 1))  # vision_start
            blocks.append(_vision_positions(after(), grids[image]))
            blocks.append(_text_block(after(), 1))  # the token after the image (vision_end)
            st += text_len + 1 + n + 1
            image, used = image + 1, used + n
        if st < len(ids):
            blocks.append(_text_block(after(), len(ids) - st))
        if ids.count(image_token_id) != used:
            raise MropeError(f"row {b}: {ids.count(image_token_id)} image tokens, the images placed hold {used}")
        positions = np.concatenate(blocks, axis=1)
        position_ids[:, b, keep[b]] = positions
        deltas.append(int(positions.max()) + 1 - len(ids))
    if image != len(grids):
        raise MropeError(f"image_grid_thw has {len(grids)} grids, the tokens hold {image} images")
    return position_ids, np.asarray(deltas, dtype=np.int64)[:, None]


def text_positions(attention_mask) -> np.ndarray:  # {0,1}[B,T] -> i64[B,T]
    """generate's positions of a batch (`_prepare_position_ids_for_generation`): the mask's cumsum - 1,
    pads 0. A text-only batch in generate gets these on all three rows, with rope_deltas 0."""
    attention_mask = np.asarray(attention_mask)
    positions = np.cumsum(attention_mask.astype(np.int64), axis=-1) - 1
    return np.where(attention_mask == 0, 0, positions)


def decode_positions(attention_mask, rope_deltas) -> np.ndarray:  # {0,1}[B,S], i64[B,1] -> i64[3,B,S]
    """The positions of tokens after the prompt: text_positions of the full mask (prompt + new tokens)
    plus the prompt's rope_deltas, the same on all three rows; take the last columns for the new tokens.
    generate's own step (each row's last position + 1) agrees for a left-padded prompt that ends in text."""
    positions = text_positions(attention_mask) + np.asarray(rope_deltas, dtype=np.int64)
    return np.broadcast_to(positions[None], (3, *positions.shape)).copy()


# ---- cos / sin (jnp, jittable) --------------------------------------------------------------

def mrope_axes(mrope_section, half: int, interleaved: bool) -> np.ndarray:  # -> i64[half]
    """The position row (0 t, 1 h, 2 w) each of the `half` frequency pairs reads. Blocks (Qwen2-VL's
    `split(mrope_section)` taking row i % 3) or interleaved (Qwen3-VL: h at pairs 1, 4, .. below
    3 * section[1], w at 2, 5, .. below 3 * section[2], t the rest)."""
    section = [int(s) for s in mrope_section]
    if len(section) != 3 or min(section) < 0 or sum(section) != half:
        raise MropeError(f"mrope_section {list(mrope_section)} must be three counts summing to head_dim / 2 = {half}")
    if not interleaved:
        return np.repeat(np.arange(3, dtype=np.int64), section)
    axes = np.zeros(half, dtype=np.int64)
    axes[1:3 * section[1]:3] = 1
    axes[2:3 * section[2]:3] = 2
    counts = np.bincount(axes, minlength=3).tolist()
    if counts != section:  # transformers would silently rotate other counts than the config says
        raise MropeError(f"interleaved mrope_section {section} gives t/h/w {counts} pairs over {half}")
    return axes


def mrope_cos_sin(inv_freq, position_ids, mrope_section, interleaved: bool, attention_scaling: float = 1.0):
    """inv_freq f32[hd/2], position_ids i32[3,B,T] (or i32[B,T]: the same on all rows) -> (cos, sin)
    f32[B,T,hd] for layers.apply_rope, channel c taking the row of pair c % (hd/2)."""
    half = np.shape(inv_freq)[-1]
    axes = mrope_axes(mrope_section, half, interleaved)
    position_ids = jnp.asarray(position_ids)
    if position_ids.ndim == 2:
        position_ids = jnp.broadcast_to(position_ids[None], (3, *position_ids.shape))
    if position_ids.ndim != 3 or position_ids.shape[0] != 3:
        raise MropeError(f"position_ids must be [3,B,T] or [B,T], got {tuple(position_ids.shape)}")
    cos3, sin3 = rope_cos_sin(inv_freq, position_ids, attention_scaling)  # f32[3,B,T,hd]: every row, every pair
    channel = np.arange(2 * half)
    row = np.concatenate([axes, axes])  # rotate-half: pair i sits at channels i and i + hd/2
    return jnp.moveaxis(cos3, 0, -1)[..., channel, row], jnp.moveaxis(sin3, 0, -1)[..., channel, row]
