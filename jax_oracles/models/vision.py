"""The Qwen vision towers in Flax Linen: the torch-free twin of torch_sources/models/vision.py (Qwen2-VL,
Qwen2.5-VL and Qwen2.5-Omni's, Qwen3-VL; same public names in the same order, same numerics; see the torch
file's docstring for what the towers share).

grid_thw is static host data (a numpy array or nested tuples, never traced): everything that depends only
on it (segment bounds, the padded-segment gather, RoPE cos/sin, Qwen2.5-VL's window permutation, Qwen3-VL's
interpolation taps and weights) is numpy, computed once per trace, so under jit it is a literal and only
pixel_values flows. jit a tower with grid_thw closed over or as a static argument (nested tuples:
`jax.jit(tower.apply, static_argnums=2)`). Params are named after the HF keys (`blocks_0/attn/qkv/kernel` =
`blocks.0.attn.qkv.weight`.T, `merger/mlp_0/kernel`, norms' `weight`/`bias`, `pos_embed/embedding`); the
Conv3d weight [E,C,T,ps,ps] is the Dense kernel `patch_embed/proj/kernel` = weight.reshape(E, -1).T. The
tower's projections are plain Dense layers: LoRA never targets the (frozen) vision tower.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_oracles.models import rope
from jax_oracles.models.config_keys import ConfigError, KeyAudit
from jax_oracles.models.layers import ACTIVATIONS, GatedMLP, LayerNorm, RMSNorm, apply_rope, eager_attention

__all__ = [
    "VISION_ACTIVATIONS", "Qwen2VLVisionConfig", "Qwen2_5VLVisionConfig", "Qwen3VLVisionConfig",
    "vision_cu_seqlens", "segment_index", "vision_rope_positions", "vision_rope_cos_sin", "window_index",
    "to_window_order", "from_window_order", "pos_embed_interpolation", "interpolate_pos_embed",
    "vision_attention", "PatchEmbed", "VisionAttention", "VisionMlp", "VisionBlock",
    "Qwen2VLVisionBlock", "Qwen2_5VLVisionBlock", "Qwen3VLVisionBlock", "PatchMerger", "Qwen3VLPatchMerger",
    "Qwen2VisionTransformer", "Qwen2_5VisionTransformer", "Qwen3VisionTransformer", "vision_block", "vision_merger",
]


def _quick_gelu(x):  # HF's QuickGELUActivation (Qwen2-VL's vision MLP)
    return x * jax.nn.sigmoid(1.702 * x)


VISION_ACTIVATIONS = {**ACTIVATIONS, "quick_gelu": _quick_gelu}
NORM_EPS = 1e-6  # every norm of these towers (transformers hard-codes it; no config key)
_f32 = np.float32


# ---- configs --------------------------------------------------------------------------------

_GEOMETRY = frozenset({"depth", "hidden_size", "hidden_act", "num_heads", "in_channels", "patch_size",
                       "spatial_merge_size", "temporal_patch_size", "rope_parameters", "rope_theta"})
_LEGACY = {  # keys release config.json files carry that transformers 5.24's towers do not read
    "in_chans": "legacy name; transformers 5.24 reads in_channels",
    "spatial_patch_size": "legacy name; transformers 5.24 reads patch_size",
    "tokens_per_second": "the LM's video positions (M-RoPE), not the tower",
}
QWEN2_VL_KEYS = KeyAudit("qwen2_vl vision", _GEOMETRY | {"embed_dim", "mlp_ratio"}, _LEGACY)
QWEN2_5_VL_KEYS = KeyAudit(
    "qwen2_5_vl vision", _GEOMETRY | {"intermediate_size", "out_hidden_size", "window_size", "fullatt_block_indexes"},
    {**_LEGACY, "embed_dim": "Omni's legacy key; transformers 5.24's tower reads hidden_size"})
QWEN3_VL_KEYS = KeyAudit("qwen3_vl vision", _GEOMETRY | {"intermediate_size", "out_hidden_size",
                                                         "num_position_embeddings", "deepstack_visual_indexes"},
                         _LEGACY)


def _read(cls, audit: KeyAudit, d: dict, **extra):
    """The HF vision_config dict as `cls`: every key accounted for (audit), the axial RoPE's theta read from
    rope_parameters (transformers 5) or rope_theta, lists as tuples (hashable, so a config can be static)."""
    audit.check(d)
    d = dict(d)
    rope_parameters = d.pop("rope_parameters", None) or {}
    if rope_parameters.get("rope_type", "axial") != "axial" or set(rope_parameters) - {"rope_type", "rope_theta"}:
        raise ConfigError(f"{audit.family} config: rope_parameters={rope_parameters!r} (only axial RoPE with a theta)")
    d["rope_theta"] = float(rope_parameters.get("rope_theta", d.get("rope_theta", 10_000.0)))
    d = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
    return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d}, **extra)


@dataclass(frozen=True)
class Qwen2VLVisionConfig:
    depth: int
    embed_dim: int
    hidden_size: int  # the merger's output: the LM's hidden size
    num_heads: int
    mlp_ratio: float = 4
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10_000.0

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2VLVisionConfig":
        return _read(cls, QWEN2_VL_KEYS, d)

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def out_hidden_size(self) -> int:
        return self.hidden_size


@dataclass(frozen=True)
class Qwen2_5VLVisionConfig:
    """Also Qwen2.5-Omni's vision encoder: `separate_qkv` (attn.q/k/v instead of a fused attn.qkv), set by
    from_hf when model_type is qwen2_5_omni_vision_encoder."""
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    hidden_act: str = "silu"
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10_000.0
    separate_qkv: bool = False

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2_5VLVisionConfig":
        return _read(cls, QWEN2_5_VL_KEYS, d, separate_qkv=d.get("model_type") == "qwen2_5_omni_vision_encoder")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class Qwen3VLVisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    rope_theta: float = 10_000.0

    def __post_init__(self):
        assert self.num_grid_per_side ** 2 == self.num_position_embeddings, "the learned position grid is square"
        assert all(0 <= i < self.depth for i in self.deepstack_visual_indexes), "a deepstack index names no block"

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen3VLVisionConfig":
        return _read(cls, QWEN3_VL_KEYS, d)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_grid_per_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)


# ---- host-side bookkeeping (numpy, a function of grid_thw only) -----------------------------

def _host_grid(grid_thw) -> np.ndarray:  # -> i64[I,3]
    if isinstance(grid_thw, jax.core.Tracer):
        raise TypeError("grid_thw must be static host data (numpy or nested tuples), not a traced array")
    return np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)


def vision_cu_seqlens(grid_thw):  # i64[I,3] -> i32[S+1]: one segment per temporal patch of each image
    grid = _host_grid(grid_thw)
    seqlens = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])
    return np.concatenate([[0], np.cumsum(seqlens)]).astype(np.int32)


def segment_index(cu_seqlens):  # i32[S+1] -> index i64[S,L], valid bool[S,L] (L: the longest segment)
    """Row s lists segment s's positions, padded with 0 (invalid) to the longest: packed -> padded batch."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    offsets = np.arange(lengths.max())
    valid = offsets[None] < lengths[:, None]
    return np.where(valid, starts[:, None] + offsets[None], 0), valid


