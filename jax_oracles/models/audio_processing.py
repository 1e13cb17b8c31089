"""Whisper's log-mel features, the audio half of Qwen2.5-Omni's processor: the numpy twin of
torch_sources/models/audio_processing.py (same names; host code, like the image processor).

The torch file copies what LLaMA-Factory calls (transformers' WhisperFeatureExtractor through torch.stft); here
the same steps in numpy: the padded waveform framed with reflect padding, a periodic Hann window, `np.fft.rfft`
in float64 (torch's float32 FFT and numpy's differ in rounding: the features agree to ~1e-6, not bit for bit,
except where the spectrum is exactly zero, as on LF's silent fake audio, which is bit-equal), then the float32
mel projection, the log10 floor (rounded from float64), per-audio clamp and scaling in torch's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

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


def _hann_window(n: int) -> np.ndarray:  # torch.hann_window(n): periodic, in float32 as torch computes it
    return np.cos(np.arange(n, dtype=np.float32) * np.float32(2 * np.pi / n)) * np.float32(-0.5) + np.float32(0.5)


def _power_spectrum(waveforms: np.ndarray, config: WhisperFeatureConfig) -> np.ndarray:
    """f32[A, N] -> f32[A, n_fft // 2 + 1, N // hop_length]: torch.stft(center=True, reflect)'s |X|^2, last frame
    dropped. One strided view of the frames, one batched rfft (no loop over frames)."""
    half = config.n_fft // 2
    padded = np.pad(waveforms, ((0, 0), (half, half)), mode="reflect")
    frames = sliding_window_view(padded, config.n_fft, axis=-1)[:, ::config.hop_length][:, :-1]
    spectrum = np.fft.rfft(frames.astype(np.float64) * _hann_window(config.n_fft), axis=-1)
    return (spectrum.real ** 2 + spectrum.imag ** 2).astype(np.float32).transpose(0, 2, 1)


def frame_mask(sample_mask: np.ndarray, config: WhisperFeatureConfig) -> np.ndarray:  # -> i32[A, frames]
    """The sample mask read every hop_length samples (the extractor drops a partial last hop)."""
    mask = sample_mask[:, ::config.hop_length]
    return np.ascontiguousarray(mask[:, :-1] if sample_mask.shape[1] % config.hop_length else mask)


def log_mel_spectrogram(waveforms: np.ndarray, config: WhisperFeatureConfig) -> np.ndarray:
    """f32[A, N] -> f32[A, feature_size, N // hop_length]: WhisperFeatureExtractor._torch_extract_fbank_features."""
    mel_spec = mel_filter_bank(config).astype(np.float32).T @ _power_spectrum(waveforms, config)
    # log10 in float64, rounded once: numpy's float32 log10 is 1 ulp off torch's at the 1e-10 floor (silence)
    log_spec = np.log10(np.maximum(mel_spec, np.float32(1e-10)).astype(np.float64)).astype(np.float32)
    log_spec = np.maximum(log_spec, log_spec.max(axis=(1, 2), keepdims=True) - np.float32(8.0))
    return (log_spec + np.float32(4.0)) / np.float32(4.0)


def whisper_features(audios: list[np.ndarray], config: WhisperFeatureConfig) -> tuple[np.ndarray, np.ndarray]:
    """Waveforms at config.sampling_rate -> (input_features f32[A, feature_size, frames], feature_attention_mask
    i32[A, frames]), frames = n_samples // hop_length: what LF's call to the feature extractor returns."""
    waveforms, mask = pad_waveforms(audios, config)
    return log_mel_spectrogram(waveforms, config), frame_mask(mask, config)
