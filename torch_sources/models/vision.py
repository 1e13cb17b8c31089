"""The Qwen vision towers in pure PyTorch, eager fp32: Qwen2-VL, Qwen2.5-VL (and Qwen2.5-Omni's, the same
tower with separate q/k/v), Qwen3-VL. jax_oracles/models/vision.py is its twin.

transformers 5.24's Qwen2VisionTransformerPretrainedModel, Qwen2_5_VisionTransformerPretrainedModel,
Qwen2_5OmniVisionEncoder and Qwen3VLVisionModel, composed from the shared layers (models/layers.py). A tower
takes the processor's flattened patches, pixel_values f32[P, C*T*ps*ps] (P = sum of t*h*w over the images;
the merge^2 patches of one merged token are consecutive, "merge-block order"), and grid_thw i64[I,3]; it
returns the merged tokens f32[P/merge^2, out_hidden] (Qwen3-VL: and its deepstack features). What they share:
- patch embedding: a Conv3d whose stride is its kernel, i.e. one matmul per flattened patch;
- 2D axial RoPE over the whole head dim: the first half of each head's frequency pairs turns with the patch's
  row, the second half with its column;
- attention bidirectional within a segment (one temporal patch of one image, h*w patches), never across;
  Qwen2.5-VL's windowed blocks attend within windows of window_size px, after a permutation of the merged
  tokens that makes each window contiguous (undone after the merger);
- a patch merger: norm, the merge^2 neighbours concatenated, a two-layer exact-GELU MLP.
Everything that depends only on grid_thw (segments, positions, windows, interpolation taps) is host-side
bookkeeping. Submodule names equal transformers', so `tower.load_state_dict(hf_tower.state_dict())` loads
strictly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from torch_sources.models import rope
from torch_sources.models.config_keys import ConfigError, KeyAudit
from torch_sources.models.layers import ACTIVATIONS, GatedMLP, LayerNorm, RMSNorm, apply_rope, eager_attention

__all__ = [
    "VISION_ACTIVATIONS", "Qwen2VLVisionConfig", "Qwen2_5VLVisionConfig", "Qwen3VLVisionConfig",
    "vision_cu_seqlens", "segment_index", "vision_rope_positions", "vision_rope_cos_sin", "window_index",
    "to_window_order", "from_window_order", "pos_embed_interpolation", "interpolate_pos_embed",
    "vision_attention", "PatchEmbed", "VisionAttention", "VisionMlp", "VisionBlock",
    "Qwen2VLVisionBlock", "Qwen2_5VLVisionBlock", "Qwen3VLVisionBlock", "PatchMerger", "Qwen3VLPatchMerger",
    "Qwen2VisionTransformer", "Qwen2_5VisionTransformer", "Qwen3VisionTransformer", "vision_block", "vision_merger",
]


def _quick_gelu(x):  # HF's QuickGELUActivation (Qwen2-VL's vision MLP)
    return x * torch.sigmoid(1.702 * x)


VISION_ACTIVATIONS = {**ACTIVATIONS, "quick_gelu": _quick_gelu}
NORM_EPS = 1e-6  # every norm of these towers (transformers hard-codes it; no config key)


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


# ---- host-side bookkeeping (a function of grid_thw only) ------------------------------------

def vision_cu_seqlens(grid_thw):  # i64[I,3] -> i32[S+1]: one segment per temporal patch of each image
    seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))


def segment_index(cu_seqlens):  # i32[S+1] -> index i64[S,L], valid bool[S,L] (L: the longest segment)
    """Row s lists segment s's positions, padded with 0 (invalid) to the longest: packed -> padded batch."""
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    offsets = torch.arange(int(lengths.max()))
    valid = offsets[None] < lengths[:, None]
    return torch.where(valid, starts[:, None] + offsets[None], 0), valid


