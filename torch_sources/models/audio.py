"""Qwen2.5-Omni's audio encoder in pure PyTorch, eager fp32; jax_oracles/models/audio.py is its twin.

transformers 5.24's Qwen2_5OmniAudioEncoder (a Whisper-style encoder cut into chunks). It takes the log-mel
features of every audio of a batch concatenated along time, input_features f32[mel, F] (F = sum of
feature_lens), and feature_lens i64[A]; it returns one row per audio token, f32[sum of out_len, output_dim],
out_len = ((F_a - 1) // 2 + 1 - 2) // 2 + 1 (`audio_output_lengths`). On the way:
- each audio is cut into chunks of 2 * n_window frames (the last one shorter), right-padded with zeros to the
  longest chunk;
- stem: conv1 (k3, p1) - GELU - times the chunk's frame mask - conv2 (k3, s2, p1) - GELU, so a chunk of L
  frames keeps (L - 1) // 2 + 1; then the sinusoidal table (rows 0.. of each chunk, not learned, not stored);
- the valid frames of every chunk packed into one sequence; encoder layers (pre-LayerNorm eps 1e-5,
  bidirectional attention within each chunk, never across; k_proj without bias; fc1-GELU-fc2);
- per audio, stride-2 average pooling of consecutive frame pairs (an odd last frame dropped), ln_post, proj.
`audio_bos_eos_token` [2, output_dim] is a stored parameter the encoder's forward never reads.
Everything that depends only on feature_lens (chunks, packing, pooling pairs) is host-side bookkeeping.
Submodule names equal transformers', so `encoder.load_state_dict(hf_encoder.state_dict())` loads strictly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torch_sources.models.config_keys import DROPOUT, ConfigError, KeyAudit
from torch_sources.models.layers import ACTIVATIONS, LayerNorm
from torch_sources.models.vision import segment_index, vision_attention

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


# ---- host-side bookkeeping (a function of feature_lens only) --------------------------------

def _after_conv(lengths):  # frames -> frames after the stride-2 conv2 (k3, p1)
    return (lengths - 1) // 2 + 1


def audio_output_lengths(feature_lens):  # i64[A] -> i64[A]: the audio tokens of each audio
    return (_after_conv(feature_lens) - 2) // 2 + 1


def audio_chunk_lengths(feature_lens, n_window: int):  # i64[A] -> i64[C]: each audio's chunks, in order
    """Chunks of 2 * n_window frames, the last of each audio the remainder (transformers' chunk_and_pad_features)."""
    if bool((feature_lens < 1).any()):
        raise ValueError(f"feature_lens {feature_lens.tolist()}: every audio needs at least one frame")
    full = 2 * n_window
    out = []
    for n in feature_lens.tolist():
        out.extend([full] * ((n - 1) // full) + [n - full * ((n - 1) // full)])
    return torch.tensor(out, dtype=torch.long)


def audio_cu_seqlens(chunk_lengths):  # i64[C] -> i32[C+1]: the attention segments, one per chunk
    return F.pad(_after_conv(chunk_lengths).cumsum(0, dtype=torch.int32), (1, 0))


def valid_index(chunk_lengths):  # i64[C] -> i64[N]: the real frames of the padded [C, L2] chunks, flattened
    after = _after_conv(chunk_lengths)
    return (torch.arange(int(after.max()))[None] < after[:, None]).flatten().nonzero().flatten()


def pool_index(feature_lens):  # i64[A] -> i64[sum of out_len]: the first frame of each averaged pair
    """Pairs (2j, 2j+1) within each audio's packed frames (transformers' get_pool_indices)."""
    after = _after_conv(feature_lens)
    offsets = F.pad(after.cumsum(0), (1, 0))[:-1]
    counts = audio_output_lengths(feature_lens).tolist()
    return torch.cat([o + 2 * torch.arange(n) for o, n in zip(offsets.tolist(), counts)])


def sinusoids(length: int, channels: int, max_timescale: float = 10_000.0):  # -> f32[length, channels]
    """Whisper's table, [sin | cos] of geometrically spaced timescales, in transformers' float32 op order."""
    log_timescale_increment = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2).float())
    scaled_time = torch.arange(length)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


# ---- modules --------------------------------------------------------------------------------

Conv1d = nn.Conv1d  # `weight` [out, in, k] and `bias`, as stored


class AudioAttention(nn.Module):
    """Multi-head attention within each chunk; k_proj has no bias (Whisper's)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x, cu_seqlens):  # x: f32[N,D]  cu_seqlens: i32[C+1] -> f32[N,D]
        N, H, hd = x.shape[0], self.num_heads, self.head_dim
        q, k, v = (proj(x).view(N, H, hd) for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(vision_attention(q, k, v, cu_seqlens, hd ** -0.5).reshape(N, H * hd))


class AudioEncoderLayer(nn.Module):
    """Pre-norm: x + attn(ln(x)), then x + fc2(act(fc1(ln(x))))."""

    def __init__(self, c: Qwen2_5OmniAudioConfig):
        super().__init__()
        self.self_attn = AudioAttention(c.d_model, c.encoder_attention_heads)
        self.self_attn_layer_norm = LayerNorm(c.d_model, NORM_EPS)
        self.act = ACTIVATIONS[c.activation_function]
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model)
        self.final_layer_norm = LayerNorm(c.d_model, NORM_EPS)

    def forward(self, x, cu_seqlens):  # f32[N,D] -> f32[N,D]
        x = x + self.self_attn(self.self_attn_layer_norm(x), cu_seqlens)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Qwen2_5OmniAudioEncoder(nn.Module):
    def __init__(self, config: Qwen2_5OmniAudioConfig):
        super().__init__()
        c = self.config = config
        self.conv1 = Conv1d(c.num_mel_bins, c.d_model, kernel_size=3, padding=1)
        self.conv2 = Conv1d(c.d_model, c.d_model, kernel_size=3, stride=2, padding=1)
        self.audio_bos_eos_token = nn.Embedding(2, c.output_dim)  # stored; the forward never reads it
        self.layers = nn.ModuleList(AudioEncoderLayer(c) for _ in range(c.encoder_layers))
        self.ln_post = LayerNorm(c.d_model, NORM_EPS)
        self.proj = nn.Linear(c.d_model, c.output_dim)

    def forward(self, input_features, feature_lens):
        """input_features f32[mel, F] (every audio's frames, concatenated), feature_lens i64[A] ->
        f32[sum of audio_output_lengths(feature_lens), output_dim]."""
        c = self.config
        if int(feature_lens.sum()) != input_features.shape[1]:
            raise ValueError(f"feature_lens sum to {int(feature_lens.sum())} frames, input_features has "
                             f"{input_features.shape[1]}")
        chunk_lengths = audio_chunk_lengths(feature_lens, c.n_window)
        index, valid = segment_index(F.pad(chunk_lengths.cumsum(0), (1, 0)))  # i64[C,L], bool[C,L]
        chunks = (input_features.T[index] * valid[..., None]).transpose(1, 2)  # f32[C, mel, L], zero-padded
        x = F.gelu(self.conv1(chunks)) * valid[:, None, :]
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # f32[C, L2, D]
        x = x + sinusoids(c.max_source_positions, c.d_model)[: x.shape[1]]
        x = x.reshape(-1, c.d_model)[valid_index(chunk_lengths)]  # f32[N, D]: the chunks' real frames, packed
        cu_seqlens = audio_cu_seqlens(chunk_lengths)
        for layer in self.layers:
            x = layer(x, cu_seqlens)
        pool = pool_index(feature_lens)
        x = (x[pool] + x[pool + 1]) / 2
        return self.proj(self.ln_post(x))
