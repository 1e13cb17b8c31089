"""What the decoder families share, in pure PyTorch (eager fp32); jax_oracles/models/layers.py is its twin.

Each family file composes these pieces and keeps only what is truly its own (its projections, its
residual wiring, its checkpoint names). Numerics follow transformers 5.24:
- RMSNorm computes in fp32 and casts back before the weight; LayerNorm is torch's (biased or not);
- RoPE: rotate-half layout; the tables of every rope type and both config forms are models/rope.py's
  (`layer_inputs(..., rope=)` takes its cos/sin); partial rotary rotates the first `rotary_dim` channels
  and passes the rest through;
- ALiBi: BLOOM's slopes (the extra heads of a non-power-of-two count take the odd powers of 2p's
  base) times the key's position from the mask cumsum, added to the scaled scores;
- masks: causal & key padding & (optionally) sliding window, a key allowed iff q - k < window;
- eager attention: GQA by repeating KV heads (head j serves j*G .. j*G+G-1), fp32 softmax, masked
  scores set to the dtype's min (a fully masked padding row stays finite, as HF's); optional per-head
  attention sinks (GPT-OSS): one extra logit per head in the softmax's normaliser, dropped after it;
- MLPs: gated (`down(act(gate) * up)`) or plain (`out(act(in))`); activations by HF's names.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from torch_sources.models import rope as _rope
from torch_sources.models.rope import rope_cos_sin

__all__ = [
    "LayerInputs", "ACTIVATIONS",
    "rms_norm", "layer_norm", "rope_cos_sin", "apply_rope",
    "alibi_slopes", "alibi_bias",
    "causal_mask", "eager_attention", "attend", "default_positions", "layer_inputs",
    "RMSNorm", "LayerNorm", "GatedMLP", "PlainMLP",
]


class LayerInputs(NamedTuple):
    """What every decoder layer of a forward shares: the attention mask and the position encoding."""
    mask: torch.Tensor                  # bool[B,T,S]: query t may attend key s
    cos: torch.Tensor | None = None     # f32[B,T,rotary_dim] (RoPE families)
    sin: torch.Tensor | None = None
    alibi: torch.Tensor | None = None   # f32[B,N,1,S] (ALiBi families)


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


# HF ACT2FN names -> functions (gelu_new / gelu_pytorch_tanh are the tanh approximation).
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_tanh,
               "gelu_tanh": _gelu_tanh}


# ---- norms ----------------------------------------------------------------------------------

def rms_norm(x, weight, eps: float):  # x: [..., D]  weight: f32[D]
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)  # HF casts back before the weight multiply


def layer_norm(x, weight, bias, eps: float):  # x: [..., D]  weight, bias: f32[D] | None
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.eps = eps

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps)


# ---- positions ------------------------------------------------------------------------------

def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):  # x: f32[B,T,N,hd]  cos, sin: f32[B,T,rd], rd <= hd
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, keep = x[..., :rd], x[..., rd:]  # partial rotary (Phi-3/4): the tail channels pass through
    return torch.cat((rot * cos + _rotate_half(rot) * sin, keep), dim=-1)


def alibi_slopes(num_heads: int):  # -> f32[N]
    """BLOOM's slopes: b^1..b^p for the largest power of two p <= N, b = 2^(-8/p); the other heads
    take the odd powers of 2p's base."""
    p = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(p) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + p, dtype=torch.int32))
    if p != num_heads:
        extra_base = torch.tensor(2 ** (-(2 ** -(math.log2(2 * p) - 3))), dtype=torch.float32)
        extra = min(p, num_heads - p)
        slopes = torch.cat([slopes, torch.pow(extra_base, torch.arange(1, 1 + 2 * extra, 2, dtype=torch.int32))])
    return slopes


def alibi_bias(slopes, attention_mask):  # f32[N], i32[B,S] -> f32[B,N,1,S]
    """slope x the key's position, counted over the unpadded keys (mask cumsum - 1, 0 at pads)."""
    positions = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, None, :]
    return slopes[None, :, None, None] * positions.to(torch.float32)


# ---- masks and attention --------------------------------------------------------------------

