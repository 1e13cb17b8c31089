"""Record the serving checks of a vision-language family (features pos:mrope, vision:qwen) from the torch engine.

Images are the shipped ones (assets/images, raw uint8 in the inputs); prompts name each image with one image
token, as a vLLM tokens prompt does, and the engine expands it. The JAX twin is grader/probes/serving_vision.py.
"""
from __future__ import annotations

import importlib

import numpy as np

from catalog.workloads import TOP_LOGPROBS, image_prompts, image_workload_config, pad_rows, prompt_logprob_arrays, \
    run_image_workload, step_image_outputs
from recorder.probes.training import ROOT, n, rng_for
from torch_sources.models.loading import load_config
from torch_sources.models.vision_processing import load_image

# Several sizes and aspect ratios (12, 15, 4, 4 and 8 image rows): one image's windows span several merge blocks,
# one is wide, two are small, one is upscaled past min_pixels
IMAGE_NAMES = ("exact_112x84", "wide_150x90", "gradient_64x48", "portrait_40x100", "gray_20x60")


def sv(name):
    return importlib.import_module(f"torch_sources.serving.{name}")


def images() -> list[np.ndarray]:
    return [load_image(ROOT / "assets/images" / f"{name}.png") for name in IMAGE_NAMES]


def _special(ctx) -> tuple[int, int, int]:
    """(vision start, image, vision end) token ids, from the checkpoint's config.json."""
    d = load_config(ctx.ckpt)
    return int(d["vision_start_token_id"]), int(d["image_token_id"]), int(d["vision_end_token_id"])


def _text(r, k: int) -> list[int]:
    return [int(x) for x in r.integers(3, 400, k)]  # ids below the special tokens (400+)


def _image_prompt(ctx, name: str, pieces) -> list[int]:
    """pieces: ints (that many text tokens) and "img" (one image, framed as the chat template frames it)."""
    vs, img, ve = _special(ctx)
    r, out = rng_for(f"{ctx.cfg.task_name}/{name}"), []
    for p in pieces:
        out += [vs, img, ve] if p == "img" else _text(r, p)
    return out


def _image_inputs(ctx):
    return {f"image_{i}": im for i, im in enumerate(images())}


# ---- L1 / L2 / L3 ------------------------------------------------------------------------------

def _two_image_prompt(ctx):
    return np.array(_image_prompt(ctx, "two_images", (4, "img", 3, "img", 5)), np.int32), np.array([1, 0], np.int64)


def probe_image_inputs(ctx):
    ids, which = _two_image_prompt(ctx)
    imgs = images()
    expanded, placeholders, processed = ctx.runner.prepare_images(ids.tolist(), [imgs[i] for i in which])
    return {"token_ids": ids, "image_ids": which, **_image_inputs(ctx)}, {
        "prompt_token_ids": np.array(expanded, np.int64),
        "offsets": np.array([p[0] for p in placeholders], np.int64),
        "lengths": np.array([p[1] for p in placeholders], np.int64),
        "image_grid_thw": np.array([x.image_grid_thw for x in processed], np.int64)}


def probe_mrope_positions(ctx):
    ids, which = _two_image_prompt(ctx)
    imgs = images()
    expanded, _, processed = ctx.runner.prepare_images(ids.tolist(), [imgs[i] for i in which])
    table, delta = ctx.runner.family.mrope_positions(ctx.config, expanded, [x.image_grid_thw for x in processed])
    return {"prompt_token_ids": np.array(expanded, np.int32),
            "image_grid_thw": np.array([x.image_grid_thw for x in processed], np.int64)}, {
        "positions": np.asarray(table, np.int64), "delta": np.array(delta, np.int64)}


def probe_encoder_outputs(ctx):
    fam, out = ctx.runner.family, {}
    for i, im in enumerate(images()):
        pixels, grid = fam.process_image(ctx.config, im)
        out[f"pixel_values_{i}"] = n(pixels) if hasattr(pixels, "detach") else np.asarray(pixels, np.float32)
        out[f"rows_{i}"] = n(fam.embed_multimodal(ctx.runner.model, pixels, grid))
    return _image_inputs(ctx), out


def probe_prefill_images(ctx):
    ids, which = _two_image_prompt(ctx)
    imgs = images()
    logits = ctx.fresh_runner().prefill_logits(ids.tolist(), [imgs[i] for i in which])
    return {"token_ids": ids, "image_ids": which, **_image_inputs(ctx)}, {"logits": n(logits)}


def step_image_case(ctx):
    """One ragged step over two image prompts: request 0 a chunk that starts inside its first image and ends
    inside its second; request 1 a recompute past its prompt (its output tokens at position + delta); request 2
    one decode of the same prompt. -> inputs: each request's tokens (expanded prompt, then outputs), placeholder
    offsets / lengths / image ids, prompt length, M-RoPE table and delta, and the step's flat positions and
    query starts (padded to a bucket of 32)."""
    imgs = images()
    r = rng_for(f"{ctx.cfg.task_name}/step_image_case")
    first = _image_prompt(ctx, "step_image_0", (3, "img", 2, "img", 3))
    second = _image_prompt(ctx, "step_image_1", (2, "img", 4))
    case, rows = {}, []
    for k, (prompt, which, outputs, (lo, hi)) in enumerate([(first, [1, 0], 0, (10, 28)), (second, [2], 3, (9, 15)),
                                                            (second, [2], 5, (16, 17))]):
        ids, placeholders, processed = ctx.runner.prepare_images(prompt, [imgs[i] for i in which])
        table, delta = ctx.runner.family.mrope_positions(ctx.config, ids, [x.image_grid_thw for x in processed])
        case.update({f"tokens_{k}": np.array(ids + _text(r, outputs), np.int64),
                     f"offsets_{k}": np.array([p[0] for p in placeholders], np.int64),
                     f"lengths_{k}": np.array([p[1] for p in placeholders], np.int64),
                     f"image_ids_{k}": np.array(which, np.int64), f"num_prompt_{k}": np.array(len(ids), np.int64),
                     f"table_{k}": np.asarray(table, np.int64), f"delta_{k}": np.array(delta, np.int64)})
        rows.append(list(range(lo, hi)))
    case["positions"] = pad_rows([sum(rows, [])], 32, 0)[0]
    case["query_start_loc"] = np.cumsum([0] + [len(x) for x in rows]).astype(np.int64)
    return case


