"""What the decoder families share, in Flax Linen: the torch-free twin of torch_sources/models/layers.py.

Same public names, same numerics (see the torch file's docstring). Config constants (ALiBi slopes; the
RoPE tables of models/rope.py) are computed in numpy with torch's op order, so under jit they are
literals equal to torch's. Every projection is a LoraLinear, so LoRA adapters in a
"lora" collection reach it.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_oracles.models import rope as _rope
from jax_oracles.models.rope import rope_cos_sin
from jax_oracles.training.lora import LoraLinear

__all__ = [
    "LayerInputs", "ACTIVATIONS",
    "rms_norm", "layer_norm", "rope_cos_sin", "apply_rope",
    "alibi_slopes", "alibi_bias",
    "causal_mask", "eager_attention", "attend", "default_positions", "padded_positions", "layer_inputs",
    "RMSNorm", "LayerNorm", "GatedMLP", "PlainMLP",
]


class LayerInputs(NamedTuple):
    """What every decoder layer of a forward shares: the attention mask and the position encoding."""
    mask: jax.Array                  # bool[B,T,S]: query t may attend key s
    cos: jax.Array | None = None     # f32[B,T,rotary_dim] (RoPE families)
    sin: jax.Array | None = None
    alibi: jax.Array | None = None   # f32[B,N,1,S] (ALiBi families)


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def _gelu(x):
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu": _gelu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_new": _gelu_tanh,
               "gelu_tanh": _gelu_tanh}


# ---- norms ----------------------------------------------------------------------------------

def rms_norm(x, weight, eps: float):  # x: [..., D]  weight: f32[D]
    dtype = x.dtype
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.astype(dtype)  # HF casts back before the weight multiply


def layer_norm(x, weight, bias, eps: float):  # x: [..., D]  weight, bias: f32[D] | None
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centered = x - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)  # biased, as torch's
    y = centered * jax.lax.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


class RMSNorm(nn.Module):
    eps: float

    @nn.compact
    def __call__(self, x):  # f32[..., D]
        weight = self.param("weight", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        return rms_norm(x, weight, self.eps)


class LayerNorm(nn.Module):
    eps: float
    use_bias: bool = True

    @nn.compact
    def __call__(self, x):  # f32[..., D]
        weight = self.param("weight", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (x.shape[-1],), jnp.float32) if self.use_bias else None
        return layer_norm(x, weight, bias, self.eps)


# ---- positions ------------------------------------------------------------------------------

def _rotate_half(x):
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(x, cos, sin):  # x: f32[B,T,N,hd]  cos, sin: f32[B,T,rd], rd <= hd
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, keep = x[..., :rd], x[..., rd:]  # partial rotary (Phi-3/4): the tail channels pass through
    return jnp.concatenate([rot * cos + _rotate_half(rot) * sin, keep], axis=-1)


def alibi_slopes(num_heads: int):  # -> f32[N]
    """BLOOM's slopes: b^1..b^p for the largest power of two p <= N, b = 2^(-8/p); the other heads
    take the odd powers of 2p's base."""
    p = 2 ** math.floor(math.log2(num_heads))
    base = np.float32(2 ** (-(2 ** -(math.log2(p) - 3))))
    slopes = np.power(base, np.arange(1, 1 + p).astype(np.float32))
    if p != num_heads:
        extra_base = np.float32(2 ** (-(2 ** -(math.log2(2 * p) - 3))))
        extra = min(p, num_heads - p)
        slopes = np.concatenate([slopes, np.power(extra_base, np.arange(1, 1 + 2 * extra, 2).astype(np.float32))])
    return jnp.asarray(slopes, dtype=jnp.float32)


def alibi_bias(slopes, attention_mask):  # f32[N], i32[B,S] -> f32[B,N,1,S]
    """slope x the key's position, counted over the unpadded keys (mask cumsum - 1, 0 at pads)."""
    positions = ((jnp.cumsum(attention_mask, axis=-1) - 1) * attention_mask)[:, None, None, :]
    return slopes[None, :, None, None] * positions.astype(jnp.float32)


# ---- masks and attention --------------------------------------------------------------------

