"""M-RoPE, the multimodal rotary positions of the Qwen vision-language families, exactly as transformers
5.24 computes them; jax_oracles/models/mrope.py is its twin.

Every token gets three positions (temporal, height, width). Text tokens count up by one on all three rows;
the n merged patches of an image sit on a (t, h, w) grid that starts where the text left off, and the text
after the image resumes at start + max(h, w). `rope_deltas` = (largest position + 1) - (real tokens): what
decoding adds to the plain text position of each new token (`decode_positions`).

Two rules place images (videos are refused):
- `get_rope_index`: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (`Qwen2VLModel.get_rope_index`; 2.5-VL and 3-VL are the
  same for images). The image spans are the runs of `mm_token_type_ids == 1` (the processor's
  `create_mm_token_type_ids`: `token_types` here), not the token ids; pad tokens get position 0. The
  forward calls it only when `image_grid_thw` is given; a text-only forward gets 0..T-1 whatever the padding
  (layers.default_positions), while `generate` gives text the mask's cumsum - 1 (`text_positions`).
- `get_rope_index_omni`: Qwen2.5-Omni's thinker (`get_rope_index` of modeling_qwen2_5_omni.py). It finds each
  image from token ids (a vision_start followed by an image token), chains blocks at the previous block's
  largest position + 1, and gives pad tokens position 1. Its forward calls it whenever a mask is given, so a
  text-only batch takes its own path too: cumsum - 1, pads 1, the delta from the row's largest position
  (pads included). An audio (audio_start, n audio tokens, audio_end) is three blocks of consecutive positions,
  so it sits exactly where text would: outside audio-in-video (refused with videos) the thinker's audio rule
  moves no position. What it needs is n to be the audio's tower length from `audio_seqlens` (its feature
  frames, LF's feature_attention_mask.sum(-1)): with images present transformers walks the row by those
  counts, and a span of another length would misplace everything after it, so that is checked.

`mrope_cos_sin` merges the three rows' cos/sin into one f32[B,T,hd] table, pair i reading row
`mrope_axes(...)[i]`: Qwen2-VL / 2.5-VL / Omni in contiguous blocks (t | h | w, `mrope_section` pairs
each), Qwen3-VL interleaved (t h w t h w ..., the leftover pairs t), so layers.apply_rope applies it. Index
work is host-side Python over lists (it is data-dependent); the grids are checked against the tokens.
"""

from __future__ import annotations

import itertools

import torch

from torch_sources.models.rope import rope_cos_sin

__all__ = ["MropeError", "token_types", "get_rope_index", "audio_spans", "get_rope_index_omni", "text_positions",
           "decode_positions", "mrope_axes", "mrope_cos_sin"]

TEXT, IMAGE, VIDEO = 0, 1, 2  # mm_token_type_ids values (the processor also writes 3 for audio)


class MropeError(ValueError):
    """Inputs M-RoPE will not place: the message names the row, the image or the key."""


# ---- position index -------------------------------------------------------------------------

def token_types(input_ids, *, image_token_id: int, video_token_id: int | None = None):  # i64[B,T] -> i64[B,T]
    """The processor's `mm_token_type_ids`: 1 at image tokens, 2 at video tokens, 0 elsewhere."""
    types = (input_ids == image_token_id).long()
    if video_token_id is not None:
        types = types.masked_fill(input_ids == video_token_id, VIDEO)
    return types


