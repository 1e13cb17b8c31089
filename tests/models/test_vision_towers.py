"""The Qwen vision towers (models/vision.py): torch source vs transformers 5.24's towers (Qwen2-VL, Qwen2.5-VL,
Qwen2.5-Omni's thinker, Qwen3-VL) and the JAX twin vs the torch source, whole and piece by piece, on random
weights (re-drawn at a scale that makes every piece matter) and random pixels, with grids that cut windows."""

from __future__ import annotations

import ast
import functools
import math
import re
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

jax.config.update("jax_default_matmul_precision", "highest")

from flax import traverse_util  # noqa: E402
from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniThinkerConfig  # noqa: E402
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (  # noqa: E402
    Qwen2_5OmniThinkerForConditionalGeneration)
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig  # noqa: E402
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel  # noqa: E402
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig  # noqa: E402
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel  # noqa: E402
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig  # noqa: E402
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel  # noqa: E402
from transformers.vision_utils import (get_vision_interpolation_indices_and_weights,  # noqa: E402
                                       get_vision_position_ids, get_vision_window_index)

from jax_oracles.models import vision as jv  # noqa: E402
from torch_sources.models import vision as tv  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
TORCH_TOL, JAX_TOL = 1e-5, 1e-4
# Tiny configs (shared notes, hf-tiny-models.md); the grids cut Qwen2.5-VL's 56 px windows (2x2 merged tokens)
# unevenly, mix images with a two-frame video, and ask Qwen3-VL's 8x8 position table to shrink and to grow.
QWEN2 = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14, spatial_merge_size=2,
             temporal_patch_size=2)
QWEN2_5 = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=14,
               window_size=56, fullatt_block_indexes=[1])
QWEN3 = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=16,
             num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
OMNI_THINKER = dict(
    text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                             "mrope_section": [2, 3, 3]}),
    vision_config=QWEN2_5,
    audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, d_model=32,
                      output_dim=64, max_source_positions=100, n_window=10))
GRIDS = {"qwen2": [[2, 4, 4], [1, 6, 4]], "qwen2_5": [[1, 6, 8], [1, 4, 4], [2, 4, 6]], "omni": [[1, 6, 8], [1, 4, 4]],
         "qwen3": [[1, 6, 8], [1, 10, 12], [2, 2, 4]]}


def maxdiff(a, b) -> float:
    a, b = (np.asarray(x.detach() if isinstance(x, torch.Tensor) else x, np.float64) for x in (a, b))
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every weight so that nothing is near-identity (HF's init: N(0, 0.02), zero biases, unit norms):
    matrices N(0, 1/fan_in), biases N(0, 0.1), norm gains 1 + N(0, 0.1), the position table N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1 and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            elif "pos_embed" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p[0].numel()))


def to_linen(state_dict: dict, module, pixels, grid) -> dict:
    """torch state dict -> the Linen params tree: `a.0.b.weight` -> a_0/b/kernel (= W.T) for a Linear, weight/bias
    for a norm, pos_embed/embedding, and the Conv3d weight (and bias) as patch_embed/weight (bias) in the checkpoint's layout. Checked both
    ways against the tree the module declares (names and shapes)."""
    flat = {}
    for name, w in state_dict.items():
        w = w.detach().numpy().astype(np.float32)
        *path, leaf = re.sub(r"\.(\d+)(?=\.)", r"_\1", name).split(".")
        if name.startswith("patch_embed.proj."):  # the Conv3d weight (and Qwen3's bias) keep their layout
            path = ["patch_embed"]
        elif name == "pos_embed.weight":
            leaf = "embedding"
        elif leaf == "weight" and w.ndim == 2:
            w, leaf = w.T, "kernel"
        flat["/".join([*path, leaf])] = w
    declared = jax.eval_shape(functools.partial(module.init, grid_thw=grid), jax.random.key(0), pixels)["params"]
    declared = {k: v.shape for k, v in traverse_util.flatten_dict(declared, sep="/").items()}
    assert {k: w.shape for k, w in flat.items()} == declared
    return {"params": traverse_util.unflatten_dict({k: jax.numpy.asarray(w) for k, w in flat.items()}, sep="/")}


