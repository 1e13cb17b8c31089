"""Run the serving checks of a vision-language family (features pos:mrope, vision:qwen) on a candidate: the twin
of recorder/probes/serving_vision.py. The images come as raw uint8 arrays in the inputs (`image_<i>`)."""
from __future__ import annotations

import importlib

import numpy as np

from catalog.workloads import TOP_LOGPROBS, image_prompts, image_workload_config, prompt_logprob_arrays, \
    run_image_workload, step_image_outputs
from grader.probes.common import n


def sv(name):
    return importlib.import_module(f"serving_engine.{name}")


def _images(inp) -> list[np.ndarray]:
    return [np.asarray(inp[f"image_{i}"]) for i in range(len([k for k in inp if k.startswith("image_") and
                                                               k[6:].isdigit()]))]


def _chosen(inp):
    imgs = _images(inp)
    return [imgs[int(i)] for i in inp["image_ids"]]


def probe_image_inputs(ctx, inp):
    expanded, placeholders, processed = ctx.runner.prepare_images([int(x) for x in inp["token_ids"]], _chosen(inp))
    return {"prompt_token_ids": np.array(expanded, np.int64),
            "offsets": np.array([p[0] for p in placeholders], np.int64),
            "lengths": np.array([p[1] for p in placeholders], np.int64),
            "image_grid_thw": np.array([x.image_grid_thw for x in processed], np.int64)}


def probe_mrope_positions(ctx, inp):
    grids = [tuple(int(x) for x in g) for g in inp["image_grid_thw"]]
    table, delta = ctx.runner.family.mrope_positions(ctx.config, [int(x) for x in inp["prompt_token_ids"]], grids)
    return {"positions": np.asarray(table, np.int64), "delta": np.array(delta, np.int64)}


def probe_encoder_outputs(ctx, inp):
    fam, out = ctx.runner.family, {}
    for i, im in enumerate(_images(inp)):
        pixels, grid = fam.process_image(ctx.config, im)
        out[f"pixel_values_{i}"] = np.asarray(pixels, np.float32)
        out[f"rows_{i}"] = n(fam.embed_multimodal(ctx.runner.model, pixels, grid))
    return out


def probe_prefill_images(ctx, inp):
    return {"logits": n(ctx.fresh_runner().prefill_logits([int(x) for x in inp["token_ids"]], _chosen(inp)))}


def probe_image_workload(ctx, inp):
    imgs = _images(inp)
    vision = {k: int(inp[k]) for k in ("num_blocks", "encoder_budget", "encoder_cache", "max_tokens")}
    engine = sv("engine").LLMEngine(ctx.ckpt, image_workload_config(ctx.engine_config, vision))
    index = {sv("multimodal").image_hash(im): i for i, im in enumerate(imgs)}
    return run_image_workload(engine, image_prompts(inp["prompts"], inp["image_ids"], imgs),
                              sv("config").SamplingParams, vision["max_tokens"], index)


def probe_heldout_logprobs_images(ctx, inp):
    outs = sv("engine").LLMEngine(ctx.ckpt, ctx.engine_config).generate(
        image_prompts(inp["prompts"], inp["image_ids"], _images(inp)),
        sv("config").SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_LOGPROBS))
    out = {}
    for i, o in enumerate(outs):
        out[f"prompt_{i}"], out[f"top_{i}"] = prompt_logprob_arrays(o, TOP_LOGPROBS)
    return out


PROBES = {"image_inputs": probe_image_inputs, "mrope_positions": probe_mrope_positions,
          "encoder_outputs": probe_encoder_outputs, "prefill_images": probe_prefill_images,
          "image_workload": probe_image_workload, "heldout_logprobs_images": probe_heldout_logprobs_images}


def probe_step_image_inputs(ctx, inp):
    return step_image_outputs(inp, sv("request").Request, sv("input_batch").BatchMetadata, sv("input_batch"),
                              sv("multimodal").image_hash, _images(inp))


PROBES["step_image_inputs"] = probe_step_image_inputs
