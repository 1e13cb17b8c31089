"""Run the vision-language checks of a training task on a candidate (the twin of
recorder/probes/training_vision.py): the image processor on the task's shipped images, the vision rope and the
M-RoPE positions, the tower's patch embed, block 0, merger and whole tower, and the model's logits and pixel
gradient on the recorded batch with images. Inputs only; each through the candidate's public names."""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

from catalog.workloads import IMAGE_INPUTS, tower_outputs
from grader.probes.training import n


def _vision():
    return importlib.import_module("jax_oracles.models.vision")


def _plugin(ctx):
    return importlib.import_module("jax_oracles.training.template").get_template(ctx.template).mm_plugin


def _processed_images(ctx, paths):
    mm = importlib.import_module("jax_oracles.training.mm_plugin")
    images = mm.regularize_images([str(p) for p in paths], ctx.assets["data"], _plugin(ctx))
    return images, mm.get_mm_inputs(images, _plugin(ctx))


def probe_image_regularize(ctx, inp):
    images, (_, grid) = _processed_images(ctx, inp["paths"])
    return {**{f"regularized.{i}": np.asarray(im) for i, im in enumerate(images)},
            "image_grid_thw": np.asarray(grid).astype(np.int64)}


def probe_image_processor(ctx, inp):
    _, (pixels, _) = _processed_images(ctx, inp["paths"])
    return {"pixel_values": np.asarray(pixels)}


def probe_vision_rope(ctx, inp):
    c, vision = ctx.config.vision, _vision()
    pos = vision.vision_rope_positions(np.asarray(inp["grid_thw"]), c.spatial_merge_size)
    cos, sin = vision.vision_rope_cos_sin(pos, c.head_dim, c.rope_theta)
    return {"positions": np.asarray(pos).astype(np.float32), "cos": n(cos), "sin": n(sin)}


def probe_mrope(ctx, inp):
    ids, grid, mask = (np.asarray(inp[k]) for k in ("input_ids", "image_grid_thw", "attention_mask"))
    pos, deltas = ctx.model_class(ctx.config).rope_index(ids, grid, mask)
    inputs = ctx.family.layer_inputs(ctx.config, jnp.asarray(mask), jnp.asarray(pos))
    rows = np.asarray(inp["position_rows"])
    spread = ctx.family.layer_inputs(ctx.config, jnp.ones_like(jnp.asarray(mask)), jnp.asarray(rows))
    return {"position_ids": np.asarray(pos).astype(np.float32), "rope_deltas": np.asarray(deltas).astype(np.float32),
            "cos": n(inputs.cos), "sin": n(inputs.sin), "cos_rows": n(spread.cos), "sin_rows": n(spread.sin)}


def probe_vision_windows(ctx, inp):
    c = ctx.config.vision
    perm, cu = _vision().window_index(np.asarray(inp["grid_thw"]), c.window_size, c.spatial_merge_size, c.patch_size)
    return {"perm": np.asarray(perm).astype(np.int64), "cu_window_seqlens": np.asarray(cu).astype(np.int64)}


def probe_audio_tower(ctx, inp):
    model = ctx.model_class(ctx.config)
    out = n(model.apply({"params": ctx.params}, jnp.asarray(inp["input_features"]), np.asarray(inp["feature_lens"]),
                        method="audio_features"))
    return {"shape": np.array(out.shape, np.int64), "finite": np.array(np.isfinite(out).all(), np.int64)}


def _visual(ctx):
    """The tower's params (the family yaml's `vision_tower` path: visual, or model/visual)."""
    tree = ctx.params
    for key in ctx.meta["task"]["family"].get("vision_tower", "visual").split("."):
        tree = tree[key]
    return tree


def probe_patch_embed(ctx, inp):
    p = _visual(ctx)["patch_embed"]
    E, C, T, ps, _ = p["weight"].shape
    layer = _vision().PatchEmbed(E, C, T, ps, use_bias="bias" in p)
    return {"y": n(layer.apply({"params": p}, jnp.asarray(inp["pixel_values"])))}