def causal_mask(attention_mask, sliding_window: int | None = None):  # i32[B,T] -> bool[B,T,T]
    """True = query t may attend key s: s <= t, s not padding, and t - s < sliding_window if given."""
    T = attention_mask.shape[1]
    idx = torch.arange(T, device=attention_mask.device)
    allowed = idx[None, :] <= idx[:, None]
    if sliding_window is not None:
        allowed = allowed & (idx[:, None] - idx[None, :] < sliding_window)
    return allowed[None] & attention_mask.bool()[:, None, :]


def eager_attention(q, k, v, mask, scale: float, bias=None, sinks=None):
    """q: f32[B,T,N,hd]  k, v: f32[B,S,K,hd]  mask: bool[B,T,S]  bias: f32[B,N,1|T,S] | None
    sinks: f32[N] | None -> f32[B,T,N,hd].

    KV head j serves query heads j*G .. j*G+G-1 (HF repeat_kv); softmax in fp32. A sink is a per-head logit
    appended to every row: it enlarges the normaliser, its own probability is dropped (the weights of a row
    then sum to less than one).
    """
    groups = q.shape[2] // k.shape[2]
    q = q.transpose(1, 2)  # [B,N,T,hd]
    k = k.transpose(1, 2).repeat_interleave(groups, dim=1)  # [B,N,S,hd]
    v = v.transpose(1, 2).repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [B,N,T,S]
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~mask[:, None], torch.finfo(scores.dtype).min)
    if sinks is not None:
        B, N, T, _ = scores.shape
        scores = torch.cat([scores, sinks.to(scores.dtype).view(1, N, 1, 1).expand(B, N, T, 1)], dim=-1)
        scores = scores - scores.amax(dim=-1, keepdim=True)  # as HF's eager GPT-OSS (it changes the rounding)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
        return torch.matmul(probs, v).transpose(1, 2)
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(1, 2)  # [B,T,N,hd]


def attend(q, k, v, inputs: LayerInputs, scale: float):
    """Position encoding (RoPE on q and k, or the ALiBi bias), then eager attention: [B,T,N*hd]."""
    if inputs.cos is not None:
        q, k = apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)
    out = eager_attention(q, k, v, inputs.mask, scale, inputs.alibi)
    B, T, N, hd = out.shape
    return out.reshape(B, T, N * hd)


def default_positions(input_ids):  # right padding: 0..T-1 per row
    B, T = input_ids.shape
    return torch.arange(T, device=input_ids.device)[None].expand(B, T)


def layer_inputs(attention_mask, position_ids=None, *, rope=None, alibi_heads: int | None = None,
                 sliding_window: int | None = None) -> LayerInputs:
    """The mask and position encoding every layer of one forward shares (RoPE if `rope`, a
    models/rope.Rope; ALiBi if alibi_heads). Left-padded generation passes HF's positions (mask
    cumsum - 1) as position_ids."""
    mask = causal_mask(attention_mask, sliding_window)
    cos = sin = alibi = None
    if rope is not None:
        if position_ids is None:
            position_ids = default_positions(attention_mask)
        cos, sin = _rope.cos_sin(rope, position_ids.to(attention_mask.device))
    if alibi_heads is not None:
        alibi = alibi_bias(alibi_slopes(alibi_heads).to(attention_mask.device), attention_mask)
    return LayerInputs(mask, cos, sin, alibi)


# ---- MLPs -----------------------------------------------------------------------------------

class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU; separate gate/up projections."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names, self.act = names, ACTIVATIONS[act]
        for name, (i, o) in zip(names, ((hidden, intermediate), (hidden, intermediate), (intermediate, hidden))):
            setattr(self, name, nn.Linear(i, o, bias=bias))

    def forward(self, x):
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act(gate(x)) * up(x))


class PlainMLP(nn.Module):
    """out(act(in(x))): BLOOM, Falcon, StarCoder2 (named after each release's tensors)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool, names: tuple[str, str]):
        super().__init__()
        self.names, self.act = names, ACTIVATIONS[act]
        setattr(self, names[0], nn.Linear(hidden, intermediate, bias=bias))
        setattr(self, names[1], nn.Linear(intermediate, hidden, bias=bias))

    def forward(self, x):
        up, down = (getattr(self, n) for n in self.names)
        return down(self.act(up(x)))