def _llm_grids(image_grid_thw, spatial_merge_size: int) -> list[tuple[int, int, int]]:
    """i64[I,3] -> the (t, h, w) grid of merged patches of each image, as the language model sees it."""
    if image_grid_thw is None:
        return []
    grids = []
    for i, (t, h, w) in enumerate(image_grid_thw.tolist()):
        if t != 1:
            raise MropeError(f"image {i}: grid t={t}; a still image is one temporal patch (t > 1 is a video, "
                             f"which M-RoPE here does not place)")
        if h % spatial_merge_size or w % spatial_merge_size:
            raise MropeError(f"image {i}: grid h={h}, w={w} is not divisible by spatial_merge_size="
                             f"{spatial_merge_size}")
        grids.append((t, h // spatial_merge_size, w // spatial_merge_size))
    return grids


def _vision_positions(start: int, grid: tuple[int, int, int]):  # -> i64[3, t*h*w]
    """The image's patches in reading order (t, then h, then w), each row offset by `start`."""
    t, h, w = grid
    tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def _text_block(start: int, n: int):  # -> i64[3,n]
    return (torch.arange(n) + start).expand(3, n)


def _real_rows(attention_mask, B: int, T: int):  # -> bool[B,T]: the tokens a row's positions count
    if attention_mask is None:
        return torch.ones(B, T, dtype=torch.bool)
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise MropeError("attention_mask must hold only 0 and 1")
    keep = attention_mask.bool()
    empty = (~keep.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise MropeError(f"rows {empty} have no real token (transformers fails on an empty row)")
    return keep


def get_rope_index(input_ids, image_grid_thw, attention_mask, *, mm_token_type_ids, spatial_merge_size: int):
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: input_ids i64[B,T], image_grid_thw i64[I,3] (every image of the
    batch in reading order, or None), attention_mask {0,1}[B,T] (or None), mm_token_type_ids i64[B,T] ->
    (position_ids i64[3,B,T], rope_deltas i64[B,1]). Each run of type-1 tokens takes the next grid."""
    B, T = input_ids.shape
    types = mm_token_type_ids
    if tuple(types.shape) != (B, T):
        raise MropeError(f"mm_token_type_ids {tuple(types.shape)} and input_ids {(B, T)} differ in shape")
    found = sorted(set(types.unique().tolist()) - {TEXT, IMAGE})
    if found:
        raise MropeError(f"mm_token_type_ids holds {found}: only text (0) and images (1) are placed (2 video, "
                         f"3 audio are out of scope)")
    grids = _llm_grids(image_grid_thw, spatial_merge_size)
    keep = _real_rows(attention_mask, B, T)
    position_ids = torch.zeros(3, B, T, dtype=torch.long)  # pads keep 0
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
        positions = torch.cat(blocks, dim=1)  # i64[3, real tokens]
        position_ids[:, b, keep[b]] = positions
        deltas.append(int(positions.max()) + 1 - len(row))
    if image != len(grids):
        raise MropeError(f"image_grid_thw has {len(grids)} grids, the tokens hold {image} images")
    return position_ids, torch.tensor(deltas, dtype=torch.long)[:, None]


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
    B, T = input_ids.shape
    keep = _real_rows(attention_mask, B, T)
    real = input_ids[keep]
    if bool((real == video_token_id).any()):
        raise MropeError(f"video token {video_token_id} present: the thinker places videos by rules not mirrored "
                         f"here")
    if image_grid_thw is None:
        if bool((real == image_token_id).any()):
            raise MropeError(f"image tokens ({image_token_id}) present but no image_grid_thw")
        position_ids = keep.long().cumsum(-1) - 1
        position_ids = position_ids.masked_fill(~keep, 1)  # the thinker's pads sit at 1
        deltas = position_ids.max(-1, keepdim=True).values + 1 - keep.long().sum(-1, keepdim=True)
        return position_ids[None].expand(3, B, T).clone(), deltas
    rows = [input_ids[b][keep[b]].tolist() for b in range(B)]
    _check_audio(rows, audio_seqlens, audio_token_id, audio_start_token_id)  # then audio is text to the walk below
    grids = _llm_grids(image_grid_thw, spatial_merge_size)
    position_ids = torch.ones(3, B, T, dtype=torch.long)  # pads keep 1
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
        positions = torch.cat(blocks, dim=1)
        position_ids[:, b, keep[b]] = positions
        deltas.append(int(positions.max()) + 1 - len(ids))
    if image != len(grids):
        raise MropeError(f"image_grid_thw has {len(grids)} grids, the tokens hold {image} images")
    return position_ids, torch.tensor(deltas, dtype=torch.long)[:, None]


def text_positions(attention_mask):  # {0,1}[B,T] -> i64[B,T]
    """generate's positions of a batch (`_prepare_position_ids_for_generation`): the mask's cumsum - 1,
    pads 0. A text-only batch in generate gets these on all three rows, with rope_deltas 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


def decode_positions(attention_mask, rope_deltas):  # {0,1}[B,S], i64[B,1] -> i64[3,B,S]
    """The positions of tokens after the prompt: text_positions of the full mask (prompt + new tokens)
    plus the prompt's rope_deltas, the same on all three rows; take the last columns for the new tokens.
    generate's own step (each row's last position + 1) agrees for a left-padded prompt that ends in text."""
    return (text_positions(attention_mask) + rope_deltas)[None].expand(3, -1, -1).clone()


# ---- cos / sin ------------------------------------------------------------------------------

def mrope_axes(mrope_section, half: int, interleaved: bool):  # -> i64[half]
    """The position row (0 t, 1 h, 2 w) each of the `half` frequency pairs reads. Blocks (Qwen2-VL's
    `split(mrope_section)` taking row i % 3) or interleaved (Qwen3-VL: h at pairs 1, 4, .. below
    3 * section[1], w at 2, 5, .. below 3 * section[2], t the rest)."""
    section = [int(s) for s in mrope_section]
    if len(section) != 3 or min(section) < 0 or sum(section) != half:
        raise MropeError(f"mrope_section {list(mrope_section)} must be three counts summing to head_dim / 2 = {half}")
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    axes = torch.zeros(half, dtype=torch.long)
    axes[1:3 * section[1]:3] = 1
    axes[2:3 * section[2]:3] = 2
    counts = torch.bincount(axes, minlength=3).tolist()
    if counts != section:  # transformers would silently rotate other counts than the config says
        raise MropeError(f"interleaved mrope_section {section} gives t/h/w {counts} pairs over {half}")
    return axes


def mrope_cos_sin(inv_freq, position_ids, mrope_section, interleaved: bool, attention_scaling: float = 1.0):
    """inv_freq f32[hd/2], position_ids i64[3,B,T] (or i64[B,T]: the same on all rows) -> (cos, sin)
    f32[B,T,hd] for layers.apply_rope, channel c taking the row of pair c % (hd/2)."""
    half = inv_freq.shape[-1]
    axes = mrope_axes(mrope_section, half, interleaved)
    if position_ids.ndim == 2:
        position_ids = position_ids[None].expand(3, -1, -1)
    if position_ids.ndim != 3 or position_ids.shape[0] != 3:
        raise MropeError(f"position_ids must be [3,B,T] or [B,T], got {tuple(position_ids.shape)}")
    cos3, sin3 = rope_cos_sin(inv_freq, position_ids, attention_scaling)  # f32[3,B,T,hd]: every row, every pair
    channel = torch.arange(2 * half, device=position_ids.device)
    row = torch.cat([axes, axes]).to(position_ids.device)  # rotate-half: pair i sits at channels i and i + hd/2
    return cos3.movedim(0, -1)[..., channel, row], sin3.movedim(0, -1)[..., channel, row]
