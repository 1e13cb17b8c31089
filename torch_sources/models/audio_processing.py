"""Whisper's log-mel features, the audio half of Qwen2.5-Omni's processor: the reference the numpy twin
(jax_oracles/models/audio_processing.py) is held against.

LLaMA-Factory 0.9.5 (`Qwen2OmniPlugin._get_mm_inputs`) calls the processor's `feature_extractor`, transformers
5.24's `WhisperFeatureExtractor`, as
`feature_extractor(audios, sampling_rate=16000, return_attention_mask=True, padding="max_length", return_tensors="pt")`.
With torch installed (LF's environment) that takes `_torch_extract_fbank_features`, copied here op for op so the
features are bit-equal to transformers' (tests/training/test_omni_audio.py):
- each waveform cast to float32, cut to and zero-padded up to `chunk_length` seconds (n_samples = 480000 at
  16 kHz), with a sample mask of its real length;
- `torch.stft` (n_fft 400, hop 160, centred with reflect padding, periodic Hann window), the last frame dropped,
  the power spectrum through the Slaney mel filter bank (`mel_filter_bank`, transformers' numpy code);
- log10 of the mel power floored at 1e-10, clamped to 8 below each audio's largest value, then (x + 4) / 4;
- `feature_attention_mask`: the sample mask read every hop (one flag per frame), int32 as the extractor returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["WhisperFeatureConfig", "hertz_to_mel", "mel_to_hertz", "mel_filter_bank", "pad_waveforms",
           "frame_mask", "log_mel_spectrogram", "whisper_features"]


@dataclass(frozen=True)
class WhisperFeatureConfig:
    """WhisperFeatureExtractor's preprocessor_config.json keys (dither 0, as every Qwen release ships it)."""
    feature_size: int = 80  # mel bins
    sampling_rate: int = 16000
    hop_length: int = 160
    chunk_length: int = 30  # seconds every waveform is padded / cut to
    n_fft: int = 400
    padding_value: float = 0.0

    @property
    def n_samples(self) -> int:
        return self.chunk_length * self.sampling_rate

    @classmethod
    def qwen2_omni(cls) -> "WhisperFeatureConfig":
        """Qwen2.5-Omni-7B's preprocessor_config.json: 128 mel bins, waveforms padded / cut to 300 s (n_samples
        4800000, nb_max_frames 30000; Qwen2-Audio's 30 s is the class default)."""
        return cls(feature_size=128, chunk_length=300)


# ---- the mel filter bank (transformers.audio_utils, numpy, float64) ------------------------

def hertz_to_mel(freq: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mels


def mel_to_hertz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels[log_region] - 15.0))
    return freq


def mel_filter_bank(config: WhisperFeatureConfig) -> np.ndarray:  # -> f64[n_fft // 2 + 1, feature_size]
    """transformers' mel_filter_bank(1 + n_fft // 2, feature_size, 0, 8000, sampling_rate, norm="slaney",
    mel_scale="slaney"): triangles between mel-spaced centres, each scaled to unit area."""
    num_bins, num_mels = 1 + config.n_fft // 2, config.feature_size
    mel_min, mel_max = hertz_to_mel(np.array([0.0, 8000.0]))  # Whisper's band, whatever the sampling rate
    mel_freqs = np.linspace(mel_min, mel_max, num_mels + 2)
    filter_freqs = mel_to_hertz(mel_freqs)
    fft_freqs = np.linspace(0, config.sampling_rate // 2, num_bins)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    filter_diff = np.diff(filter_freqs)
    down, up = -slopes[:, :-2] / filter_diff[:-1], slopes[:, 2:] / filter_diff[1:]
    filters = np.maximum(np.zeros(1), np.minimum(down, up))
    return filters * (2.0 / (filter_freqs[2:num_mels + 2] - filter_freqs[:num_mels]))[None, :]


# ---- features ------------------------------------------------------------------------------

def pad_waveforms(audios: list[np.ndarray], config: WhisperFeatureConfig) -> tuple[np.ndarray, np.ndarray]:
    """SequenceFeatureExtractor.pad(padding="max_length", truncation=True) -> (f32[A, n_samples] waveforms,
    i32[A, n_samples] sample mask)."""
    n = config.n_samples
    waveforms = np.full((len(audios), n), config.padding_value, np.float32)
    mask = np.zeros((len(audios), n), np.int32)
    for i, audio in enumerate(audios):
        audio = np.asarray(audio, np.float32).reshape(-1)[:n]
        waveforms[i, :len(audio)], mask[i, :len(audio)] = audio, 1
    return waveforms, mask


def frame_mask(sample_mask: np.ndarray, config: WhisperFeatureConfig) -> np.ndarray:  # -> i32[A, frames]
    """The sample mask read every hop_length samples (the extractor drops a partial last hop)."""
    mask = sample_mask[:, ::config.hop_length]
    return np.ascontiguousarray(mask[:, :-1] if sample_mask.shape[1] % config.hop_length else mask)


def log_mel_spectrogram(waveforms: torch.Tensor, config: WhisperFeatureConfig) -> torch.Tensor:
    """f32[A, N] -> f32[A, feature_size, N // hop_length]: WhisperFeatureExtractor._torch_extract_fbank_features."""
    window = torch.hann_window(config.n_fft)
    stft = torch.stft(waveforms, config.n_fft, config.hop_length, window=window, return_complex=True)
    magnitudes = (stft[..., :-1].abs() ** 2).contiguous()
    mel_spec = torch.from_numpy(mel_filter_bank(config)).to(torch.float32).T @ magnitudes
    log_spec = torch.clamp(mel_spec, min=1e-10).log10()
    max_val = log_spec.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0]  # each audio's own largest
    log_spec = torch.maximum(log_spec, max_val - 8.0)
    return (log_spec + 4.0) / 4.0


def whisper_features(audios: list[np.ndarray], config: WhisperFeatureConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Waveforms at config.sampling_rate -> (input_features f32[A, feature_size, frames], feature_attention_mask
    i32[A, frames]), frames = n_samples // hop_length: what LF's call to the feature extractor returns."""
    waveforms, mask = pad_waveforms(audios, config)
    return log_mel_spectrogram(torch.from_numpy(waveforms), config), torch.from_numpy(frame_mask(mask, config))