def probe_step_image_inputs(ctx):
    case = step_image_case(ctx)
    imgs = images()
    out = step_image_outputs(case, sv("request").Request, sv("input_batch").BatchMetadata, sv("input_batch"),
                             sv("multimodal").image_hash, imgs)
    return {**case, **_image_inputs(ctx)}, out


# ---- L5 / L6 -----------------------------------------------------------------------------------

def image_workload(ctx):
    """(prompt rows, image ids per row): a new image; one prompt showing one image twice around another (it runs
    once); a long text before its images (a chunk that ends before an image); the first image again after the
    same text (its encoder output and prefix blocks reused); a prompt sharing the second's first block (text and
    vision-start) with another image behind it (a waiting request whose chunk starts at an image the step cannot
    encode); two new images side by side, more rows than the encoder budget (16) takes at once, so the second waits
    a step (a running request whose chunk starts at an image that does not fit); text only; the first prompt with
    another image (no block past the image shared); a long prompt with a small image; a late image that makes the
    encoder cache evict (the oldest unreferenced); meanwhile images held by running requests fill the cache."""
    vs, img, ve = _special(ctx)
    r = rng_for(f"{ctx.cfg.task_name}/image_workload")
    head, tail, shared = _text(r, 6), _text(r, 5), _text(r, 3)
    image = [vs, img, ve]
    rows = [head + image + tail,
            shared + image * 3,
            _text(r, 19) + image * 2,
            head + image + _text(r, 7),
            shared + image,
            _text(r, 2) + image * 2 + _text(r, 3),
            _text(r, 12),
            head + image + tail,
            _text(r, 3) + image + _text(r, 20),
            _text(r, 5) + image + _text(r, 6)]
    image_ids = [[0], [1, 3, 1], [4, 2], [0], [4], [3, 1], [], [1], [2], [4]]
    return pad_rows(rows), pad_rows(image_ids)


def _image_index(imgs) -> dict:
    mm = sv("multimodal")
    return {mm.image_hash(im): i for i, im in enumerate(imgs)}


def probe_image_workload(ctx):
    vision = ctx.cfg.vision
    prompts, image_ids = image_workload(ctx)
    imgs = images()

    def run(**limits):
        engine = sv("engine").LLMEngine(ctx.ckpt, image_workload_config(ctx.engine_config, {**vision, **limits}))
        return run_image_workload(engine, image_prompts(prompts, image_ids, imgs), sv("config").SamplingParams,
                                  int(vision["max_tokens"]), _image_index(imgs))

    out, config = run(), image_workload_config(ctx.engine_config, vision)
    # the workload must reach what it is for: encoder-cache hits (fewer runs than images), an eviction, a schedule
    # the encoder budget and the cache size both change, and (beyond core mode) a preemption
    free = dict(encoder_budget=10 ** 6, encoder_cache=10 ** 6)
    budget_bites = not np.array_equal(out["num_scheduled_tokens"], run(encoder_budget=10 ** 6)["num_scheduled_tokens"])
    cache_bites = not np.array_equal(out["encoder_runs"], run(**free)["encoder_runs"])
    num_images = int((image_ids >= 0).sum())
    if (int(out["num_encoder_runs"]) >= num_images or not (out["freed_images"] >= 0).any() or not budget_bites
            or not cache_bites or (int(out["num_preemptions"]) == 0 and config.max_running > 1)):
        raise ValueError(f"the image workload of {ctx.cfg.task_name} misses a branch: {int(out['num_encoder_runs'])} "
                         f"encoder runs for {num_images} images, evictions {out['freed_images'].max()}, the budget "
                         f"changes the schedule: {budget_bites}, the cache: {cache_bites}, "
                         f"{int(out['num_preemptions'])} preemptions")
    return {"prompts": prompts, "image_ids": image_ids, **_image_inputs(ctx),
            **{k: np.array(int(vision[k]), np.int64) for k in ("num_blocks", "encoder_budget", "encoder_cache",
                                                              "max_tokens")}}, out


def heldout_image_prompts(ctx):
    rows = [_image_prompt(ctx, "heldout_image_0", (5, "img", 8)),
            _image_prompt(ctx, "heldout_image_1", (3, "img", 4, "img", 6))]
    return pad_rows(rows), pad_rows([[0], [3, 2]])


def probe_heldout_logprobs_images(ctx):
    prompts, image_ids = heldout_image_prompts(ctx)
    outs = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config).generate(
        image_prompts(prompts, image_ids, images()),
        sv("config").SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_LOGPROBS))
    out = {}
    for i, o in enumerate(outs):
        out[f"prompt_{i}"], out[f"top_{i}"] = prompt_logprob_arrays(o, TOP_LOGPROBS)
    return {"prompts": prompts, "image_ids": image_ids, **_image_inputs(ctx)}, out


PROBES = {"image_inputs": probe_image_inputs, "mrope_positions": probe_mrope_positions,
          "step_image_inputs": probe_step_image_inputs,
          "encoder_outputs": probe_encoder_outputs, "prefill_images": probe_prefill_images,
          "image_workload": probe_image_workload, "heldout_logprobs_images": probe_heldout_logprobs_images}