def causal_mask(attention_mask, sliding_window: int | None = None):  # i32[B,T] -> bool[B,T,T]
    """True = query t may attend key s: s <= t, s not padding, and t - s < sliding_window if given."""
    T = attention_mask.shape[1]
    idx = jnp.arange(T)
    allowed = idx[None, :] <= idx[:, None]
    if sliding_window is not None:
        allowed = allowed & (idx[:, None] - idx[None, :] < sliding_window)
    return allowed[None] & attention_mask.astype(jnp.bool_)[:, None, :]


def eager_attention(q, k, v, mask, scale: float, bias=None, sinks=None):
    """q: f32[B,T,N,hd]  k, v: f32[B,S,K,hd]  mask: bool[B,T,S]  bias: f32[B,N,1|T,S] | None
    sinks: f32[N] | None -> f32[B,T,N,hd].

    Query head n = j*G + g uses KV head j (HF repeat_kv order); softmax in fp32. Sinks (GPT-OSS) are
    one learned logit per query head that joins the softmax normaliser only: its column is
    concatenated, the row max subtracted (transformers' order), and dropped after the softmax.
    Without a bias or sinks the core has its own backward (_masked_attention).
    """
    if bias is None and sinks is None:
        return _masked_attention(q, k, v, mask, scale)
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k) * scale
    if bias is not None:
        scores = scores + bias.reshape(B, K, N // K, *bias.shape[2:])
    scores = scores + _mask_bias(mask, scores.dtype)[:, None, None]
    scores = scores.astype(jnp.float32)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, K, N // K, 1, 1), (*scores.shape[:-1], 1))
        combined = jnp.concatenate([scores, sink], axis=-1)
        combined = combined - jnp.max(combined, axis=-1, keepdims=True)
        probs = jax.nn.softmax(combined, axis=-1)[..., :-1]
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs.astype(q.dtype), v)
    return out.reshape(B, T, N, H)


def _mask_bias(mask, dtype):
    # torch's masked_fill(~mask, min) as an added 0 / min: the same scores bit for bit (|score| << ulp(min)) and the
    # same gradient (masked probabilities are exactly 0), without a where that keeps a full-size mask for backward
    return jnp.where(mask, 0.0, jnp.finfo(dtype).min).astype(dtype)