def probe_vision_block(ctx, inp):
    c, vision = ctx.config.vision, _vision()
    grid = np.asarray(inp["grid_thw"])
    cos, sin = vision.vision_rope_cos_sin(vision.vision_rope_positions(grid, c.spatial_merge_size), c.head_dim,
                                          c.rope_theta)
    block = vision.vision_block(c)
    out = block.apply({"params": _visual(ctx)["blocks_0"]}, jnp.asarray(inp["x"]), vision.vision_cu_seqlens(grid),
                      jnp.asarray(cos), jnp.asarray(sin))
    return {"out": n(out)}


def probe_vision_merger(ctx, inp):
    merger = _vision().vision_merger(ctx.config.vision)
    return {"out": n(merger.apply({"params": _visual(ctx)["merger"]}, jnp.asarray(inp["x"])))}


def probe_deepstack(ctx, inp):
    out = ctx.family.add_deepstack(jnp.asarray(inp["hidden"]), jnp.asarray(inp["visual_pos_masks"]),
                                   jnp.asarray(inp["features"]))
    return {"out": n(out)}


def probe_vision_tower(ctx, inp):
    model = ctx.model_class(ctx.config)
    out = model.apply({"params": ctx.params}, jnp.asarray(inp["pixel_values"]), np.asarray(inp["image_grid_thw"]),
                      method="encode_images")
    return tower_outputs(out, n)


def _tower_inputs(ctx, paths) -> dict:
    """The candidate's bound plugin's pixel values (and image sizes) of the given shipped images."""
    tm = importlib.import_module("jax_oracles.training.template")
    mm = importlib.import_module("jax_oracles.training.mm_plugin")
    template = tm.get_template(ctx.template).bind(ctx.assets["tokenizer"])
    tokenizer = template.fix_special_tokens(tm.load_tokenizer(ctx.assets["tokenizer"]))
    images = mm.regularize_images([str(p) for p in paths], ctx.assets["data"], template.mm_plugin)
    extra = template.mm_plugin.get_mm_inputs(images, [len(images)], [[]], tokenizer)
    return {k: np.asarray(v) for k, v in extra.items() if k != "token_type_ids"}


def probe_tower_pixels(ctx, inp):
    out = {}
    for i, path in enumerate(inp["paths"]):
        out.update({f"{k}.{i}": v for k, v in _tower_inputs(ctx, [str(path)]).items()})
    return out


def probe_image_features(ctx, inp):
    extra = {k: np.asarray(inp[k]) for k in inp if k != "pixel_values"}
    rows = ctx.model_class(ctx.config).apply({"params": ctx.params}, jnp.asarray(inp["pixel_values"]),
                                            method="encode_images", **extra)
    return {"rows": n(rows)}


def _image_batch(inp):
    """The recorded batch: ids, mask, pixels and the family's image keywords (grids, token types, image sizes)."""
    extra = {k: np.asarray(inp[k]) for k in IMAGE_INPUTS if k in inp}
    return np.asarray(inp["input_ids"]), np.asarray(inp["attention_mask"]), jnp.asarray(inp["pixel_values"]), extra


def probe_logits_images(ctx, inp):
    ids, mask, pixels, extra = _image_batch(inp)
    logits = ctx.model_class(ctx.config).apply({"params": ctx.params}, ids, mask, pixel_values=pixels, **extra)
    return {"logits": n(logits)}


def probe_pixel_grad(ctx, inp):
    loss_mod = importlib.import_module("jax_oracles.training.loss")
    ids, mask, pixels, extra = _image_batch(inp)
    labels = np.asarray(inp["labels"])
    model = ctx.model_class(ctx.config)

    def loss_fn(pixel_values):
        logits = model.apply({"params": ctx.params}, ids, mask, pixel_values=pixel_values, **extra)
        return loss_mod.causal_lm_loss(logits, jnp.asarray(labels), loss_mod.count_label_tokens(labels))

    loss, grad = jax.value_and_grad(loss_fn)(pixels)
    return {"loss": np.float32(loss), "grad": n(grad)}


PROBES = {name: globals()[f"probe_{name}"] for name in (
    "image_regularize", "image_processor", "vision_rope", "mrope", "patch_embed", "vision_windows", "vision_block",
    "vision_merger", "deepstack", "audio_tower", "vision_tower", "logits_images", "pixel_grad", "tower_pixels",
    "image_features")}