def vision_rope_positions(grid_thw, merge_size: int):  # i64[I,3] -> i64[P,2]: (row, column) of each patch
    """Each patch's (h, w) in merge-block order (the merge x merge neighbours of one merged token are
    consecutive), the same for every temporal patch (transformers' get_vision_position_ids)."""
    out = []
    for t, h, w in _host_grid(grid_thw).tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // merge_size, merge_size, w // merge_size, merge_size)
        pos = np.stack([rows.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1),
                        cols.reshape(blocks).transpose(0, 2, 1, 3).reshape(-1)], axis=-1)
        out.append(np.tile(pos, (t, 1)))
    return np.concatenate(out).astype(np.int64)


def vision_rope_cos_sin(positions, head_dim: int, theta: float):  # i64[P,2] -> cos, sin f32[P,head_dim]
    """Axial RoPE: head_dim/4 frequencies (theta^(-4i/head_dim)) turned by the row, the same ones by the
    column; [row angles, column angles] twice over (rotate-half layout, no partial rotation). numpy float32."""
    half = head_dim // 2
    inv_freq = rope.inv_freq(rope.Rope("default", theta, half, half))  # f32[head_dim/4]
    freqs = (np.asarray(positions)[..., None].astype(_f32) * inv_freq).reshape(len(positions), -1)  # f32[P,hd/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb), np.sin(emb)


