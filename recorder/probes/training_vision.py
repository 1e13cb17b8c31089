"""Record the vision-language checks of a training task (feature tags vision:qwen, pos:mrope, data:images;
catalog/checks.py) from the pure-PyTorch sources: the image processor on the task's shipped images, the vision
rope and M-RoPE positions, the tower's patch embed, one block, the merger and the whole tower, and the model's
logits and the loss's gradient with respect to the pixel values on a batch with images.

The twin of grader/probes/training_vision.py. Every input is drawn from numpy or read from the task's data dir;
the batch with images is built here from the shipped images and recorded whole (ids, mask, pixels, grids), so
the model-level checks never depend on a method's data pipeline.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

import numpy as np
import torch

from catalog.provenance import ROOT
from catalog.workloads import IMAGE_INPUTS, tower_outputs
from recorder.probes.training import n, rng_for, t

# two images of different shapes (their merge blocks cross both axes), then a third in a second row
VISION_GRIDS = np.array([[1, 4, 6], [1, 6, 4], [1, 2, 2]], np.int64)
IMAGE_ROWS = ((0,), (1, 2))  # which of the batch's images each row of the logits batch holds


def _visual(ctx):
    """The tower module (the family yaml's `vision_tower` path: Qwen2-VL's `visual`, Qwen3-VL's `model.visual`)."""
    return ctx.model.get_submodule(ctx.cfg.family.get("vision_tower", "visual"))


def _mm_plugin(ctx):
    return importlib.import_module("torch_sources.training.mm_plugin")


def _plugin(ctx):
    """The task template's mm plugin (LF's get_mm_plugin for the family's template)."""
    template = importlib.import_module("torch_sources.training.template").get_template(ctx.cfg.family.template)
    return template.mm_plugin


def shipped_images(data_dir: Path) -> list[str]:
    """The task's images: every PNG beside its data rows, by name."""
    return sorted(p.name for p in Path(data_dir).glob("*.png"))


def _processed_images(ctx, names):
    mm = _mm_plugin(ctx)
    images = mm.regularize_images(list(names), ROOT / ctx.cfg.data.dir, _plugin(ctx))
    return images, mm.get_mm_inputs(images, _plugin(ctx))


def probe_image_regularize(ctx):
    """Every shipped image decoded and through LF's regularization (max/min pixels, RGB, the Qwen2-VL size rules),
    exactly (uint8), and the processor's patch grids (smart_resize's rounding)."""
    names = shipped_images(ROOT / ctx.cfg.data.dir)
    images, (_, grid) = _processed_images(ctx, names)
    out = {f"regularized.{i}": np.asarray(im, np.uint8) for i, im in enumerate(images)}
    return {"paths": np.array(names)}, {**out, "image_grid_thw": n(grid).astype(np.int64)}


def probe_image_processor(ctx):
    """The HF processor's pixel values of every shipped image (bicubic resize, rescale, normalise, temporal
    patch, merge-block flattening)."""
    names = shipped_images(ROOT / ctx.cfg.data.dir)
    _, (pixels, _) = _processed_images(ctx, names)
    return {"paths": np.array(names)}, {"pixel_values": n(pixels)}


def probe_vision_rope(ctx):
    """Each patch's (row, column) in merge-block order and the tower's rotary cos/sin."""
    vision = importlib.import_module("torch_sources.models.vision")
    c = ctx.config.vision
    pos = vision.vision_rope_positions(t(VISION_GRIDS), c.spatial_merge_size)
    cos, sin = vision.vision_rope_cos_sin(pos, c.head_dim, c.rope_theta)
    return {"grid_thw": VISION_GRIDS}, {"positions": n(pos).astype(np.float32), "cos": n(cos), "sin": n(sin)}


def probe_vision_windows(ctx):
    """Qwen2.5-VL's windows over three images' merged tokens (window_index): the permutation and the bounds."""
    vision = importlib.import_module("torch_sources.models.vision")
    c = ctx.config.vision
    perm, cu = vision.window_index(t(VISION_GRIDS), c.window_size, c.spatial_merge_size, c.patch_size)
    return {"grid_thw": VISION_GRIDS}, {"perm": n(perm).astype(np.int64), "cu_window_seqlens": n(cu).astype(np.int64)}


def probe_audio_tower(ctx):
    """The audio tower on random log-mel frames of two audios: its output's shape, and whether it is all finite."""
    c, r = ctx.config.audio, rng_for("audio_tower")
    lengths = np.array([20, 13], np.int64)
    frames = r.standard_normal((c.num_mel_bins, int(lengths.sum()))).astype(np.float32)
    with torch.no_grad():
        out = n(ctx.model.audio_features(t(frames), t(lengths)))
    return {"input_features": frames, "feature_lens": lengths}, {
        "shape": np.array(out.shape, np.int64), "finite": np.array(np.isfinite(out).all(), np.int64)}


def _rows_with_images(ctx, name: str, grids, texts) -> tuple[np.ndarray, np.ndarray]:
    """Two right-padded rows of random text runs (lengths `texts[b]`) with an image span between consecutive runs:
    row 0 holds the first grid's image, row 1 the other two. -> ids i64[2,T], mask i64[2,T]."""
    c, r = ctx.config, rng_for(name)
    start, end, merge = c.vision_start_token_id, _vision_end_id(ctx), c.vision.spatial_merge_size ** 2
    spans = iter([start] + [c.image_token_id] * (int(np.prod(g)) // merge) + [end] for g in np.asarray(grids))
    rows = [[tok for k, run in enumerate(lengths) for tok in ([*next(spans)] if k else []) +
             [int(x) for x in r.integers(0, start - 9, run)]] for lengths in texts]
    T = max(map(len, rows)) + 2
    ids, mask = np.zeros((2, T), np.int64), np.zeros((2, T), np.int64)
    for b, row in enumerate(rows):
        ids[b, :len(row)], mask[b, :len(row)] = row, 1
    return ids, mask


def _mrope_case(ctx):
    """Row 0: text, an image (a 4x6 patch grid: 2x3 merged), text; row 1: text, two images (2x3 and 1x1 merged)
    with text between and after; right padding. Returns ids i64[2,T], grids i64[3,3], mask i64[2,T]."""
    ids, mask = _rows_with_images(ctx, "mrope", VISION_GRIDS, [(3, 4), (2, 1, 3)])
    return ids, VISION_GRIDS, mask


def _vision_end_id(ctx) -> int:
    """<|vision_end|>'s id from config.json (the model's config has no field for it: positions never read it); an
    Omni release keeps it in thinker_config."""
    d = json.loads((Path(ctx.ckpt) / "config.json").read_text())
    return int(d.get("thinker_config", d)["vision_end_token_id"])


def probe_mrope(ctx):
    """The rope index (transformers' get_rope_index: text runs, each image's t/h/w grid, padding) and the
    M-RoPE cos/sin of the decoder (its mrope_section split, interleaved or not)."""
    ids, grid, mask = _mrope_case(ctx)
    pos, deltas = ctx.model.rope_index(t(ids), t(grid), t(mask))
    inputs = ctx.family.layer_inputs(ctx.config, t(mask), pos)
    # three independent position rows at every token, so that each frequency pair's row shows (in the case
    # above only the image tokens' rows differ)
    rows = rng_for("mrope_rows").integers(0, 64, (3, *ids.shape)).astype(np.int64)
    spread = ctx.family.layer_inputs(ctx.config, t(np.ones_like(mask)), t(rows))
    return {"input_ids": ids, "image_grid_thw": grid, "attention_mask": mask, "position_rows": rows}, {
        "position_ids": n(pos).astype(np.float32), "rope_deltas": n(deltas).astype(np.float32),
        "cos": n(inputs.cos), "sin": n(inputs.sin), "cos_rows": n(spread.cos), "sin_rows": n(spread.sin)}


def _patches(ctx, name, grid=VISION_GRIDS[:2]):
    """Random pixel patches for `grid`'s images, in the processor's flattened (C, T, ps, ps) layout."""
    c = ctx.config.vision
    width = c.in_channels * c.temporal_patch_size * c.patch_size ** 2
    return rng_for(name).standard_normal((int(np.prod(grid, axis=1).sum()), width)).astype(np.float32)


def probe_patch_embed(ctx):
    x = _patches(ctx, "patch_embed")
    return {"pixel_values": x}, {"y": n(_visual(ctx).patch_embed(t(x)))}


def probe_vision_block(ctx):
    """The tower's block 0 on random patch states of two images: per-image attention (cu_seqlens from the grid)
    under the 2-D vision rope."""
    vision = importlib.import_module("torch_sources.models.vision")
    c, grid = ctx.config.vision, VISION_GRIDS[:2]
    width = _visual(ctx).blocks[0].norm1.weight.shape[0]
    x = rng_for("vision_block").standard_normal((int(np.prod(grid, axis=1).sum()), width)).astype(np.float32)
    cos, sin = vision.vision_rope_cos_sin(vision.vision_rope_positions(t(grid), c.spatial_merge_size), c.head_dim,
                                          c.rope_theta)
    out = _visual(ctx).blocks[0](t(x), vision.vision_cu_seqlens(t(grid)), cos, sin)
    return {"x": x, "grid_thw": grid}, {"out": n(out)}


def probe_vision_merger(ctx):
    width = _visual(ctx).blocks[0].norm1.weight.shape[0]
    x = rng_for("vision_merger").standard_normal((40, width)).astype(np.float32)
    return {"x": x}, {"out": n(_visual(ctx).merger(t(x)))}


def probe_deepstack(ctx):
    """add_deepstack on random hidden states: two rows, image positions scattered (row 1 holds more of them)."""
    r = rng_for("deepstack")
    hidden = r.standard_normal((2, 9, ctx.config.hidden_size)).astype(np.float32)
    mask = np.zeros((2, 9), bool)
    mask[0, [2, 3]], mask[1, [1, 4, 5, 6]] = True, True
    feats = r.standard_normal((int(mask.sum()), ctx.config.hidden_size)).astype(np.float32)
    return {"hidden": hidden, "visual_pos_masks": mask, "features": feats}, {
        "out": n(ctx.family.add_deepstack(t(hidden), t(mask), t(feats)))}


def probe_vision_tower(ctx):
    """The whole tower (patch embed, blocks, merger; Qwen3-VL: its deepstack features too) on the processed
    pixels of two shipped images."""
    _, (pixels, grid) = _processed_images(ctx, shipped_images(ROOT / ctx.cfg.data.dir)[:2])
    out = tower_outputs(ctx.model.encode_images(pixels, grid), n)
    return {"pixel_values": n(pixels), "image_grid_thw": n(grid)}, out


IMAGE_BATCH_TEXT = [(5, 6), (3, 2, 4)]  # text runs of each row; an image between consecutive runs


def _bound_template(ctx):
    """The task's template, its tower plugin bound to the processor files beside the tokenizer, and the fixed
    tokenizer (the training workflow's _fixed_tokenizer)."""
    tm = importlib.import_module("torch_sources.training.template")
    template = tm.get_template(ctx.cfg.family.template).bind(ROOT / ctx.cfg.family.tokenizer)
    return template, template.fix_special_tokens(tm.load_tokenizer(ROOT / ctx.cfg.family.tokenizer))


def _tower_image_batch(ctx, images) -> dict:
    """A fixed-size tower's batch: text runs with each image's tokens (the plugin's `<image>` expansion, encoded)
    between them, the plugin's token ids applied (PaliGemma's image tokens before the row), right-padded; the
    plugin's pixel values and extras (token types padded with 0, image sizes)."""
    template, tokenizer = _bound_template(ctx)
    plugin, r, mm = template.mm_plugin, rng_for("image_batch"), _mm_plugin(ctx)
    first_special = min(tokenizer.backend.get_added_tokens_decoder())  # text ids stay below every special one
    rows, k = [], 0
    for runs in IMAGE_BATCH_TEXT:
        row = []
        for j, run in enumerate(runs):
            if j:
                expanded = plugin.process_messages([{"role": "user", "content": mm.IMAGE_PLACEHOLDER}], [images[k]])
                row += tokenizer.encode(expanded[0]["content"])
                k += 1
            row += [int(x) for x in r.integers(0, first_special, run)]
        rows.append(plugin.process_token_ids(row, None, len(runs) - 1, tokenizer)[0])
    extra = plugin.get_mm_inputs(images, [len(runs) - 1 for runs in IMAGE_BATCH_TEXT], rows, tokenizer)
    T = max(map(len, rows)) + 2
    ids, mask = np.zeros((len(rows), T), np.int64), np.zeros((len(rows), T), np.int64)
    for b, row in enumerate(rows):
        ids[b, :len(row)], mask[b, :len(row)] = row, 1
    out = {"input_ids": ids, "attention_mask": mask, "pixel_values": n(extra["pixel_values"])}
    if "token_type_ids" in extra:
        out["token_type_ids"] = np.zeros_like(ids)
        for b, types in enumerate(extra["token_type_ids"]):
            out["token_type_ids"][b, :len(types)] = types
    if "image_sizes" in extra:
        out["image_sizes"] = n(extra["image_sizes"])
    return out


def image_batch(ctx):
    """A batch with images, built from the shipped images: row 0 holds one, row 1 two (with text between), row 0
    right-padded; pixels (and grids, token types or image sizes, by family) as the processor and plugin give them;
    labels on the text tokens only."""
    names = shipped_images(ROOT / ctx.cfg.data.dir)[:3]
    if isinstance(_plugin(ctx), _mm_plugin(ctx).TowerPlugin):
        images = _mm_plugin(ctx).regularize_images(list(names), ROOT / ctx.cfg.data.dir, _bound_template(ctx)[0].mm_plugin)
        batch = _tower_image_batch(ctx, images)
    else:
        _, (pixels, grid) = _processed_images(ctx, names)
        ids, mask = _rows_with_images(ctx, "image_batch", n(grid), IMAGE_BATCH_TEXT)
        batch = {"input_ids": ids, "attention_mask": mask, "pixel_values": n(pixels), "image_grid_thw": n(grid)}
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = np.where((mask == 1) & (ids != ctx.config.image_token_id), ids, -100)
    return batch, labels


def _tower_inputs(ctx, names) -> dict:
    """The bound plugin's pixel values (and image sizes) of the named shipped images, regularized by its rule."""
    template, tokenizer = _bound_template(ctx)
    images = _mm_plugin(ctx).regularize_images(list(names), ROOT / ctx.cfg.data.dir, template.mm_plugin)
    extra = template.mm_plugin.get_mm_inputs(images, [len(images)], [[]], tokenizer)
    return {k: n(v) for k, v in extra.items() if k != "token_type_ids"}


def probe_tower_pixels(ctx):
    """The processor's pixel values (and extras) of every shipped image, one image at a time."""
    names = shipped_images(ROOT / ctx.cfg.data.dir)
    out = {}
    for i, name in enumerate(names):
        out.update({f"{k}.{i}": v for k, v in _tower_inputs(ctx, [name]).items()})
    return {"paths": np.array(names)}, out


def probe_image_features(ctx):
    """encode_images on three shipped images' pixel values (with LLaVA-NeXT's image sizes)."""
    inputs = _tower_inputs(ctx, shipped_images(ROOT / ctx.cfg.data.dir)[:3])
    with torch.no_grad():
        rows = ctx.model.encode_images(t(inputs["pixel_values"]),
                                       **{k: t(v) for k, v in inputs.items() if k != "pixel_values"})
    return inputs, {"rows": n(rows)}


def _image_inputs(batch: dict) -> dict:
    return {k: t(batch[k]) for k in IMAGE_INPUTS if k in batch}


def probe_logits_images(ctx):
    """Full-model logits of the batch with images (Qwen-VL: positions from the model's own rope index)."""
    batch, _ = image_batch(ctx)
    with torch.no_grad():
        logits = ctx.model(t(batch["input_ids"]), t(batch["attention_mask"]), pixel_values=t(batch["pixel_values"]),
                           **_image_inputs(batch))
    return batch, {"logits": n(logits)}


def probe_pixel_grad(ctx):
    """The SFT loss of the batch with images (the token mean over its text labels) and its gradient with respect
    to the pixel values: image content through the tower, the merge into the sequence and every attended layer."""
    loss_mod = importlib.import_module("torch_sources.training.loss")
    batch, labels = image_batch(ctx)
    pixels = t(batch["pixel_values"]).clone().requires_grad_(True)
    logits = ctx.model(t(batch["input_ids"]), t(batch["attention_mask"]), pixel_values=pixels, **_image_inputs(batch))
    loss = loss_mod.causal_lm_loss(logits, t(labels), loss_mod.count_label_tokens(labels))
    (grad,) = torch.autograd.grad(loss, pixels)
    return {**batch, "labels": labels}, {"loss": np.float32(loss.item()), "grad": n(grad)}


PROBES = {name: globals()[f"probe_{name}"] for name in (
    "image_regularize", "image_processor", "vision_rope", "mrope", "patch_embed", "vision_windows", "vision_block",
    "vision_merger", "deepstack", "audio_tower", "vision_tower", "logits_images", "pixel_grad", "tower_pixels",
    "image_features")}