def vision_rope_positions(grid_thw, merge_size: int):  # i64[I,3] -> i64[P,2]: (row, column) of each patch
    """Each patch's (h, w) in merge-block order (the merge x merge neighbours of one merged token are
    consecutive), the same for every temporal patch (transformers' get_vision_position_ids)."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge_size, merge_size, w // merge_size, merge_size)
        pos = torch.stack([rows.reshape(blocks).transpose(1, 2).flatten(),
                           cols.reshape(blocks).transpose(1, 2).flatten()], dim=-1)
        out.append(pos.repeat(t, 1))
    return torch.cat(out)


def vision_rope_cos_sin(positions, head_dim: int, theta: float):  # i64[P,2] -> cos, sin f32[P,head_dim]
    """Axial RoPE: head_dim/4 frequencies (theta^(-4i/head_dim)) turned by the row, the same ones by the
    column; [row angles, column angles] twice over (rotate-half layout, no partial rotation)."""
    half = head_dim // 2
    inv_freq = rope.inv_freq(rope.Rope("default", theta, half, half))  # f32[head_dim/4]
    freqs = (positions[..., None].float() * inv_freq).flatten(1)  # f32[P, head_dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def window_index(grid_thw, window_size: int, spatial_merge_size: int, patch_size: int):
    """Qwen2.5-VL's windows: (perm i64[P/merge^2], cu_window_seqlens i32[W+1]).

    perm lists the merged tokens window by window (windows row-major within each temporal patch of each
    image, window_size px = window_size/patch/merge merged tokens a side, cut short at the image's edge);
    cu_window_seqlens bounds each window in patches. transformers pads each side by a whole window more
    when it divides evenly and then drops the empty windows (unique_consecutive); the result is the same.
    """
    m, side = spatial_merge_size, window_size // spatial_merge_size // patch_size
    perm, cu, offset = [], [0], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // m, w // m
        nh, nw = -(-gh // side), -(-gw // side)
        index = F.pad(torch.arange(t * gh * gw).reshape(t, gh, gw), (0, nw * side - gw, 0, nh * side - gh), value=-1)
        windows = index.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
        inside = windows >= 0
        perm.append(windows[inside] + offset)
        cu.extend((inside.sum(1).cumsum(0) * m * m + cu[-1]).tolist())
        offset += t * gh * gw
    return torch.cat(perm), torch.tensor(cu, dtype=torch.int32)


def to_window_order(x, perm, merge_unit: int):  # f32[P,D], i64[P/u] -> f32[P,D]: whole merge groups move
    return x.reshape(-1, merge_unit, x.shape[-1])[perm].reshape(x.shape)


def from_window_order(merged, perm):  # f32[P/u,D] -> f32[P/u,D]: the merged tokens back in image order
    return merged[torch.argsort(perm)]


def _axis_taps(index, size, side: int):  # i64[P], i64[P] -> taps i64[P,2], weights f32[P,2]
    # align_corners=True: target 0 and size-1 land on source 0 and side-1; float32 in transformers' op order
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def pos_embed_interpolation(grid_thw, num_grid_per_side: int, merge_size: int):
    """Qwen3-VL's learned side x side position table, bilinearly resized (align_corners=True) to each image's
    h x w: indices i64[P,4] into the flattened table and weights f32[P,4], patches in merge-block order."""
    positions = vision_rope_positions(grid_thw, merge_size)  # the (row, col) of each patch
    counts = grid_thw.prod(-1)
    h_taps, h_weights = _axis_taps(positions[:, 0], torch.repeat_interleave(grid_thw[:, 1], counts), num_grid_per_side)
    w_taps, w_weights = _axis_taps(positions[:, 1], torch.repeat_interleave(grid_thw[:, 2], counts), num_grid_per_side)
    indices = (h_taps[:, :, None] * num_grid_per_side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return indices, weights


def interpolate_pos_embed(table, indices, weights):  # f32[n,D], i64[P,4], f32[P,4] -> f32[P,D]
    return (table[indices] * weights[:, :, None]).sum(1)


# ---- attention ------------------------------------------------------------------------------

def vision_attention(q, k, v, cu_seqlens, scale: float):
    """q, k, v: f32[P,N,hd]  cu_seqlens: i32[S+1] -> f32[P,N,hd]. Full (bidirectional) attention within
    each segment, none across: the segments as a padded batch, the padding keys masked (exact zeros after
    the fp32 softmax, as transformers' per-segment loop), the padding queries dropped."""
    index, valid = segment_index(cu_seqlens)
    S, L = index.shape
    mask = valid[:, None, :].expand(S, L, L)  # bool[S,L,L]: every query sees its segment's keys
    out = eager_attention(q[index], k[index], v[index], mask, scale)  # f32[S,L,N,hd]
    return out[valid]


# ---- modules --------------------------------------------------------------------------------

class PatchEmbed(nn.Module):
    """Conv3d(kernel = stride = (T, ps, ps)) on one patch = one matmul with the flattened kernel, in the
    processor's (C, T, ps, ps) flattening. `proj` holds the Conv3d weight under transformers' name."""

    def __init__(self, in_channels: int, temporal_patch_size: int, patch_size: int, embed_dim: int, bias: bool = False):
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel, stride=kernel, bias=bias)

    def forward(self, pixel_values):  # f32[P, C*T*ps*ps] -> f32[P,E]
        weight = self.proj.weight.reshape(self.proj.out_channels, -1)  # f32[E, C*T*ps*ps]
        return F.linear(pixel_values, weight, self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, separate_qkv: bool = False):
        super().__init__()
        self.num_heads, self.head_dim, self.separate_qkv = num_heads, dim // num_heads, separate_qkv
        if separate_qkv:  # Qwen2.5-Omni
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        else:
            self.qkv = nn.Linear(dim, 3 * dim)  # [Q; K; V] rows
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens, cos, sin):  # x: f32[P,D]  cu_seqlens: i32[S+1]  cos, sin: f32[P,hd]
        P, N, hd = x.shape[0], self.num_heads, self.head_dim
        if self.separate_qkv:
            q, k, v = (proj(x).view(P, N, hd) for proj in (self.q, self.k, self.v))
        else:
            q, k, v = self.qkv(x).view(P, 3, N, hd).unbind(1)
        q, k = (apply_rope(t[None], cos[None], sin[None])[0] for t in (q, k))
        return self.proj(vision_attention(q, k, v, cu_seqlens, hd ** -0.5).reshape(P, N * hd))