class Tower(NamedTuple):
    hf: torch.nn.Module      # transformers' tower, eager attention, re-drawn weights
    src: torch.nn.Module     # the torch source, loaded strictly from hf's state dict
    jax_cfg: object
    jax: object              # the Linen tower
    params: dict             # {"params": tree} converted from src's state dict
    grid: torch.Tensor       # i64[I,3]
    grid_static: tuple       # the same, as nested tuples (a static jit argument)
    pixels: torch.Tensor     # f32[P, C*T*ps*ps]


def build(hf, torch_cls, jax_cls, cfg_name: str, kind: str, seed: int) -> Tower:
    randomize(hf, seed)
    d = hf.config.to_dict()
    src = torch_cls(getattr(tv, cfg_name).from_hf(d)).eval()
    src.load_state_dict(hf.state_dict(), strict=True)
    grid = torch.tensor(GRIDS[kind])
    c = hf.config
    pixels = torch.randn(int(grid.prod(-1).sum()), c.in_channels * c.temporal_patch_size * c.patch_size ** 2,
                         generator=torch.Generator().manual_seed(seed + 1))
    jax_cfg = getattr(jv, cfg_name).from_hf(d)
    module = jax_cls(jax_cfg)
    grid_static = tuple(map(tuple, GRIDS[kind]))
    params = to_linen(src.state_dict(), module, pixels.numpy(), grid_static)
    return Tower(hf, src, jax_cfg, module, params, grid, grid_static, pixels)


@pytest.fixture(scope="module")
def qwen2():
    hf = Qwen2VisionTransformerPretrainedModel._from_config(Qwen2VLVisionConfig(**QWEN2), attn_implementation="eager")
    return build(hf.eval(), tv.Qwen2VisionTransformer, jv.Qwen2VisionTransformer, "Qwen2VLVisionConfig", "qwen2", 0)


@pytest.fixture(scope="module")
def qwen2_5():
    hf = Qwen2_5_VisionTransformerPretrainedModel._from_config(Qwen2_5_VLVisionConfig(**QWEN2_5),
                                                               attn_implementation="eager")
    return build(hf.eval(), tv.Qwen2_5VisionTransformer, jv.Qwen2_5VisionTransformer, "Qwen2_5VLVisionConfig",
                 "qwen2_5", 10)


@pytest.fixture(scope="module")
def omni():
    thinker = Qwen2_5OmniThinkerForConditionalGeneration._from_config(Qwen2_5OmniThinkerConfig(**OMNI_THINKER),
                                                                      attn_implementation="eager")
    return build(thinker.eval().model.visual, tv.Qwen2_5VisionTransformer, jv.Qwen2_5VisionTransformer,
                 "Qwen2_5VLVisionConfig", "omni", 20)


@pytest.fixture(scope="module")
def qwen3():
    hf = Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**QWEN3), attn_implementation="eager")
    return build(hf.eval(), tv.Qwen3VisionTransformer, jv.Qwen3VisionTransformer, "Qwen3VLVisionConfig", "qwen3", 30)


@pytest.fixture(params=["qwen2", "qwen2_5", "omni", "qwen3"])
def tower(request) -> Tower:
    return request.getfixturevalue(request.param)


@functools.cache
def _jitted_apply(module):
    return jax.jit(module.apply, static_argnums=2)


def run_jax(t: Tower):
    return _jitted_apply(t.jax)(t.params, t.pixels.numpy(), t.grid_static)


# ---- whole towers ---------------------------------------------------------------------------

def test_state_dict_names_equal_transformers(tower):
    assert list(tower.src.state_dict()) == list(tower.hf.state_dict())  # (the fixture loaded it strictly too)


