"""Qwen2.5-Omni's audio encoder in Flax Linen: the torch-free twin of torch_sources/models/audio.py (same public
names in the same order, same numerics; see the torch file's docstring for the encoder).

feature_lens is static host data (numpy or a tuple, never traced), as grid_thw is for the vision towers:
everything that depends only on it (the chunks, their zero padding, the packing of real frames, the attention
segments, the pooling pairs) is numpy, computed once per trace, so under jit only input_features flows. The
sinusoidal table is a numpy constant. Params are named after the HF keys: the convs keep the stored Conv1d
layout (`conv1/weight` [out, in, k], `conv1/bias`), Linear weights are transposed Dense kernels, LayerNorms
`weight`/`bias`, `audio_bos_eos_token/embedding` (declared, never read). Plain Dense layers: LoRA never
targets the (frozen) audio tower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jax_oracles.models.config_keys import DROPOUT, ConfigError, KeyAudit
from jax_oracles.models.layers import ACTIVATIONS, LayerNorm
from jax_oracles.models.vision import segment_index, vision_attention

__all__ = [
    "AUDIO_KEYS", "Qwen2_5OmniAudioConfig",
    "audio_output_lengths", "audio_chunk_lengths", "audio_cu_seqlens", "valid_index", "pool_index", "sinusoids",
    "Conv1d", "AudioAttention", "AudioEncoderLayer", "Qwen2_5OmniAudioEncoder",
]

NORM_EPS = 1e-5  # nn.LayerNorm's default: transformers builds every norm of this encoder without an eps


# ---- config ---------------------------------------------------------------------------------

AUDIO_KEYS = KeyAudit(
    "qwen2_5_omni audio",
    honored=frozenset({"num_mel_bins", "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim", "d_model",
                       "output_dim", "max_source_positions", "n_window", "activation_function"}),
    ignored={"dropout": DROPOUT, "attention_dropout": DROPOUT, "activation_dropout": DROPOUT,
             "scale_embedding": "transformers 5.24's encoder computes embed_scale from it and never applies it"})


@dataclass(frozen=True)
class Qwen2_5OmniAudioConfig:
    num_mel_bins: int
    encoder_layers: int
    encoder_attention_heads: int
    encoder_ffn_dim: int
    d_model: int
    output_dim: int
    max_source_positions: int = 1500
    n_window: int = 100
    activation_function: str = "gelu"

    def __post_init__(self):
        assert self.d_model % self.encoder_attention_heads == 0 and self.d_model % 2 == 0
        assert self.n_window <= self.max_source_positions, "a chunk's n_window frames need as many table rows"

    @classmethod
    def from_hf(cls, d: dict) -> "Qwen2_5OmniAudioConfig":
        """The HF audio_config dict, every key accounted for (AUDIO_KEYS); transformers' defaults where absent."""
        AUDIO_KEYS.check(d)
        act = d.get("activation_function", "gelu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"qwen2_5_omni audio config: activation_function={act!r} (known: "
                              f"{sorted(ACTIVATIONS)})")
        return cls(num_mel_bins=d.get("num_mel_bins", 128), encoder_layers=d.get("encoder_layers", 32),
                   encoder_attention_heads=d.get("encoder_attention_heads", 20),
                   encoder_ffn_dim=d.get("encoder_ffn_dim", 5120), d_model=d.get("d_model", 1280),
                   output_dim=d.get("output_dim", 3584), max_source_positions=d.get("max_source_positions", 1500),
                   n_window=d.get("n_window", 100), activation_function=act)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads


# ---- host-side bookkeeping (numpy, a function of feature_lens only) -------------------------

def _host_lens(feature_lens) -> np.ndarray:  # -> i64[A]
    if isinstance(feature_lens, jax.core.Tracer):
        raise TypeError("feature_lens must be static host data (numpy or a tuple), not a traced array")
    return np.asarray(feature_lens, dtype=np.int64).reshape(-1)


def _after_conv(lengths):  # frames -> frames after the stride-2 conv2 (k3, p1)
    return (lengths - 1) // 2 + 1


def audio_output_lengths(feature_lens):  # i64[A] -> i64[A]: the audio tokens of each audio
    return (_after_conv(_host_lens(feature_lens)) - 2) // 2 + 1


def audio_chunk_lengths(feature_lens, n_window: int):  # i64[A] -> i64[C]: each audio's chunks, in order
    """Chunks of 2 * n_window frames, the last of each audio the remainder (transformers' chunk_and_pad_features)."""
    lens = _host_lens(feature_lens)
    if (lens < 1).any():
        raise ValueError(f"feature_lens {lens.tolist()}: every audio needs at least one frame")
    full = 2 * n_window
    out = []
    for n in lens.tolist():
        out.extend([full] * ((n - 1) // full) + [n - full * ((n - 1) // full)])
    return np.asarray(out, dtype=np.int64)


def audio_cu_seqlens(chunk_lengths):  # i64[C] -> i32[C+1]: the attention segments, one per chunk
    return np.concatenate([[0], np.cumsum(_after_conv(np.asarray(chunk_lengths)))]).astype(np.int32)


def valid_index(chunk_lengths):  # i64[C] -> i64[N]: the real frames of the padded [C, L2] chunks, flattened
    after = _after_conv(np.asarray(chunk_lengths))
    return np.flatnonzero(np.arange(after.max())[None] < after[:, None])


def pool_index(feature_lens):  # i64[A] -> i64[sum of out_len]: the first frame of each averaged pair
    """Pairs (2j, 2j+1) within each audio's packed frames (transformers' get_pool_indices)."""
    lens = _host_lens(feature_lens)
    offsets = np.concatenate([[0], np.cumsum(_after_conv(lens))])[:-1]
    counts = audio_output_lengths(lens).tolist()
    return np.concatenate([o + 2 * np.arange(n) for o, n in zip(offsets.tolist(), counts)])


def sinusoids(length: int, channels: int, max_timescale: float = 10_000.0):  # -> f32[length, channels] (numpy)
    """Whisper's table, [sin | cos] of geometrically spaced timescales, in float32 as transformers computes it."""
    log_timescale_increment = np.float32(-math.log(max_timescale) / (channels // 2 - 1))
    inv_timescales = np.exp(log_timescale_increment * np.arange(channels // 2, dtype=np.float32))
    scaled_time = np.arange(length, dtype=np.float32)[:, None] * inv_timescales[None, :]
    return np.concatenate([np.sin(scaled_time), np.cos(scaled_time)], axis=1)


# ---- modules --------------------------------------------------------------------------------

class Conv1d(nn.Module):
    """torch's Conv1d over f32[B, in, L] with zero padding; `weight` keeps the stored [out, in, k] layout."""
    features: int
    kernel_size: int
    stride: int = 1
    padding: int = 0

    @nn.compact
    def __call__(self, x):  # f32[B, in, L] -> f32[B, out, (L + 2p - k) // s + 1]
        weight = self.param("weight", nn.initializers.lecun_normal(), (self.features, x.shape[1], self.kernel_size),
                            jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        out = jax.lax.conv_general_dilated(x, weight, (self.stride,), [(self.padding, self.padding)],
                                           dimension_numbers=("NCH", "OIH", "NCH"))
        return out + bias[None, :, None]


class AudioAttention(nn.Module):
    """Multi-head attention within each chunk; k_proj has no bias (Whisper's)."""
    dim: int
    num_heads: int

    @nn.compact
    def __call__(self, x, cu_seqlens):  # x: f32[N,D]  cu_seqlens: i32[C+1] (host) -> f32[N,D]
        N, H, hd = x.shape[0], self.num_heads, self.dim // self.num_heads
        q, k, v = (nn.Dense(self.dim, use_bias=bias, name=n)(x).reshape(N, H, hd)
                   for n, bias in (("q_proj", True), ("k_proj", False), ("v_proj", True)))
        out = vision_attention(q, k, v, cu_seqlens, hd ** -0.5)
        return nn.Dense(self.dim, name="out_proj")(out.reshape(N, H * hd))


class AudioEncoderLayer(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + fc2(act(fc1(ln(x))))."""
    config: Qwen2_5OmniAudioConfig

    @nn.compact
    def __call__(self, x, cu_seqlens):  # f32[N,D] -> f32[N,D]
        c = self.config
        attn = AudioAttention(c.d_model, c.encoder_attention_heads, name="self_attn")
        x = x + attn(LayerNorm(NORM_EPS, name="self_attn_layer_norm")(x), cu_seqlens)
        h = nn.Dense(c.encoder_ffn_dim, name="fc1")(LayerNorm(NORM_EPS, name="final_layer_norm")(x))
        return x + nn.Dense(c.d_model, name="fc2")(ACTIVATIONS[c.activation_function](h))


class Qwen2_5OmniAudioEncoder(nn.Module):
    config: Qwen2_5OmniAudioConfig

    @nn.compact
    def __call__(self, input_features, feature_lens):
        """input_features f32[mel, F] (every audio's frames, concatenated), feature_lens (host) [A] ->
        f32[sum of audio_output_lengths(feature_lens), output_dim]."""
        c, lens = self.config, _host_lens(feature_lens)
        if int(lens.sum()) != input_features.shape[1]:
            raise ValueError(f"feature_lens sum to {int(lens.sum())} frames, input_features has "
                             f"{input_features.shape[1]}")
        nn.Embed(2, c.output_dim, name="audio_bos_eos_token").embedding  # stored; the forward never reads it
        chunk_lengths = audio_chunk_lengths(lens, c.n_window)
        index, valid = segment_index(np.concatenate([[0], np.cumsum(chunk_lengths)]))  # i64[C,L], bool[C,L]
        chunks = (input_features.T[index] * valid[..., None]).transpose(0, 2, 1)  # f32[C, mel, L], zero-padded
        x = ACTIVATIONS["gelu"](Conv1d(c.d_model, 3, padding=1, name="conv1")(chunks)) * valid[:, None, :]
        x = ACTIVATIONS["gelu"](Conv1d(c.d_model, 3, stride=2, padding=1, name="conv2")(x)).transpose(0, 2, 1)
        x = x + sinusoids(c.max_source_positions, c.d_model)[: x.shape[1]]  # f32[C, L2, D]
        x = x.reshape(-1, c.d_model)[valid_index(chunk_lengths)]  # f32[N, D]: the chunks' real frames, packed
        cu_seqlens = audio_cu_seqlens(chunk_lengths)
        for i in range(c.encoder_layers):
            x = AudioEncoderLayer(c, name=f"layers_{i}")(x, cu_seqlens)
        pool = pool_index(lens)
        x = (x[pool] + x[pool + 1]) / 2
        x = LayerNorm(NORM_EPS, name="ln_post")(x)
        return nn.Dense(c.output_dim, name="proj")(x)