class VisionMlp(nn.Module):
    """out(act(in(x))) with biases: Qwen2-VL's fc1/fc2 (quick_gelu), Qwen3-VL's linear_fc1/linear_fc2."""

    def __init__(self, dim: int, hidden: int, act: str, names: tuple[str, str] = ("fc1", "fc2")):
        super().__init__()
        self.names, self.act = names, VISION_ACTIVATIONS[act]
        setattr(self, names[0], nn.Linear(dim, hidden))
        setattr(self, names[1], nn.Linear(hidden, dim))

    def forward(self, x):
        up, down = (getattr(self, n) for n in self.names)
        return down(self.act(up(x)))


class VisionBlock(nn.Module):
    """Pre-norm: x + attn(norm1(x)), then x + mlp(norm2(x)). `norm` is LayerNorm or RMSNorm (eps 1e-6);
    `mlp` builds the family's MLP."""

    def __init__(self, dim: int, num_heads: int, norm, mlp, separate_qkv: bool = False):
        super().__init__()
        self.norm1, self.norm2 = norm(dim, NORM_EPS), norm(dim, NORM_EPS)
        self.attn = VisionAttention(dim, num_heads, separate_qkv)
        self.mlp = mlp()

    def forward(self, x, cu_seqlens, cos, sin):  # f32[P,D] -> f32[P,D]
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