def test_tower_matches_transformers(tower):
    with torch.no_grad():
        ref = tower.hf(tower.pixels, grid_thw=tower.grid)
        out = tower.src(tower.pixels, tower.grid)
    if isinstance(out, tuple):  # Qwen3-VL: (merged, deepstack features)
        out, deepstack = out
        assert len(deepstack) == len(ref.deepstack_features) == 2
        for ours, theirs in zip(deepstack, ref.deepstack_features, strict=True):
            assert maxdiff(ours, theirs) <= TORCH_TOL
    assert out.shape == (tower.grid.prod(-1).sum() // 4, tower.src.config.out_hidden_size)
    assert float(ref.pooler_output.abs().mean()) > 0.1  # the comparison is of numbers that matter
    assert maxdiff(out, ref.pooler_output) <= TORCH_TOL


def test_jax_tower_matches_torch(tower):
    with torch.no_grad():
        ref = tower.src(tower.pixels, tower.grid)
    out = run_jax(tower)
    if isinstance(ref, tuple):
        (ref, ref_deepstack), (out, deepstack) = ref, out
        assert len(deepstack) == len(ref_deepstack)
        for ours, theirs in zip(deepstack, ref_deepstack, strict=True):
            assert maxdiff(ours, theirs) <= JAX_TOL
    assert maxdiff(out, ref) <= JAX_TOL


def test_qwen2_5_without_the_reverse_window_order_differs(qwen2_5, monkeypatch):
    """The merged tokens left in window order (the reverse permutation not applied) are clearly wrong: the grids
    cut windows, and the tower comparison would catch the omission."""
    perm, _ = tv.window_index(qwen2_5.grid, 56, 2, 14)
    assert not torch.equal(perm, torch.arange(len(perm)))
    with torch.no_grad():
        ref = qwen2_5.hf(qwen2_5.pixels, grid_thw=qwen2_5.grid).pooler_output
        monkeypatch.setattr(tv, "from_window_order", lambda merged, perm: merged)
        unreversed = qwen2_5.src(qwen2_5.pixels, qwen2_5.grid)
    assert maxdiff(unreversed, ref) > 0.5
    assert maxdiff(unreversed[torch.argsort(perm)], ref) <= TORCH_TOL  # the only thing wrong is the order


def test_omni_needs_the_separate_qkv_flag(omni):
    assert omni.src.config.separate_qkv and omni.jax_cfg.separate_qkv
    fused = tv.Qwen2_5VisionTransformer(tv.Qwen2_5VLVisionConfig(**{**QWEN2_5, "fullatt_block_indexes": (1,)}))
    with pytest.raises(RuntimeError, match="attn.q.weight"):
        fused.load_state_dict(omni.hf.state_dict(), strict=True)


# ---- pieces ---------------------------------------------------------------------------------

def test_patch_embed_is_conv3d(tower):
    c = tower.hf.config
    proj = tower.src.patch_embed.proj
    x = tower.pixels
    with torch.no_grad():
        conv = F.conv3d(x.view(-1, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size), proj.weight,
                        proj.bias, stride=proj.stride).view(len(x), -1)
        ours = tower.src.patch_embed(x)
        assert maxdiff(ours, conv) <= TORCH_TOL
        assert maxdiff(ours, tower.hf.patch_embed(x)) <= TORCH_TOL
    patch_embed = jv.PatchEmbed(ours.shape[-1], c.in_channels, c.temporal_patch_size, c.patch_size,
                                use_bias=proj.bias is not None)
    out = patch_embed.apply({"params": tower.params["params"]["patch_embed"]}, x.numpy())
    assert maxdiff(out, ours) <= JAX_TOL


@pytest.mark.parametrize("grid", [[[1, 4, 4]], [[2, 6, 8], [1, 2, 4]], [[1, 10, 6], [3, 4, 4]]])
def test_rope_positions_and_tables(qwen2_5, qwen3, grid):
    grid = torch.tensor(grid)
    positions = tv.vision_rope_positions(grid, 2)
    assert torch.equal(positions, get_vision_position_ids(grid, 2))
    np.testing.assert_array_equal(jv.vision_rope_positions(grid.numpy(), 2), positions.numpy())
    for t in (qwen2_5, qwen3):  # head_dim 8 both; the tables depend on head_dim and theta only
        cos, sin = tv.vision_rope_cos_sin(positions, t.src.config.head_dim, t.src.config.rope_theta)
        ref_cos, ref_sin = t.hf.rotary_pos_emb(torch.zeros(1), positions)
        assert maxdiff(cos, ref_cos) <= 1e-6 and maxdiff(sin, ref_sin) <= 1e-6
        jcos, jsin = jv.vision_rope_cos_sin(positions.numpy(), t.jax_cfg.head_dim, t.jax_cfg.rope_theta)
        assert maxdiff(jcos, cos) <= 1e-6 and maxdiff(jsin, sin) <= 1e-6
    assert float(sin.abs().max()) > 0.5  # the angles really turn


@pytest.mark.parametrize("grid", [[[1, 6, 8], [1, 4, 4]], [[1, 8, 8]], [[2, 4, 6], [1, 2, 2]], [[1, 14, 10]]])
@pytest.mark.parametrize("window_size", [56, 112])
def test_window_index_equals_transformers(grid, window_size):
    grid = torch.tensor(grid)
    perm, cu = tv.window_index(grid, window_size, 2, 14)
    ref_perm, ref_cu = get_vision_window_index(grid, spatial_merge_size=2, window_size=window_size, patch_size=14)
    assert torch.equal(perm, ref_perm) and torch.equal(cu, ref_cu) and cu.dtype == ref_cu.dtype
    jperm, jcu = jv.window_index(grid.numpy(), window_size, 2, 14)
    np.testing.assert_array_equal(jperm, perm.numpy())
    np.testing.assert_array_equal(jcu, cu.numpy())


def test_qwen2_5_window_layout_is_cut():
    """[1,6,8] at 56 px: 3x4 merged tokens in 2x2 windows -> windows of 4, 4, 2, 2 merged tokens (x4 patches)."""
    perm, cu = tv.window_index(torch.tensor([[1, 6, 8]]), 56, 2, 14)
    assert perm.tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 10, 11]
    assert cu.tolist() == [0, 16, 32, 40, 48]


