"""Requests with images through both engines (Qwen2.5-VL, the shipped tiny checkpoint), as vLLM v1 serves them.

Greedy ids equal transformers' `generate` with the same images; the JAX engine equals the torch engine step for
step (outputs, the encoder schedule, the encoder cache's evictions) under an encoder budget that makes an image
wait, chunk boundaries inside placeholder ranges, a shared image, and a preemption; the prefix cache tells
prompts apart by their images. The host-side rules themselves are tests/serving/test_mm_scheduling.py's.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from serving_engine import config as jc
from serving_engine import engine as je
from torch_sources.models import vision_processing as tvp
from torch_sources.serving import config as tc
from torch_sources.serving import engine as te

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/qwen2_5_vl"
VS, VE, IMG = 409, 410, 412  # <|vision_start|>, <|vision_end|>, <|image_pad|>
A = tvp.load_image(ROOT / "assets/images/exact_112x84.png")  # 12 image tokens
B = tvp.load_image(ROOT / "assets/images/wide_150x90.png")  # 15 image tokens
SIDES = {"torch": (te, tc), "jax": (je, jc)}


def _prompts():
    """One image; the same image after other text (an encoder-cache hit); two images, the first new; text only."""
    return [{"prompt_token_ids": [401, 5, 6, VS, IMG, VE, 8, 9], "multi_modal_data": {"image": [A]}},
            {"prompt_token_ids": [401, 5, 6, VS, IMG, VE, 11, 12, 13], "multi_modal_data": {"image": [A]}},
            {"prompt_token_ids": [401, 7, VS, IMG, VE, 3, VS, IMG, VE, 14], "multi_modal_data": {"image": [B, A]}},
            [401, 20, 21, 22, 23, 24]]


def _config(cfg_mod, **kw):
    # 16-token chunks cut inside every image; an encoder budget of 20 rows cannot take B (15) and A (12) at once
    base = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=96,
                enable_prefix_caching=True, mode="chunked", max_num_encoder_input_tokens=20, encoder_cache_size=40,
                record_trace=True)
    return cfg_mod.EngineConfig(**{**base, **kw})


def _run(side, prompts, max_tokens=6, **kw):
    mod, cfg_mod = SIDES[side]
    engine = mod.LLMEngine(CKPT, _config(cfg_mod, **kw))
    outs = engine.generate(prompts, cfg_mod.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return engine, [o.output_token_ids for o in outs]


def _trace(engine):
    return [(s.scheduled_req_ids, s.num_scheduled_tokens, s.preempted_req_ids, s.scheduled_encoder_inputs,
             s.freed_mm_hashes) for s in engine.scheduler.trace]


@pytest.fixture(scope="module")
def runs():
    return {side: _run(side, _prompts()) for side in SIDES}


def test_greedy_ids_equal_transformers_generate(runs):
    from transformers import Qwen2_5_VLForConditionalGeneration
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(CKPT, attn_implementation="eager",
                                                            dtype=torch.float32).eval()
    engine, outs = runs["torch"]
    for k, prompt in enumerate(_prompts()):
        images = prompt["multi_modal_data"]["image"] if isinstance(prompt, dict) else []
        ids = engine.runner.prepare_images(prompt["prompt_token_ids"] if images else prompt, images)[0]
        kwargs = {}
        if images:
            pixels, grid = tvp.process_images(images, tvp.QwenImageProcessorConfig.qwen2_vl())
            kwargs = dict(pixel_values=pixels, image_grid_thw=grid)
        x = torch.tensor([ids])
        with torch.no_grad():
            got = hf.generate(x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == IMG).long(),
                              max_new_tokens=6, min_new_tokens=6, do_sample=False, **kwargs)
        want = got[0, len(ids):].tolist()
        assert outs[k] == want, (k, outs[k], want)
        assert runs["jax"][1][k] == want, (k, runs["jax"][1][k], want)


def test_the_engines_agree_step_for_step(runs):
    (t_engine, t_outs), (j_engine, j_outs) = runs["torch"], runs["jax"]
    assert t_outs == j_outs and _trace(t_engine) == _trace(j_engine)
    trace = _trace(t_engine)
    encoded = [e for step in trace for e in step[3]]
    # A and B encoded once each: request 1 and request 2's second image find A in the encoder cache
    assert encoded == [("0", 0), ("2", 0)] and t_engine.stats()["num_encoder_runs"] == 2
    # the budget (20 rows) took A (12) in step 0, so B (15) waited: request 2 got no tokens past its start
    assert "2" not in trace[0][0] or trace[0][1][trace[0][0].index("2")] <= 3


def test_a_preempted_image_request_resumes_to_the_same_output(runs):
    want = runs["torch"][1]
    for side in SIDES:
        engine, outs = _run(side, _prompts(), num_blocks=12)
        assert engine.stats()["num_preemptions"] > 0, side
        assert outs == want, side


def test_the_prefix_cache_tells_prompts_apart_by_their_images():
    for side in SIDES:
        same = [{"prompt_token_ids": [401] * 9 + [VS, IMG, VE, 5, 6], "multi_modal_data": {"image": [A]}}] * 2
        other = [same[0], {"prompt_token_ids": same[0]["prompt_token_ids"], "multi_modal_data": {"image": [B]}}]
        hits = {}
        for name, prompts in (("same", same), ("other", other)):
            engine = SIDES[side][0].LLMEngine(CKPT, _config(SIDES[side][1], max_num_seqs=1))
            engine.generate(prompts, SIDES[side][1].SamplingParams(temperature=0.0, max_tokens=2))
            hits[name] = engine.stats()["num_prefix_hit_blocks"]
        # 9 text tokens, then the image from token 10: blocks 0-1 are text only and shared either way; the
        # blocks the image overlaps are shared only when the image is
        assert hits["same"] > hits["other"] == 2, (side, hits)


@pytest.mark.parametrize("side", SIDES)
def test_image_tokens_and_images_must_agree(side):
    mod, cfg_mod = SIDES[side]
    engine = mod.LLMEngine(CKPT, _config(cfg_mod))
    with pytest.raises(ValueError, match="1 image tokens .* for 0 images"):
        engine.add_request("x", [401, VS, IMG, VE])
    with pytest.raises(ValueError, match="0 image tokens .* for 1 images"):
        engine.add_request("y", [401, 5], images=[A])
    text_only = mod.LLMEngine(ROOT / "assets/checkpoints/qwen2", cfg_mod.EngineConfig(
        block_size=4, num_blocks=16, max_num_batched_tokens=16, max_model_len=16))
    with pytest.raises(ValueError, match="takes no images"):
        text_only.add_request("z", [1, 2], images=[A])


@pytest.mark.parametrize("side", SIDES)
def test_an_image_larger_than_the_encoder_budget_is_refused(side):
    mod, cfg_mod = SIDES[side]
    engine = mod.LLMEngine(CKPT, _config(cfg_mod, max_num_encoder_input_tokens=10, encoder_cache_size=10))
    with pytest.raises(ValueError, match="could never be scheduled"):
        engine.add_request("big", [401, VS, IMG, VE], images=[A])