def Qwen2VLVisionBlock(c: Qwen2VLVisionConfig) -> VisionBlock:
    return VisionBlock(c.embed_dim, c.num_heads, LayerNorm,
                       functools.partial(VisionMlp, c.embed_dim, int(c.embed_dim * c.mlp_ratio), c.hidden_act))


def Qwen2_5VLVisionBlock(c: Qwen2_5VLVisionConfig) -> VisionBlock:
    return VisionBlock(c.hidden_size, c.num_heads, RMSNorm,
                       functools.partial(GatedMLP, c.hidden_size, c.intermediate_size, c.hidden_act, True),
                       c.separate_qkv)


def Qwen3VLVisionBlock(c: Qwen3VLVisionConfig) -> VisionBlock:
    return VisionBlock(c.hidden_size, c.num_heads, LayerNorm, functools.partial(
        VisionMlp, c.hidden_size, c.intermediate_size, c.hidden_act, ("linear_fc1", "linear_fc2")))


class PatchMerger(nn.Module):
    """Qwen2-VL (LayerNorm) and Qwen2.5-VL (RMSNorm): ln_q per patch, the merge^2 neighbours concatenated,
    Linear-GELU-Linear (`mlp.0`, `mlp.2`)."""

    def __init__(self, dim: int, context_dim: int, spatial_merge_size: int, norm=LayerNorm):
        super().__init__()
        self.hidden_size = context_dim * spatial_merge_size ** 2
        self.ln_q = norm(context_dim, NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(),
                                 nn.Linear(self.hidden_size, dim))

    def forward(self, x):  # f32[P,C] -> f32[P/merge^2, dim]
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class Qwen3VLPatchMerger(nn.Module):
    """Qwen3-VL's merger: LayerNorm per patch, or (use_postshuffle_norm, the deepstack mergers) over the
    concatenated merge^2 neighbours; then linear_fc1-GELU-linear_fc2."""

    def __init__(self, c: Qwen3VLVisionConfig, use_postshuffle_norm: bool = False):
        super().__init__()
        self.hidden_size = c.hidden_size * c.spatial_merge_size ** 2
        self.use_postshuffle_norm = use_postshuffle_norm
        self.norm = LayerNorm(self.hidden_size if use_postshuffle_norm else c.hidden_size, NORM_EPS)
        self.linear_fc1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.linear_fc2 = nn.Linear(self.hidden_size, c.out_hidden_size)

    def forward(self, x):  # f32[P,C] -> f32[P/merge^2, out_hidden]
        if self.use_postshuffle_norm:
            x = self.norm(x.view(-1, self.hidden_size))
        else:
            x = self.norm(x).view(-1, self.hidden_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


# ---- towers ---------------------------------------------------------------------------------

def _rope_tables(c, grid_thw):  # -> cos, sin f32[P, head_dim]
    return vision_rope_cos_sin(vision_rope_positions(grid_thw, c.spatial_merge_size), c.head_dim, c.rope_theta)


class Qwen2VisionTransformer(nn.Module):
    def __init__(self, config: Qwen2VLVisionConfig):
        super().__init__()
        c = self.config = config
        self.patch_embed = PatchEmbed(c.in_channels, c.temporal_patch_size, c.patch_size, c.embed_dim)
        self.blocks = nn.ModuleList(Qwen2VLVisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c.hidden_size, c.embed_dim, c.spatial_merge_size)

    def forward(self, pixel_values, grid_thw):
        """pixel_values f32[P, C*T*ps*ps], grid_thw i64[I,3] -> merged tokens f32[P/merge^2, hidden_size]."""
        cu_seqlens = vision_cu_seqlens(grid_thw)
        cos, sin = _rope_tables(self.config, grid_thw)
        x = self.patch_embed(pixel_values)
        for block in self.blocks:
            x = block(x, cu_seqlens, cos, sin)
        return self.merger(x)


class Qwen2_5VisionTransformer(nn.Module):
    """Qwen2.5-VL's tower, and Qwen2.5-Omni's (config.separate_qkv)."""

    def __init__(self, config: Qwen2_5VLVisionConfig):
        super().__init__()
        c = self.config = config
        self.patch_embed = PatchEmbed(c.in_channels, c.temporal_patch_size, c.patch_size, c.hidden_size)
        self.blocks = nn.ModuleList(Qwen2_5VLVisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c.out_hidden_size, c.hidden_size, c.spatial_merge_size, norm=RMSNorm)

    def forward(self, pixel_values, grid_thw):
        """pixel_values f32[P, C*T*ps*ps], grid_thw i64[I,3] -> merged tokens f32[P/merge^2, out_hidden_size].
        The blocks run in window order (windowed blocks: cu_window_seqlens; fullatt_block_indexes: the whole
        segment, whose bounds the permutation keeps); the merged tokens come back in image order."""
        c, unit = self.config, self.config.spatial_merge_size ** 2
        perm, cu_window_seqlens = window_index(grid_thw, c.window_size, c.spatial_merge_size, c.patch_size)
        cu_seqlens = vision_cu_seqlens(grid_thw)
        cos, sin = (to_window_order(t, perm, unit) for t in _rope_tables(c, grid_thw))
        x = to_window_order(self.patch_embed(pixel_values), perm, unit)
        for i, block in enumerate(self.blocks):
            x = block(x, cu_seqlens if i in c.fullatt_block_indexes else cu_window_seqlens, cos, sin)
        return from_window_order(self.merger(x), perm)


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, config: Qwen3VLVisionConfig):
        super().__init__()
        c = self.config = config
        self.patch_embed = PatchEmbed(c.in_channels, c.temporal_patch_size, c.patch_size, c.hidden_size, bias=True)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(Qwen3VLVisionBlock(c) for _ in range(c.depth))
        self.merger = Qwen3VLPatchMerger(c)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3VLPatchMerger(c, use_postshuffle_norm=True) for _ in c.deepstack_visual_indexes)

    def forward(self, pixel_values, grid_thw):
        """pixel_values f32[P, C*T*ps*ps], grid_thw i64[I,3] -> (merged tokens f32[P/merge^2, out_hidden_size],
        deepstack features [f32[P/merge^2, out_hidden_size]], in block order: the output of block i through
        deepstack_merger_list[deepstack_visual_indexes.index(i)])."""
        c = self.config
        indices, weights = pos_embed_interpolation(grid_thw, c.num_grid_per_side, c.spatial_merge_size)
        cu_seqlens = vision_cu_seqlens(grid_thw)
        cos, sin = _rope_tables(c, grid_thw)
        x = self.patch_embed(pixel_values) + interpolate_pos_embed(self.pos_embed.weight, indices, weights)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cu_seqlens, cos, sin)
            if i in c.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[c.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack


# ---- a tower's parts by its config (what the grader's tower-level checks build) -------------------

def vision_block(c):
    """One block of the tower `c` configures (Qwen2-VL, Qwen2.5-VL / Omni, Qwen3-VL)."""
    blocks = {Qwen2VLVisionConfig: Qwen2VLVisionBlock, Qwen2_5VLVisionConfig: Qwen2_5VLVisionBlock,
              Qwen3VLVisionConfig: Qwen3VLVisionBlock}
    return blocks[type(c)](c)


def vision_merger(c):
    """The final patch merger of the tower `c` configures."""
    if isinstance(c, Qwen3VLVisionConfig):
        return Qwen3VLPatchMerger(c)
    if isinstance(c, Qwen2_5VLVisionConfig):
        return PatchMerger(c.out_hidden_size, c.hidden_size, c.spatial_merge_size, RMSNorm)
    return PatchMerger(c.hidden_size, c.embed_dim, c.spatial_merge_size)
