"""models/mrope.py on both sides: the M-RoPE position index of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and the
Qwen2.5-Omni thinker against transformers' own get_rope_index (integers, exact), the positions transformers'
forward and generate hand the language model, and the merged cos/sin and rotated q/k against transformers'
rotary embeddings (<= 1e-6, torch source and JAX)."""

from __future__ import annotations

import jax

jax.config.update("jax_default_matmul_precision", "highest")

from types import SimpleNamespace  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from jax_oracles.models import layers as jlayers  # noqa: E402
from jax_oracles.models import mrope as jm  # noqa: E402
from jax_oracles.models import rope as jrope  # noqa: E402
from torch_sources.models import layers as tlayers  # noqa: E402
from torch_sources.models import mrope as tm  # noqa: E402
from torch_sources.models import rope as trope  # noqa: E402

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as hf_omni  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf_qwen2_vl  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl as hf_qwen3_vl  # noqa: E402
from transformers.processing_utils import ProcessorMixin  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

IMG, VID, VS, VE, AUDIO, AUDIO_START, PAD = 500, 501, 502, 503, 506, 507, 0
MERGE = 2
OMNI_IDS = dict(image_token_id=IMG, vision_start_token_id=VS, video_token_id=VID, audio_token_id=AUDIO,
                audio_start_token_id=AUDIO_START, spatial_merge_size=MERGE)
TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
ROPE_QWEN2 = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
ROPE_QWEN3 = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
VL_IDS = dict(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
QWEN25_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64, patch_size=14,
                     window_size=56, fullatt_block_indexes=[0])

# (family, rope block, interleaved): the merged layout each family's rotary embedding applies
LAYOUT = {"qwen2_vl": (ROPE_QWEN2, False), "qwen2_5_vl": (ROPE_QWEN2, False), "qwen3_vl": (ROPE_QWEN3, True),
          "qwen2_5_omni": (ROPE_QWEN2, False)}


@pytest.fixture(scope="module")
def models():
    """Tiny random-weight transformers models (one decoder layer, one vision block), built once."""
    t = transformers
    torch.manual_seed(0)
    built = {
        "qwen2_vl": t.Qwen2VLForConditionalGeneration._from_config(t.Qwen2VLConfig(
            text_config=dict(TEXT, rope_parameters=dict(ROPE_QWEN2)), **VL_IDS,
            vision_config=dict(depth=1, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                               spatial_merge_size=MERGE, temporal_patch_size=2)), attn_implementation="eager"),
        "qwen2_5_vl": t.Qwen2_5_VLForConditionalGeneration._from_config(t.Qwen2_5_VLConfig(
            text_config=dict(TEXT, rope_parameters=dict(ROPE_QWEN2)), vision_config=QWEN25_VISION, **VL_IDS),
            attn_implementation="eager"),
        "qwen3_vl": t.Qwen3VLForConditionalGeneration._from_config(t.Qwen3VLConfig(
            text_config=dict(TEXT, rope_parameters=dict(ROPE_QWEN3)), **VL_IDS,
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16,
                               out_hidden_size=64, num_position_embeddings=64, deepstack_visual_indexes=[0],
                               spatial_merge_size=MERGE)), attn_implementation="eager"),
        "qwen2_5_omni": t.Qwen2_5OmniThinkerForConditionalGeneration._from_config(t.Qwen2_5OmniThinkerConfig(
            text_config=dict(TEXT, rope_parameters=dict(ROPE_QWEN2)), vision_config=QWEN25_VISION,
            audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64,
                              d_model=32, output_dim=64, max_source_positions=100, n_window=10),
            image_token_index=IMG, video_token_index=VID, audio_token_index=AUDIO, vision_start_token_id=VS,
            vision_end_token_id=VE, audio_start_token_id=AUDIO_START, audio_end_token_id=508, user_token_id=509),
            attn_implementation="eager"),
    }
    return {k: m.eval() for k, m in built.items()}


# ---- batches --------------------------------------------------------------------------------

_rng = np.random.default_rng(0)


def _text(n):
    return _rng.integers(10, 400, n).tolist()


