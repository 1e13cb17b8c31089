"""Qwen2.5-VL over the paged KV cache, both sides (torch_sources/serving/models/qwen2_5_vl.py and its serving_engine
twin), on the shipped checkpoint: a prompt with one image (its `<|image_pad|>` expanded to the merged-token count)
prefilled through the paged path gives the whole-sequence model's logits (torch within 1e-5, JAX within 1e-4 of
torch), in one prefill and (torch) in two chunks cut inside the image; a decode step at position context + delta on
all three rows gives the whole-sequence logits of prompt + token; the family's image processor, tower embeddings and
position table are the training side's."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from serving_engine import models as jmodels
from serving_engine import paged_attention as jpa
from serving_engine.models import qwen2_5_vl as jserve
from torch_sources.models import vision_processing as tvp
from torch_sources.serving import models as tmodels
from torch_sources.serving import paged_attention as tpa
from torch_sources.serving.models import qwen2_5_vl as tserve

jax.config.update("jax_default_matmul_precision", "highest")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
CKPT = ROOT / "assets/checkpoints/qwen2_5_vl"
IMAGE = ROOT / "assets/images/exact_112x84.png"  # grid 6x8: 12 merged tokens over three 56 px windows
VS, VE, IMG = 409, 410, 412
BLOCK, NUM_BLOCKS, MAX_BLOCKS = 4, 16, 8
TORCH_TOL, JAX_TOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def torch_side():
    return tserve.load_model(CKPT)


@pytest.fixture(scope="module")
def jax_side():
    return jserve.load_model(CKPT)


@pytest.fixture(scope="module")
def prompt(torch_side):
    """(token ids with the image span expanded, pixel_values, grid_thw, positions [3,L], delta)."""
    config, _ = torch_side
    pixels, grid = tserve.process_image(config, tvp.load_image(IMAGE))
    n = int(np.prod(grid)) // 4
    ids = [401, 5, 6, 7, VS, *[IMG] * n, VE, 8, 9, 10, 11, 402]
    positions, delta = tserve.mrope_positions(config, ids, [grid])
    return ids, pixels, grid, positions, delta


def _meta(side, start: int, T: int):
    """Tokens start..start+T of one sequence whose pages are blocks 0, 1, 2, ... (a slot is the token's index)."""
    n = start + T
    pages = list(range(-(-n // BLOCK)))
    fields = dict(slot_mapping=list(range(start, n)), kv_lens=[n],
                  page_indices=[pages + [0] * (MAX_BLOCKS - len(pages))], cu_q_lens=[0, T], num_seqs=[1])
    if side == "torch":
        return tpa.AttentionMetadata(**{k: torch.tensor(v, dtype=torch.int32) for k, v in fields.items()})
    return jpa.AttentionMetadata(**{k: jnp.asarray(v, jnp.int32) for k, v in fields.items()},
                                 max_q_len=1 if T == 1 else None)


def _cache(side, config):
    engine = SimpleNamespace(num_blocks=NUM_BLOCKS, block_size=BLOCK)
    return (tpa if side == "torch" else jpa).allocate_kv_cache(config, engine)


def _mm_rows(ids, image_embeds, dim):
    """(mm_embeds f32[T,D], is_mm bool[T]) of a token run: the image rows in the order of its image tokens."""
    is_mm = np.asarray(ids) == IMG
    mm = np.zeros((len(ids), dim), np.float32)
    mm[is_mm] = image_embeds[:int(is_mm.sum())]
    return mm, is_mm


def _whole_logits(model, ids, pixels, grid):  # the training model's forward of the whole sequence
    with torch.no_grad():
        return model(torch.tensor([ids]), pixel_values=torch.as_tensor(pixels),
                     image_grid_thw=torch.tensor([list(grid)]))[0].numpy()


def _torch_step(model, config, ids, positions, cache, start, image_embeds):
    mm, is_mm = _mm_rows(ids, image_embeds, config.hidden_size)
    hidden, cache = tserve.forward_paged(model, torch.tensor(ids, dtype=torch.int32),
                                         torch.tensor(positions, dtype=torch.int32), cache,
                                         _meta("torch", start, len(ids)), torch.from_numpy(mm), torch.from_numpy(is_mm))
    return tserve.compute_logits(model, hidden).numpy(), cache


def test_registered_and_processed_as_the_training_side(torch_side, jax_side, prompt):
    assert tmodels.family(CKPT) is tserve and jmodels.family(CKPT) is jserve
    assert tserve.MULTIMODAL and jserve.MULTIMODAL
    (tconfig, tmodel), (jconfig, _) = torch_side, jax_side
    ids, pixels, grid, positions, delta = prompt
    assert tserve.image_token_id(tconfig) == jserve.image_token_id(jconfig) == IMG
    assert grid == (1, 6, 8) and pixels.shape == (48, 3 * 2 * 14 * 14)
    jpixels, jgrid = jserve.process_image(jconfig, tvp.load_image(IMAGE))
    assert jgrid == grid and np.array_equal(jpixels, pixels.numpy())
    # the table is the training model's rope index of the row; the delta what decoding adds
    want, want_delta = tmodel.rope_index(torch.tensor([ids]), torch.tensor([list(grid)]), torch.ones(1, len(ids)))
    assert np.array_equal(positions, want[:, 0].numpy())
    assert delta == int(want_delta) == int(positions.max()) + 1 - len(ids)
    jpositions, jdelta = jserve.mrope_positions(jconfig, ids, [grid])
    assert np.array_equal(jpositions, positions) and jdelta == delta
    assert delta < 0  # the 6x8 image spans 8 positions for its 12 tokens
    with pytest.raises(ValueError, match="only text"):
        tserve.mrope_positions(tconfig, ids + [413], [grid])  # a video token


def test_prefill_and_decode_match_the_whole_sequence(torch_side, jax_side, prompt):
    (config, model), (jconfig, jmodel) = torch_side, jax_side
    ids, pixels, grid, positions, delta = prompt
    image = tserve.embed_multimodal(model, pixels, grid).numpy()
    assert image.shape == (12, config.hidden_size)

    # torch: one prefill, then a decode step at (context + delta) on all three rows
    want = _whole_logits(model, ids, pixels, grid)
    cache = _cache("torch", config)
    got, cache = _torch_step(model, config, ids, positions, cache, 0, image)
    assert np.abs(got - want).max() <= TORCH_TOL
    token = int(got[-1].argmax())
    step = np.full((3, 1), len(ids) + delta)
    decoded, cache = _torch_step(model, config, [token], step, cache, len(ids), image[:0])
    assert np.abs(decoded[0] - _whole_logits(model, ids + [token], pixels, grid)[-1]).max() <= TORCH_TOL

    # torch: the same prompt in two chunks, the cut inside the image span (the table sliced per chunk)
    cut, cache2 = 9, _cache("torch", config)
    first, cache2 = _torch_step(model, config, ids[:cut], positions[:, :cut], cache2, 0, image)
    before = int((np.asarray(ids[:cut]) == IMG).sum())
    second, cache2 = _torch_step(model, config, ids[cut:], positions[:, cut:], cache2, cut, image[before:])
    assert np.abs(np.concatenate([first, second]) - want).max() <= TORCH_TOL

    # JAX: the same prefill and decode, jitted as the runner does (family static, cache donated)
    jimage = jax.jit(jserve.embed_multimodal, static_argnums=2)(jmodel, jnp.asarray(pixels.numpy()), grid)
    assert np.abs(np.asarray(jimage) - image).max() <= JAX_TOL
    fwd = jax.jit(jserve.forward_paged, donate_argnums=3)
    jcache = _cache("jax", jconfig)
    for start, run, rows, pos in ((0, ids, jimage, positions), (len(ids), [token], jimage[:0], step)):
        mm, is_mm = _mm_rows(run, np.asarray(rows), jconfig.hidden_size)
        hidden, jcache = fwd(jmodel, jnp.asarray(run, jnp.int32), jnp.asarray(pos, jnp.int32), jcache,
                             _meta("jax", start, len(run)), jnp.asarray(mm), jnp.asarray(is_mm))
        jlogits = np.asarray(jserve.compute_logits(jmodel, hidden))
        assert np.abs(jlogits - (got if start == 0 else decoded)).max() <= JAX_TOL


def test_decoder_layer_paged_matches_torch(torch_side, jax_side, prompt):
    """L2: each layer alone on the prompt's rows (random hidden states, the M-RoPE positions), output and cache."""
    (config, model), (jconfig, jmodel) = torch_side, jax_side
    ids, _, _, positions, _ = prompt
    hidden = np.random.default_rng(0).standard_normal((len(ids), config.hidden_size)).astype(np.float32)
    tcache, jcache = _cache("torch", config), _cache("jax", jconfig)
    for i in range(config.num_hidden_layers):
        t_out, tcache = tserve.decoder_layer_paged(model, i, torch.from_numpy(hidden),
                                                   torch.tensor(positions, dtype=torch.int32), tcache,
                                                   _meta("torch", 0, len(ids)))
        j_out, jcache = jserve.decoder_layer_paged(jmodel, i, jnp.asarray(hidden), jnp.asarray(positions, jnp.int32),
                                                   jcache, _meta("jax", 0, len(ids)))
        assert np.abs(np.asarray(j_out) - t_out.numpy()).max() <= JAX_TOL
        for j_pages, t_pages in ((jcache.k[i], tcache.k[i]), (jcache.v[i], tcache.v[i])):
            assert np.abs(np.asarray(j_pages) - t_pages.numpy()).max() <= JAX_TOL