# The masked core with a hand-written backward. Every matmul reads its large operand (scores or probabilities,
# [B,K,G*T,S]) in row-major order and only the thin q/k/v/dO tiles are transposed: XLA's own backward of the
# einsums moved the probabilities through strided copies and fused the softmax gradient into a matmul, 3 s of
# an 8.6 s LoRA step at ~100M parameters. Rows are (g, t) pairs of one KV head: r = g*T + t.
def _heads_rows(x, K):  # [B,T,N,H] -> [B,K,G*T,H]
    B, T, N, H = x.shape
    return x.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4).reshape(B, K, N // K * T, H)


def _rows_heads(x, T):  # [B,K,G*T,H] -> [B,T,N,H]
    B, K, R, H = x.shape
    return x.reshape(B, K, R // T, T, H).transpose(0, 3, 1, 2, 4).reshape(B, T, K * (R // T), H)


def _masked_probs(qh, k_t, mask, scale):  # -> f32[B,K,G*T,S]
    B, K, R, _ = qh.shape
    T, S = mask.shape[1:]
    scores = (jnp.matmul(qh, k_t) * scale).reshape(B, K, R // T, T, S)
    scores = (scores + _mask_bias(mask, scores.dtype)[:, None, None]).astype(jnp.float32)
    return jax.nn.softmax(scores, axis=-1).reshape(B, K, R, S)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _masked_attention(q, k, v, mask, scale: float):
    return _masked_attention_fwd(q, k, v, mask, scale)[0]


def _masked_attention_fwd(q, k, v, mask, scale):
    K, T = k.shape[2], q.shape[1]
    qh, k_t, vh = _heads_rows(q, K), k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)  # [B,K,R,H] [B,K,H,S] [B,K,S,H]
    probs = _masked_probs(qh, k_t, mask, scale).astype(q.dtype)
    return _rows_heads(jnp.matmul(probs, vh), T), (qh, k_t, vh, probs, mask)


def _masked_attention_bwd(scale, res, g):
    qh, k_t, vh, probs, mask = res
    (B, K, R, S), T = probs.shape, g.shape[1]
    dout = _heads_rows(g, K)  # [B,K,R,H]
    dprobs = jnp.matmul(dout, vh.transpose(0, 1, 3, 2))  # [B,K,R,S]
    # softmax backward as torch's: p * (dp - sum(dp * p)); then masked_fill's: no gradient through a masked score
    # (it only matters in a row with no visible key, where the softmax is uniform, not 0)
    dscores = probs * (dprobs - jnp.sum(dprobs * probs, axis=-1, keepdims=True)) * scale
    dscores = jnp.where(mask[:, None, None], dscores.reshape(B, K, R // T, T, S), 0.0).reshape(B, K, R, S)
    dq = _rows_heads(jnp.matmul(dscores, k_t.transpose(0, 1, 3, 2)), T)
    dk = jnp.matmul(qh.transpose(0, 1, 3, 2), dscores).transpose(0, 3, 1, 2)  # [B,K,H,S] -> [B,S,K,H]
    dv = jnp.matmul(dout.transpose(0, 1, 3, 2), probs).transpose(0, 3, 1, 2)
    return dq, dk, dv, None


_masked_attention.defvjp(_masked_attention_fwd, _masked_attention_bwd)


def attend(q, k, v, inputs: LayerInputs, scale: float):
    """Position encoding (RoPE on q and k, or the ALiBi bias), then eager attention: [B,T,N*hd]."""
    if inputs.cos is not None:
        q, k = apply_rope(q, inputs.cos, inputs.sin), apply_rope(k, inputs.cos, inputs.sin)
    out = eager_attention(q, k, v, inputs.mask, scale, inputs.alibi)
    B, T, N, hd = out.shape
    return out.reshape(B, T, N * hd)


def default_positions(input_ids):  # right padding: 0..T-1 per row
    B, T = input_ids.shape
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))


def padded_positions(attention_mask, width):  # i32[B,L], traced scalar -> i32[B,L]
    """0..L-1, every position past width - 1 held at width - 1: a right-padded batch that a static shape made
    wider than torch's (width columns) keeps torch's largest position, which transformers' longrope reads to
    pick its table. The real tokens (all before width) keep their own positions; the pads' do not matter."""
    B, L = attention_mask.shape
    return jnp.broadcast_to(jnp.minimum(jnp.arange(L), width - 1)[None], (B, L))


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
        cos, sin = _rope.cos_sin(rope, position_ids)
    if alibi_heads is not None:
        alibi = alibi_bias(alibi_slopes(alibi_heads), attention_mask)
    return LayerInputs(mask, cos, sin, alibi)


# ---- MLPs -----------------------------------------------------------------------------------

class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU; separate gate/up projections."""
    hidden: int
    intermediate: int
    act: str
    use_bias: bool = False
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    lora_scaling: float = 2.0

    def activation(self, x):  # HF's hidden_act by name (the L1 `activation` check calls it alone)
        return ACTIVATIONS[self.act](x)

    @nn.compact
    def __call__(self, x):  # f32[..., D] -> f32[..., D]: the gated MLP
        gate, up, down = (LoraLinear(f, use_bias=self.use_bias, scaling=self.lora_scaling, name=n)
                          for f, n in zip((self.intermediate, self.intermediate, self.hidden), self.names))
        return down(self.activation(gate(x)) * up(x))


class PlainMLP(nn.Module):
    """out(act(in(x))): BLOOM, Falcon, StarCoder2 (named after each release's tensors)."""
    hidden: int
    intermediate: int
    act: str
    use_bias: bool
    names: tuple[str, str]
    lora_scaling: float = 2.0

    @nn.compact
    def __call__(self, x):
        up = LoraLinear(self.intermediate, use_bias=self.use_bias, scaling=self.lora_scaling, name=self.names[0])
        down = LoraLinear(self.hidden, use_bias=self.use_bias, scaling=self.lora_scaling, name=self.names[1])
        return down(self.activation(up(x)))

    def activation(self, x):  # HF's hidden_act by name (the L1 `activation` check calls it alone)
        return ACTIVATIONS[self.act](x)