def _image(grid):  # vision_start, the merged patches, vision_end
    return [VS] + [IMG] * (grid[0] * grid[1] * grid[2] // MERGE**2) + [VE]


SQUARE, WIDE, TALL = [1, 4, 4], [1, 6, 8], [1, 8, 4]  # 4, 12 and 8 image tokens
ROWS = {
    "text": ([_text(7), _text(5), _text(1)], None),
    "one_image": ([_text(3) + _image(SQUARE) + _text(4)], [SQUARE]),
    "two_images": ([_text(2) + _image(WIDE) + _text(3) + _image(TALL) + _text(2)], [WIDE, TALL]),
    # rows with two images, none, and one right at the start (no text before its vision_start)
    "mixed": ([_text(2) + _image(WIDE) + _text(3) + _image(TALL) + _text(2), _text(6), _image(SQUARE) + _text(3)],
              [WIDE, TALL, SQUARE]),
    # no vision_end: the largest position is on the h / w rows (Omni's thinker refuses this row)
    "ends_in_image": ([_text(3) + _image(WIDE)[:-1], _text(4)], [WIDE]),
}
CASES = [(name, pad) for name in ROWS for pad in ("left", "right")] + [("one_image", None), ("two_images", None)]
FAMILY_CASES = [(family, name, pad) for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni")
                for name, pad in CASES if not (family == "qwen2_5_omni" and name == "ends_in_image")]


def batch(name, padding):
    """-> input_ids i64[B,T], attention_mask i64[B,T] (None: no mask), image_grid_thw i64[I,3] | None."""
    rows, grids = ROWS[name]
    T = max(map(len, rows))
    ids, mask = [], []
    for r in rows:
        pad = T - len(r)
        ids.append([PAD] * pad + r if padding == "left" else r + [PAD] * pad)
        mask.append([0] * pad + [1] * len(r) if padding == "left" else [1] * len(r) + [0] * pad)
    grid = None if grids is None else torch.tensor(grids)
    return torch.tensor(ids), (None if padding is None else torch.tensor(mask)), grid


def _np(x):
    return None if x is None else x.numpy()


def ours(family, ids, mask, grid):
    """(position_ids, rope_deltas) from the torch source and from the JAX twin (numpy)."""
    if family == "qwen2_5_omni":
        return (tm.get_rope_index_omni(ids, grid, mask, **OMNI_IDS),
                jm.get_rope_index_omni(_np(ids), _np(grid), _np(mask), **OMNI_IDS))
    types = tm.token_types(ids, image_token_id=IMG, video_token_id=VID)
    return (tm.get_rope_index(ids, grid, mask, mm_token_type_ids=types, spatial_merge_size=MERGE),
            jm.get_rope_index(_np(ids), _np(grid), _np(mask), mm_token_type_ids=types.numpy(),
                              spatial_merge_size=MERGE))


def theirs(model, family, ids, mask, grid):
    if family == "qwen2_5_omni":
        return model.get_rope_index(ids, grid, None, mask)
    return model.model.get_rope_index(ids, mm_token_type_ids=(ids == IMG).long(), image_grid_thw=grid,
                                      attention_mask=mask)


def assert_positions(expected, torch_side, jax_side):
    (pos, deltas), (tpos, tdeltas), (jpos, jdeltas) = expected, torch_side, jax_side
    assert tpos.dtype == torch.int64 and tdeltas.dtype == torch.int64 and jpos.dtype == np.int64
    assert tdeltas.shape == jdeltas.shape == (pos.shape[1], 1)
    assert torch.equal(tpos, pos) and torch.equal(tdeltas, deltas.reshape(-1, 1))
    np.testing.assert_array_equal(jpos, pos.numpy())
    np.testing.assert_array_equal(jdeltas, deltas.reshape(-1, 1).numpy())


# ---- the position index ---------------------------------------------------------------------

@pytest.mark.parametrize("family,name,padding", FAMILY_CASES, ids=["-".join(map(str, c)) for c in FAMILY_CASES])
def test_rope_index_equals_transformers(models, family, name, padding):
    ids, mask, grid = batch(name, padding)
    expected = theirs(models[family], family, ids, mask, grid)
    assert_positions(expected, *ours(family, ids, mask, grid))


def test_known_positions():
    """A literal row: text, a 4x4 -> 2x2 image (h rows then w columns), text resuming at start + max(h, w);
    the left pad at 0 (Qwen2-VL) or 1 (Omni's thinker)."""
    ids = torch.tensor([[PAD, 7, VS, IMG, IMG, IMG, IMG, VE, 8]])
    mask = (ids != PAD).long()
    want = [[0, 0, 1, 2, 2, 2, 2, 4, 5], [0, 0, 1, 2, 2, 3, 3, 4, 5], [0, 0, 1, 2, 3, 2, 3, 4, 5]]
    pos, deltas = tm.get_rope_index(ids, torch.tensor([SQUARE]), mask, mm_token_type_ids=(ids == IMG).long(),
                                    spatial_merge_size=MERGE)
    assert pos[:, 0].tolist() == want and deltas.tolist() == [[6 - 8]]
    pos, deltas = jm.get_rope_index_omni(ids.numpy(), np.array([SQUARE]), mask.numpy(), **OMNI_IDS)
    assert pos[:, 0].tolist() == [[1] + w[1:] for w in want] and deltas.tolist() == [[-2]]


def _audio(frames):  # audio_start, the tower's tokens for `frames` feature frames, audio_end
    return [AUDIO_START] + [AUDIO] * (((frames - 1) // 2 + 1 - 2) // 2 + 1) + [508]


@pytest.mark.parametrize("padding", ["left", "right"])
def test_omni_audio_positions_equal_transformers(models, padding):
    """Audio spans (LF's audio_seqlens: each audio's feature frames) before, between and after images, and a row
    with audio alone: transformers' thinker index, exactly; the same positions as the spans read as text."""
    rows = [_text(2) + _audio(37) + _text(1) + _image(WIDE) + _audio(10) + _image(SQUARE) + _text(2),
            _audio(20) + _text(3), _text(2) + _image(TALL) + _text(1) + _audio(8) + _text(1)]
    T = max(map(len, rows))
    pad = [T - len(r) for r in rows]
    ids = torch.tensor([[PAD] * p + r if padding == "left" else r + [PAD] * p for r, p in zip(rows, pad)])
    mask = torch.tensor([[0] * p + [1] * len(r) if padding == "left" else [1] * len(r) + [0] * p
                         for r, p in zip(rows, pad)])
    grid, seqlens = torch.tensor([WIDE, SQUARE, TALL]), torch.tensor([37, 10, 20, 8])
    expected = models["qwen2_5_omni"].get_rope_index(ids, grid, None, mask, audio_seqlens=seqlens)
    got = (tm.get_rope_index_omni(ids, grid, mask, audio_seqlens=seqlens, **OMNI_IDS),
           jm.get_rope_index_omni(ids.numpy(), grid.numpy(), mask.numpy(), audio_seqlens=seqlens.numpy(), **OMNI_IDS))
    assert_positions(expected, *got)
    as_text = torch.where((ids == AUDIO) | (ids == AUDIO_START), 7, ids)  # audio spans placed as text would be
    assert_positions(tm.get_rope_index_omni(as_text, grid, mask, **OMNI_IDS), *got)
    # LF's fake audio and fake image, masked: never read, whatever their ids (pads keep 1)
    fake = torch.cat([ids, torch.tensor([[VS, IMG, IMG, IMG, IMG, VE] + _audio(10)] * 3)], dim=1)
    fake_mask = torch.cat([mask, torch.zeros(3, 10, dtype=torch.long)], dim=1)
    pos, deltas = tm.get_rope_index_omni(fake, grid, fake_mask, audio_seqlens=seqlens, **OMNI_IDS)
    assert torch.equal(pos[..., :T], got[0][0]) and (pos[..., T:] == 1).all() and torch.equal(deltas, got[0][1])


def test_token_types_equal_the_processors():
    ids = torch.tensor([[1, IMG, IMG, VID, 3, VS], [IMG, 2, 2, 2, VID, VE]])
    fake = SimpleNamespace(image_token_ids=[IMG], video_token_ids=[VID], audio_token_ids=[None])
    expected = ProcessorMixin.create_mm_token_type_ids(fake, ids.tolist())
    assert tm.token_types(ids, image_token_id=IMG, video_token_id=VID).tolist() == expected
    assert jm.token_types(ids.numpy(), image_token_id=IMG, video_token_id=VID).tolist() == expected


class _Capture:
    """The position_ids transformers hands its language model, call by call."""

    def __init__(self, model):
        self.calls = []
        self.handle = model.model.language_model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.calls.append(kwargs.get("position_ids"))

    def __enter__(self):
        return self.calls

    def __exit__(self, *exc):
        self.handle.remove()


def _inputs(family, ids, mask, grid):
    kw = dict(input_ids=ids, attention_mask=mask, image_grid_thw=grid)
    if family != "qwen2_5_omni":  # the thinker takes no mm_token_type_ids
        kw["mm_token_type_ids"] = (ids == IMG).long()
    return kw


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen2_5_omni"])
def test_forward_and_generate_positions(models, family):
    """What reaches the language model: the forward's 3-row index, then generate's prefill (row 0 the text
    positions, rows 1-3 M-RoPE) and its decode steps (decode_positions' last column)."""
    model, new = models[family], 3
    ids, mask, grid = batch("mixed", "left")
    (pos, deltas), (jpos, jdeltas) = ours(family, ids, mask, grid)
    model.model.rope_deltas = None
    with _Capture(model) as calls, torch.no_grad():
        model(**_inputs(family, ids, mask, grid))
    assert torch.equal(calls[0], pos)
    with _Capture(model) as calls, torch.no_grad():
        model.generate(**_inputs(family, ids, mask, grid), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert len(calls) == new
    assert torch.equal(calls[0][1:], pos) and torch.equal(calls[0][0], tm.text_positions(mask))
    np.testing.assert_array_equal(jm.text_positions(mask.numpy()), calls[0][0].numpy())
    full = torch.cat([mask, torch.ones(mask.shape[0], new - 1, dtype=mask.dtype)], dim=1)
    for step in range(1, new):
        upto = full[:, :mask.shape[1] + step]
        assert torch.equal(calls[step][1:], tm.decode_positions(upto, deltas)[..., -1:]), step
        np.testing.assert_array_equal(jm.decode_positions(upto.numpy(), jdeltas)[..., -1:], calls[step][1:].numpy())


def test_generate_text_only_positions(models):
    """A text-only batch in generate: cumsum - 1 with pads at 0 on every row, rope_deltas 0."""
    ids, mask, _ = batch("text", "left")
    model = models["qwen2_vl"]
    with _Capture(model) as calls, torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    expected = tm.text_positions(mask)
    assert torch.equal(calls[0], expected[None].expand(4, -1, -1))
    assert torch.equal(model.model.rope_deltas, torch.zeros(3, 1, dtype=torch.long))
    types = torch.zeros_like(ids)
    assert torch.equal(tm.get_rope_index(ids, None, mask, mm_token_type_ids=types, spatial_merge_size=MERGE)[0],
                       expected[None].expand(3, -1, -1))


def test_omni_text_without_mask(models):
    """The thinker's forward without a mask skips get_rope_index (it would fail): the language model counts
    0..T-1, which is what get_rope_index_omni gives for attention_mask=None."""
    ids, _, _ = batch("text", "left")
    with _Capture(models["qwen2_5_omni"]) as calls, torch.no_grad():
        models["qwen2_5_omni"](input_ids=ids)
    assert calls[0] is None
    (pos, deltas), (jpos, jdeltas) = ours("qwen2_5_omni", ids, None, None)
    arange = torch.arange(ids.shape[1]).expand(3, *ids.shape)
    assert torch.equal(pos, arange) and not deltas.any()
    np.testing.assert_array_equal(jpos, arange.numpy())
    assert not jdeltas.any()


# ---- cos / sin ------------------------------------------------------------------------------

def test_mrope_axes_literal():
    for side in (tm, jm):
        assert np.asarray(side.mrope_axes([2, 3, 3], 8, interleaved=False)).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
        assert np.asarray(side.mrope_axes([4, 2, 2], 8, interleaved=True)).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
        release = np.asarray(side.mrope_axes([24, 20, 20], 64, interleaved=True))  # Qwen3-VL's
        assert release[:6].tolist() == [0, 1, 2, 0, 1, 2] and release[57:].tolist() == [0, 1, 2, 0, 0, 0, 0]


def _hf_rope_tables(model, family, position_ids, q, k):
    """transformers' merged cos/sin f32[B,T,hd] and its rotated q, k ([B,N,T,hd])."""
    rotary = model.model.language_model.rotary_emb
    cos, sin = rotary(q, position_ids)
    module = {"qwen3_vl": hf_qwen3_vl, "qwen2_5_omni": hf_omni}.get(family, hf_qwen2_vl)
    return cos, sin, *module.apply_rotary_pos_emb(q, k, cos, sin)


def _shared_inv_freq(side_rope, family):
    block = {k: v for k, v in LAYOUT[family][0].items() if not k.startswith("mrope")}
    return side_rope.inv_freq(side_rope.read_rope({"rope_parameters": block}, TEXT["head_dim"]))


_jit_cos_sin = jax.jit(jm.mrope_cos_sin, static_argnums=(2, 3))


def _our_tables(family, pos, section, interleaved):
    tcos, tsin = tm.mrope_cos_sin(_shared_inv_freq(trope, family), pos, section, interleaved)
    jcos, jsin = _jit_cos_sin(_shared_inv_freq(jrope, family), jnp.asarray(pos.numpy()), tuple(section), interleaved)
    return (tcos, tsin), (np.asarray(jcos), np.asarray(jsin))


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen2_5_omni"])
def test_cos_sin_and_rotation_equal_transformers(models, family):
    ids, mask, grid = batch("mixed", "left")
    (pos, _), _ = ours(family, ids, mask, grid)
    B, T = ids.shape
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(B, 4, T, 16, generator=gen), torch.randn(B, 2, T, 16, generator=gen)
    cos, sin, q_rot, k_rot = _hf_rope_tables(models[family], family, pos, q, k)
    rope_block, interleaved = LAYOUT[family]
    (tcos, tsin), (jcos, jsin) = _our_tables(family, pos, rope_block["mrope_section"], interleaved)
    for ours_cos, ours_sin in ((tcos, tsin), (torch.tensor(jcos), torch.tensor(jsin))):
        assert ours_cos.shape == cos.shape == (B, T, 16)
        assert (ours_cos - cos).abs().max() <= 1e-6 and (ours_sin - sin).abs().max() <= 1e-6
    for x, x_rot in ((q, q_rot), (k, k_rot)):
        x_btnh = x.transpose(1, 2)
        t_rot = tlayers.apply_rope(x_btnh, tcos, tsin).transpose(1, 2)
        j_rot = np.asarray(jlayers.apply_rope(jnp.asarray(x_btnh.numpy()), jcos, jsin)).transpose(0, 2, 1, 3)
        assert (t_rot - x_rot).abs().max() <= 1e-6
        assert np.abs(j_rot - x_rot.numpy()).max() <= 1e-6


def test_text_positions_reduce_to_plain_rope():
    """[B,T] positions (or three equal rows) give the plain RoPE table, whatever the layout."""
    pos = torch.tensor([[0, 1, 2, 5], [3, 4, 5, 6]])
    inv, jinv = _shared_inv_freq(trope, "qwen2_vl"), _shared_inv_freq(jrope, "qwen2_vl")
    plain, jplain = trope.rope_cos_sin(inv, pos), jrope.rope_cos_sin(jinv, jnp.asarray(pos.numpy()))
    for interleaved, section in ((False, [2, 3, 3]), (True, [4, 2, 2])):
        for p3 in (pos, pos[None].expand(3, -1, -1)):
            assert all(torch.equal(g, p) for g, p in zip(tm.mrope_cos_sin(inv, p3, section, interleaved), plain))
            got = jm.mrope_cos_sin(jinv, p3.numpy(), section, interleaved)
            assert all(np.array_equal(g, p) for g, p in zip(got, jplain))


@pytest.mark.parametrize("family,section,interleaved", [
    ("qwen2_vl", [3, 3, 2], False),      # sections in the wrong order
    ("qwen2_5_omni", [3, 3, 2], False),
    ("qwen3_vl", [4, 2, 2], False),      # Qwen3-VL not interleaved
])
def test_wrong_layout_is_caught(models, family, section, interleaved):
    """The comparison above can fail: a wrong split differs from transformers on the image tokens by 1e4 times
    the tolerance (at head_dim 16, theta 1e6 the pairs that move turn slowly, so not by more)."""
    ids, mask, grid = batch("mixed", "left")
    (pos, _), _ = ours(family, ids, mask, grid)
    cos, sin, _, _ = _hf_rope_tables(models[family], family, pos, torch.zeros(3, 4, ids.shape[1], 16),
                                     torch.zeros(3, 2, ids.shape[1], 16))
    (tcos, _), (jcos, _) = _our_tables(family, pos, section, interleaved)
    assert (tcos - cos).abs().max() > 1e-2 and np.abs(jcos - cos.numpy()).max() > 1e-2


# ---- refusals -------------------------------------------------------------------------------

def _refuse(fn_args, match):
    """Both sides raise their MropeError with the same message."""
    fn, args, kwargs = fn_args
    with pytest.raises(tm.MropeError, match=match):
        getattr(tm, fn)(*args, **kwargs)
    np_args = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
    np_kwargs = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(jm.MropeError, match=match):
        getattr(jm, fn)(*np_args, **np_kwargs)


def _index(ids, grids, mask=None, video=False):
    ids = torch.tensor([ids])
    types = tm.token_types(ids, image_token_id=IMG, video_token_id=VID if video else None)
    return "get_rope_index", (ids, None if grids is None else torch.tensor(grids), mask), dict(
        mm_token_type_ids=types, spatial_merge_size=MERGE)


def _omni(ids, grids, mask=None):
    return "get_rope_index_omni", (torch.tensor([ids]), None if grids is None else torch.tensor(grids), mask), OMNI_IDS


def _omni_audio(ids, grids, seqlens):
    fn, args, kwargs = _omni(ids, grids)
    return fn, args, {**kwargs, "audio_seqlens": torch.tensor(seqlens, dtype=torch.long)}


ONE = [5] + _image(SQUARE) + [6]
REFUSALS = {
    "count-vs-grid": (_index([5, VS, IMG, IMG, IMG, VE], [SQUARE]), "has 3 image tokens"),
    "more-runs-than-grids": (_index(ONE + ONE, [SQUARE]), "more image-token runs"),
    "grid-left-over": (_index(ONE, [SQUARE, SQUARE]), "2 grids, the tokens hold 1"),
    "video-type": (_index([5, VS, VID, VID, VE], None, video=True), "only text"),
    "image-grid-t": (_index(ONE, [[2, 4, 4]]), "t=2"),
    "unmerged-grid": (_index(ONE, [[1, 4, 5]]), "not divisible"),
    "empty-row": (_index([5, 6], None, torch.tensor([[0, 0]])), "no real token"),
    "omni-count-vs-grid": (_omni([5, VS, IMG, IMG, IMG, VE, 6], [SQUARE]), "needs 4 image tokens"),
    "omni-video": (_omni([5, VS, VID, VE], None), "video token"),
    "omni-audio-without-seqlens": (_omni([5, AUDIO_START, AUDIO, 8] + ONE, [SQUARE]), "no audio_seqlens"),
    "omni-audio-wrong-length": (_omni_audio([5, AUDIO_START, AUDIO, 8] + ONE, [SQUARE], [10]), "give \\[2\\]"),
    "omni-audio-seqlens-left-over": (_omni_audio([5, AUDIO_START, AUDIO, AUDIO, 8] + ONE, [SQUARE], [10, 10]),
                                     "one per span"),
    "omni-audio-no-start": (_omni_audio([5, AUDIO, AUDIO, 8] + ONE, [SQUARE], [10]), "one audio_start"),
    "omni-audio-at-end": (_omni_audio(ONE + [AUDIO_START, AUDIO, AUDIO], [SQUARE], [10]), "then one more token"),
    "omni-audio-start-alone": (_omni_audio(ONE + [AUDIO_START, 8], [SQUARE], []), "not followed by audio"),
    "omni-stray-image": (_omni(ONE + [IMG, 7], [SQUARE]), "5 image tokens"),
    "omni-no-grid": (_omni(ONE, None), "no image_grid_thw"),
    "omni-ends-in-vision-start": (_omni([5, VS], [SQUARE]), "ends in vision_start"),
    "omni-image-at-end": (_omni([5] + _image(SQUARE)[:-1], [SQUARE]), "then vision_end"),
    "omni-grid-left-over": (_omni(ONE, [SQUARE, SQUARE]), "2 grids, the tokens hold 1"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(case):
    call, match = REFUSALS[case]
    _refuse(call, match)


@pytest.mark.parametrize("section,interleaved,match", [
    ([2, 3, 4], False, "summing to head_dim / 2 = 8"),
    ([2, 3], False, "three counts"),
    ([2, 3, 3], True, "gives t/h/w"),  # transformers' interleave rotates 3/3/2 pairs for this section
])
def test_bad_sections(section, interleaved, match):
    inv = _shared_inv_freq(trope, "qwen2_vl")
    pos = torch.zeros(3, 1, 2, dtype=torch.long)
    with pytest.raises(tm.MropeError, match=match):
        tm.mrope_cos_sin(inv, pos, section, interleaved)
    with pytest.raises(jm.MropeError, match=match):
        jm.mrope_cos_sin(inv.numpy(), pos.numpy(), section, interleaved)


def test_twins_share_names():
    assert tm.__all__ == jm.__all__