def test_segments_are_block_diagonal():
    cu = tv.vision_cu_seqlens(torch.tensor([[2, 2, 2], [1, 2, 4]]))
    assert cu.tolist() == [0, 4, 8, 16]  # one segment per temporal patch
    index, valid = tv.segment_index(cu)
    assert index.tolist() == [[0, 1, 2, 3, 0, 0, 0, 0], [4, 5, 6, 7, 0, 0, 0, 0], list(range(8, 16))]
    assert valid.sum(1).tolist() == [4, 4, 8]
    jindex, jvalid = jv.segment_index(jv.vision_cu_seqlens(np.array([[2, 2, 2], [1, 2, 4]])))
    np.testing.assert_array_equal(jindex, index.numpy())
    np.testing.assert_array_equal(jvalid, valid.numpy())


def test_vision_attention_is_per_segment(qwen2_5):
    """Against attention run on each segment alone (transformers' loop), and JAX against torch."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(20, 4, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 6, 7, 20], dtype=torch.int32)
    out = tv.vision_attention(q, k, v, cu, 8 ** -0.5)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        probs = torch.softmax(torch.einsum("qnd,knd->nqk", q[a:b], k[a:b]) * 8 ** -0.5, dim=-1)
        assert maxdiff(out[a:b], torch.einsum("nqk,knd->qnd", probs, v[a:b])) <= 1e-6
    assert maxdiff(jv.vision_attention(q.numpy(), k.numpy(), v.numpy(), cu.numpy(), 8 ** -0.5), out) <= 1e-6


def _hf_position_embeddings(t: Tower):
    return t.hf.rotary_pos_emb(torch.zeros(1), get_vision_position_ids(t.grid, 2))


@pytest.mark.parametrize("windowed", [False, True])
def test_one_block_matches(tower, windowed):
    if windowed and not hasattr(tower.src.config, "window_size"):
        pytest.skip("no windows in this tower")
    cu = tv.window_index(tower.grid, 56, 2, 14)[1] if windowed else tv.vision_cu_seqlens(tower.grid)
    with torch.no_grad():
        x = tower.src.patch_embed(tower.pixels)
        cos, sin = _hf_position_embeddings(tower)
        ref = tower.hf.blocks[0](x, cu_seqlens=cu, position_embeddings=(cos, sin))
        out = tower.src.blocks[0](x, cu, cos, sin)
    assert maxdiff(out, ref) <= TORCH_TOL and maxdiff(out, x) > 0.1
    block = {"qwen2_vl_vision": jv.Qwen2VLVisionBlock, "qwen3_vl_vision": jv.Qwen3VLVisionBlock}.get(
        tower.hf.config.model_type, jv.Qwen2_5VLVisionBlock)(tower.jax_cfg)
    apply = jax.jit(functools.partial(block.apply, cu_seqlens=cu.numpy()))  # the segment bounds are host data
    jout = apply({"params": tower.params["params"]["blocks_0"]}, x.numpy(), cos=cos.numpy(), sin=sin.numpy())
    assert maxdiff(jout, out) <= JAX_TOL


def test_merger_matches(tower):
    with torch.no_grad():
        x = tower.src.patch_embed(tower.pixels)
        ref, out = tower.hf.merger(x), tower.src.merger(x)
    assert maxdiff(out, ref) <= TORCH_TOL
    p = tower.params["params"]["merger"]
    if isinstance(tower.jax_cfg, jv.Qwen3VLVisionConfig):
        merger = jv.Qwen3VLPatchMerger(tower.jax_cfg)
    else:
        norm = jv.LayerNorm if isinstance(tower.jax_cfg, jv.Qwen2VLVisionConfig) else jv.RMSNorm
        merger = jv.PatchMerger(tower.jax_cfg.out_hidden_size, 2, norm)
    assert maxdiff(merger.apply({"params": p}, x.numpy()), out) <= JAX_TOL


def test_qwen3_deepstack_merger_matches(qwen3):
    with torch.no_grad():
        x = qwen3.src.patch_embed(qwen3.pixels)
        ref, out = qwen3.hf.deepstack_merger_list[1](x), qwen3.src.deepstack_merger_list[1](x)
        plain = qwen3.src.merger(x)
    assert maxdiff(out, ref) <= TORCH_TOL
    merger = jv.Qwen3VLPatchMerger(qwen3.jax_cfg, use_postshuffle_norm=True)
    jout = merger.apply({"params": qwen3.params["params"]["deepstack_merger_list_1"]}, x.numpy())
    assert maxdiff(jout, out) <= JAX_TOL
    assert qwen3.src.deepstack_merger_list[1].norm.weight.shape == (4 * 32,) and maxdiff(out, plain) > 0.1


def test_qwen3_pos_embed_interpolation(qwen3):
    grid, side = qwen3.grid, qwen3.src.config.num_grid_per_side
    indices, weights = tv.pos_embed_interpolation(grid, side, 2)
    ref_indices, ref_weights = get_vision_interpolation_indices_and_weights(
        grid, side, mode="bilinear", align_corners=True, spatial_merge_size=2)
    assert torch.equal(indices, ref_indices) and torch.equal(weights, ref_weights)
    jindices, jweights = jv.pos_embed_interpolation(grid.numpy(), side, 2)
    np.testing.assert_array_equal(jindices, indices.numpy())
    np.testing.assert_array_equal(jweights, weights.numpy())

    table = qwen3.src.pos_embed.weight.detach()
    with torch.no_grad():
        ours = tv.interpolate_pos_embed(table, indices, weights)
        ref = (qwen3.hf.pos_embed(ref_indices) * ref_weights[:, :, None]).sum(1)  # Qwen3VLVisionModel.forward's
    assert maxdiff(ours, ref) <= TORCH_TOL
    # independently: F.interpolate of the table as a D x side x side image, each image's h x w in merge-block order
    image = table.T.reshape(1, -1, side, side)
    resized = []
    for t, h, w in grid.tolist():
        r = F.interpolate(image, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D,h,w]
        r = r.reshape(-1, h // 2, 2, w // 2, 2).permute(1, 3, 2, 4, 0).reshape(h * w, -1)
        resized.append(r.repeat(t, 1))
    assert maxdiff(ours, torch.cat(resized)) <= TORCH_TOL
    assert maxdiff(jv.interpolate_pos_embed(table.numpy(), jindices, jweights), ours) <= JAX_TOL


# ---- configs and the twins ------------------------------------------------------------------

def test_config_from_hf():
    d = Qwen2_5_VLVisionConfig(**QWEN2_5).to_dict()
    for side in (tv, jv):
        c = side.Qwen2_5VLVisionConfig.from_hf(d)
        assert not c.separate_qkv and c.fullatt_block_indexes == (1,) and c.rope_theta == 10_000.0
        hash(c)  # static-able
        omni = side.Qwen2_5VLVisionConfig.from_hf({**d, "model_type": "qwen2_5_omni_vision_encoder", "embed_dim": 32})
        assert omni.separate_qkv
        with pytest.raises(ValueError, match="window_attention_size"):
            side.Qwen2_5VLVisionConfig.from_hf({**d, "window_attention_size": 3})
        with pytest.raises(ValueError, match="rope_parameters"):
            side.Qwen2_5VLVisionConfig.from_hf({**d, "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}})
        assert side.Qwen3VLVisionConfig.from_hf(Qwen3VLVisionConfig(**QWEN3).to_dict()).num_grid_per_side == 8
        assert side.Qwen2VLVisionConfig.from_hf(Qwen2VLVisionConfig(**QWEN2).to_dict()).head_dim == 8


# vision_config keys as the Qwen2-VL / Qwen2.5-VL releases write them (legacy in_chans, spatial_patch_size;
# tokens_per_second is the LM's), at tiny sizes
RELEASE_QWEN2 = dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, in_chans=3, hidden_size=64, patch_size=14,
                     spatial_merge_size=2, spatial_patch_size=14, temporal_patch_size=2)
RELEASE_QWEN2_5 = dict(depth=2, hidden_act="silu", hidden_size=32, intermediate_size=64, num_heads=4, in_chans=3,
                       out_hidden_size=64, patch_size=14, spatial_merge_size=2, spatial_patch_size=14, window_size=56,
                       fullatt_block_indexes=[1], tokens_per_second=2, temporal_patch_size=2)


def test_release_style_configs_read():
    for side in (tv, jv):
        assert side.Qwen2VLVisionConfig.from_hf(RELEASE_QWEN2) == side.Qwen2VLVisionConfig.from_hf(
            Qwen2VLVisionConfig(**QWEN2).to_dict())
        assert side.Qwen2_5VLVisionConfig.from_hf(RELEASE_QWEN2_5) == side.Qwen2_5VLVisionConfig.from_hf(
            Qwen2_5_VLVisionConfig(**QWEN2_5).to_dict())


def test_jax_grid_must_be_static(qwen2):
    with pytest.raises(TypeError, match="static host data"):
        jax.jit(qwen2.jax.apply)(qwen2.params, qwen2.pixels.numpy(), np.asarray(qwen2.grid_static))


def test_twins_declare_the_same_public_names():
    assert tv.__all__ == jv.__all__
    assert all(hasattr(tv, n) and hasattr(jv, n) for n in tv.__all__)


def test_jax_twin_imports_no_torch():
    tree = ast.parse((ROOT / "jax_oracles/models/vision.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    banned = ("torch", "transformers", "torch_sources", "recorder", "grader", "catalog")
    assert not [n for n in names if n.split(".")[0] in banned]