def window_index(grid_thw, window_size: int, spatial_merge_size: int, patch_size: int):
    """Qwen2.5-VL's windows: (perm i64[P/merge^2], cu_window_seqlens i32[W+1]).

    perm lists the merged tokens window by window (windows row-major within each temporal patch of each
    image, window_size px = window_size/patch/merge merged tokens a side, cut short at the image's edge);
    cu_window_seqlens bounds each window in patches. transformers pads each side by a whole window more
    when it divides evenly and then drops the empty windows (unique_consecutive); the result is the same.
    """
    m, side = spatial_merge_size, window_size // spatial_merge_size // patch_size
    perm, cu, offset = [], [0], 0
    for t, h, w in _host_grid(grid_thw).tolist():
        gh, gw = h // m, w // m
        nh, nw = -(-gh // side), -(-gw // side)
        index = np.pad(np.arange(t * gh * gw).reshape(t, gh, gw), ((0, 0), (0, nh * side - gh), (0, nw * side - gw)),
                       constant_values=-1)
        windows = index.reshape(t, nh, side, nw, side).transpose(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
        inside = windows >= 0
        perm.append(windows[inside] + offset)
        cu.extend((np.cumsum(inside.sum(1)) * m * m + cu[-1]).tolist())
        offset += t * gh * gw
    return np.concatenate(perm).astype(np.int64), np.asarray(cu, dtype=np.int32)


def to_window_order(x, perm, merge_unit: int):  # f32[P,D], i64[P/u] -> f32[P,D]: whole merge groups move
    return x.reshape(-1, merge_unit, x.shape[-1])[perm].reshape(x.shape)


def from_window_order(merged, perm):  # f32[P/u,D] -> f32[P/u,D]: the merged tokens back in image order
    return merged[np.argsort(perm)]


def _axis_taps(index, size, side: int):  # i64[P], i64[P] -> taps i64[P,2], weights f32[P,2]
    # align_corners=True: target 0 and size-1 land on source 0 and side-1; float32 in transformers' op order
    src = index.astype(_f32) * _f32(side - 1) / np.maximum(size - 1, 1).astype(_f32)
    floor = np.floor(src)
    offsets = np.arange(2)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
    weights = np.maximum(_f32(1) - np.abs(src[:, None] - floor[:, None] - offsets.astype(_f32)), _f32(0))
    return taps, weights


def pos_embed_interpolation(grid_thw, num_grid_per_side: int, merge_size: int):
    """Qwen3-VL's learned side x side position table, bilinearly resized (align_corners=True) to each image's
    h x w: indices i64[P,4] into the flattened table and weights f32[P,4], patches in merge-block order."""
    grid = _host_grid(grid_thw)
    positions = vision_rope_positions(grid, merge_size)  # the (row, col) of each patch
    counts = grid.prod(-1)
    h_taps, h_weights = _axis_taps(positions[:, 0], np.repeat(grid[:, 1], counts), num_grid_per_side)
    w_taps, w_weights = _axis_taps(positions[:, 1], np.repeat(grid[:, 2], counts), num_grid_per_side)
    indices = (h_taps[:, :, None] * num_grid_per_side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def interpolate_pos_embed(table, indices, weights):  # f32[n,D], i64[P,4], f32[P,4] -> f32[P,D]
    return (table[indices] * weights[:, :, None]).sum(1)


# ---- attention ------------------------------------------------------------------------------

def vision_attention(q, k, v, cu_seqlens, scale: float):
    """q, k, v: f32[P,N,hd]  cu_seqlens: i32[S+1] (host) -> f32[P,N,hd]. Full (bidirectional) attention
    within each segment, none across: the segments as a padded batch, the padding keys masked (exact zeros
    after the fp32 softmax, as transformers' per-segment loop), the padding queries dropped."""
    index, valid = segment_index(cu_seqlens)
    S, L = index.shape
    mask = np.broadcast_to(valid[:, None, :], (S, L, L))  # bool[S,L,L]: every query sees its segment's keys
    out = eager_attention(q[index], k[index], v[index], jnp.asarray(mask), scale)  # f32[S,L,N,hd]
    return out.reshape(S * L, *out.shape[2:])[np.flatnonzero(valid)]


# ---- modules --------------------------------------------------------------------------------

class PatchEmbed(nn.Module):
    """Conv3d(kernel = stride = (T, ps, ps)) on one patch = one matmul with the flattened kernel, in the
    processor's (C, T, ps, ps) flattening. `proj/weight` keeps the checkpoint's Conv3d layout f32[E,C,T,ps,ps]
    (so the conversion table is a pure rename, invertible by hf_layout)."""
    embed_dim: int
    in_channels: int
    temporal_patch_size: int
    patch_size: int
    use_bias: bool = False

    @nn.compact
    def __call__(self, pixel_values):  # f32[P, C*T*ps*ps] -> f32[P,E]
        shape = (self.embed_dim, self.in_channels, self.temporal_patch_size, self.patch_size, self.patch_size)
        weight = self.param("weight", nn.initializers.lecun_normal(), shape, jnp.float32)
        out = pixel_values @ weight.reshape(self.embed_dim, -1).T
        if self.use_bias:
            out = out + self.param("bias", nn.initializers.zeros_init(), (self.embed_dim,), jnp.float32)
        return out


def _patch_embed(c, embed_dim: int, use_bias: bool = False) -> PatchEmbed:
    return PatchEmbed(embed_dim, c.in_channels, c.temporal_patch_size, c.patch_size, use_bias, name="patch_embed")


class VisionAttention(nn.Module):
    dim: int
    num_heads: int
    separate_qkv: bool = False

    @nn.compact
    def __call__(self, x, cu_seqlens, cos, sin):  # x: f32[P,D]  cu_seqlens: i32[S+1] (host)  cos, sin: f32[P,hd]
        P, N, hd = x.shape[0], self.num_heads, self.dim // self.num_heads
        if self.separate_qkv:  # Qwen2.5-Omni
            q, k, v = (nn.Dense(self.dim, name=n)(x).reshape(P, N, hd) for n in ("q", "k", "v"))
        else:
            qkv = nn.Dense(3 * self.dim, name="qkv")(x).reshape(P, 3, N, hd)  # [Q; K; V] columns
            q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = (apply_rope(t[None], cos[None], sin[None])[0] for t in (q, k))
        out = vision_attention(q, k, v, cu_seqlens, hd ** -0.5)
        return nn.Dense(self.dim, name="proj")(out.reshape(P, N * hd))


class VisionMlp(nn.Module):
    """out(act(in(x))) with biases: Qwen2-VL's fc1/fc2 (quick_gelu), Qwen3-VL's linear_fc1/linear_fc2."""
    dim: int
    hidden: int
    act: str
    names: tuple[str, str] = ("fc1", "fc2")

    @nn.compact
    def __call__(self, x):
        up = nn.Dense(self.hidden, name=self.names[0])
        down = nn.Dense(self.dim, name=self.names[1])
        return down(VISION_ACTIVATIONS[self.act](up(x)))


class VisionBlock(nn.Module):
    """Pre-norm: x + attn(norm1(x)), then x + mlp(norm2(x)). `norm` is LayerNorm or RMSNorm (eps 1e-6);
    `mlp(name=)` builds the family's MLP."""
    dim: int
    num_heads: int
    norm: type
    mlp: object
    separate_qkv: bool = False

    @nn.compact
    def __call__(self, x, cu_seqlens, cos, sin):  # f32[P,D] -> f32[P,D]
        attn = VisionAttention(self.dim, self.num_heads, self.separate_qkv, name="attn")
        x = x + attn(self.norm(NORM_EPS, name="norm1")(x), cu_seqlens, cos, sin)
        return x + self.mlp(name="mlp")(self.norm(NORM_EPS, name="norm2")(x))


def Qwen2VLVisionBlock(c: Qwen2VLVisionConfig, name: str | None = None) -> VisionBlock:
    return VisionBlock(c.embed_dim, c.num_heads, LayerNorm,
                       functools.partial(VisionMlp, c.embed_dim, int(c.embed_dim * c.mlp_ratio), c.hidden_act),
                       name=name)


def Qwen2_5VLVisionBlock(c: Qwen2_5VLVisionConfig, name: str | None = None) -> VisionBlock:
    return VisionBlock(c.hidden_size, c.num_heads, RMSNorm,
                       functools.partial(GatedMLP, c.hidden_size, c.intermediate_size, c.hidden_act, True),
                       c.separate_qkv, name=name)


def Qwen3VLVisionBlock(c: Qwen3VLVisionConfig, name: str | None = None) -> VisionBlock:
    return VisionBlock(c.hidden_size, c.num_heads, LayerNorm, functools.partial(
        VisionMlp, c.hidden_size, c.intermediate_size, c.hidden_act, ("linear_fc1", "linear_fc2")), name=name)


class PatchMerger(nn.Module):
    """Qwen2-VL (LayerNorm) and Qwen2.5-VL (RMSNorm): ln_q per patch, the merge^2 neighbours concatenated,
    Linear-GELU-Linear (`mlp_0`, `mlp_2`)."""
    dim: int
    spatial_merge_size: int
    norm: type = LayerNorm

    @nn.compact
    def __call__(self, x):  # f32[P,C] -> f32[P/merge^2, dim]
        hidden = x.shape[-1] * self.spatial_merge_size ** 2
        x = self.norm(NORM_EPS, name="ln_q")(x).reshape(-1, hidden)
        x = ACTIVATIONS["gelu"](nn.Dense(hidden, name="mlp_0")(x))
        return nn.Dense(self.dim, name="mlp_2")(x)


class Qwen3VLPatchMerger(nn.Module):
    """Qwen3-VL's merger: LayerNorm per patch, or (use_postshuffle_norm, the deepstack mergers) over the
    concatenated merge^2 neighbours; then linear_fc1-GELU-linear_fc2."""
    config: Qwen3VLVisionConfig
    use_postshuffle_norm: bool = False

    @nn.compact
    def __call__(self, x):  # f32[P,C] -> f32[P/merge^2, out_hidden]
        c = self.config
        hidden = c.hidden_size * c.spatial_merge_size ** 2
        norm = LayerNorm(NORM_EPS, name="norm")
        x = norm(x.reshape(-1, hidden)) if self.use_postshuffle_norm else norm(x).reshape(-1, hidden)
        x = ACTIVATIONS["gelu"](nn.Dense(hidden, name="linear_fc1")(x))
        return nn.Dense(c.out_hidden_size, name="linear_fc2")(x)


# ---- towers ---------------------------------------------------------------------------------

def _rope_tables(c, grid_thw):  # -> cos, sin f32[P, head_dim] (numpy)
    return vision_rope_cos_sin(vision_rope_positions(grid_thw, c.spatial_merge_size), c.head_dim, c.rope_theta)


class Qwen2VisionTransformer(nn.Module):
    config: Qwen2VLVisionConfig

    @nn.compact
    def __call__(self, pixel_values, grid_thw):
        """pixel_values f32[P, C*T*ps*ps], grid_thw (host) [I,3] -> merged tokens f32[P/merge^2, hidden_size]."""
        c, grid = self.config, _host_grid(grid_thw)
        cu_seqlens = vision_cu_seqlens(grid)
        cos, sin = _rope_tables(c, grid)
        x = _patch_embed(c, c.embed_dim)(pixel_values)
        for i in range(c.depth):
            x = Qwen2VLVisionBlock(c, name=f"blocks_{i}")(x, cu_seqlens, cos, sin)
        return PatchMerger(c.hidden_size, c.spatial_merge_size, name="merger")(x)


class Qwen2_5VisionTransformer(nn.Module):
    """Qwen2.5-VL's tower, and Qwen2.5-Omni's (config.separate_qkv)."""
    config: Qwen2_5VLVisionConfig

    @nn.compact
    def __call__(self, pixel_values, grid_thw):
        """pixel_values f32[P, C*T*ps*ps], grid_thw (host) [I,3] -> merged tokens f32[P/merge^2, out_hidden_size].
        The blocks run in window order (windowed blocks: cu_window_seqlens; fullatt_block_indexes: the whole
        segment, whose bounds the permutation keeps); the merged tokens come back in image order."""
        c, grid, unit = self.config, _host_grid(grid_thw), self.config.spatial_merge_size ** 2
        perm, cu_window_seqlens = window_index(grid, c.window_size, c.spatial_merge_size, c.patch_size)
        cu_seqlens = vision_cu_seqlens(grid)
        cos, sin = (to_window_order(t, perm, unit) for t in _rope_tables(c, grid))
        x = to_window_order(_patch_embed(c, c.hidden_size)(pixel_values), perm, unit)
        for i in range(c.depth):
            x = Qwen2_5VLVisionBlock(c, name=f"blocks_{i}")(
                x, cu_seqlens if i in c.fullatt_block_indexes else cu_window_seqlens, cos, sin)
        return from_window_order(PatchMerger(c.out_hidden_size, c.spatial_merge_size, RMSNorm, name="merger")(x), perm)


class Qwen3VisionTransformer(nn.Module):
    config: Qwen3VLVisionConfig

    @nn.compact
    def __call__(self, pixel_values, grid_thw):
        """pixel_values f32[P, C*T*ps*ps], grid_thw (host) [I,3] -> (merged tokens f32[P/merge^2,
        out_hidden_size], deepstack features [f32[P/merge^2, out_hidden_size]], in block order: the output of
        block i through deepstack_merger_list_{deepstack_visual_indexes.index(i)})."""
        c, grid = self.config, _host_grid(grid_thw)
        indices, weights = pos_embed_interpolation(grid, c.num_grid_per_side, c.spatial_merge_size)
        cu_seqlens = vision_cu_seqlens(grid)
        cos, sin = _rope_tables(c, grid)
        table = nn.Embed(c.num_position_embeddings, c.hidden_size, name="pos_embed").embedding  # f32[n,D]
        x = _patch_embed(c, c.hidden_size, use_bias=True)(pixel_values)
        x = x + interpolate_pos_embed(table, indices, weights)
        deepstack = []
        for i in range(c.depth):
            x = Qwen3VLVisionBlock(c, name=f"blocks_{i}")(x, cu_seqlens, cos, sin)
            if i in c.deepstack_visual_indexes:
                j = c.deepstack_visual_indexes.index(i)
                deepstack.append(Qwen3VLPatchMerger(c, use_postshuffle_norm=True, name=f"deepstack_merger_list_{j}")(x))
        return Qwen3VLPatchMerger(c, name="merger")(x), deepstack


# ---- a tower's parts by its config (what the grader's tower-level checks build) -------------------

def vision_block(c, name: str | None = None) -> VisionBlock:
    """One block of the tower `c` configures (Qwen2-VL, Qwen2.5-VL / Omni, Qwen3-VL)."""
    blocks = {Qwen2VLVisionConfig: Qwen2VLVisionBlock, Qwen2_5VLVisionConfig: Qwen2_5VLVisionBlock,
              Qwen3VLVisionConfig: Qwen3VLVisionBlock}
    return blocks[type(c)](c, name=name)


def vision_merger(c, name: str | None = None) -> nn.Module:
    """The final patch merger of the tower `c` configures."""
    if isinstance(c, Qwen3VLVisionConfig):
        return Qwen3VLPatchMerger(c, name=name)
    if isinstance(c, Qwen2_5VLVisionConfig):
        return PatchMerger(c.out_hidden_size, c.spatial_merge_size, RMSNorm, name=name)
    return PatchMerger(c.hidden_size, c.spatial_merge_size, name=name)
