"""Whisper's log-mel front end computed on the model's device, a batch at once.

On a GPU the per-utterance front end on the host (transformers' ``WhisperFeatureExtractor``, one STFT per clip) is a
visible share of a batch's time once the decoder is fast (whisper-base, H200, batch 64: features + encoder 0.44 of
1.30 s, the note ``shared/notes/gpu.md``). :func:`log_mel` computes the same features with ``torch.stft`` over the
whole padded batch on the device: the extractor's recipe (Radford et al. 2022, "Robust Speech Recognition via
Large-Scale Weak Supervision", arXiv:2212.04356, section 2.2: 25 ms Hann windows with a 10 ms stride, 80 mel bins,
log10 magnitudes clipped 8 below the maximum, scaled to about [-1, 1]), with the extractor's own mel filter bank.
Each row is padded with zeros to the model's 30 s window first, as the extractor pads it, so a row's features do not
depend on its batch-mates.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np
import torch

_CONSTANTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per feature extractor (held weakly) and device: its Hann window and mel filter bank, built at the first batch."""


def supports(feature_extractor) -> bool:
    """Whether :func:`log_mel` reproduces ``feature_extractor``: no dither and no waveform normalisation (the
    defaults of every Whisper checkpoint's extractor)."""
    return not getattr(feature_extractor, "dither", 0.0) and not getattr(feature_extractor, "do_normalize", False)


def log_mel(feature_extractor, audios: Sequence[np.ndarray], device) -> torch.Tensor:
    """Log-mel features of waveforms, each zero-padded (or cut) to the extractor's ``n_samples``, computed on
    ``device``: float32 ``[B, n_mels, n_samples // hop_length]``, what ``feature_extractor(audio,
    padding="max_length")["input_features"]`` holds per row (to float32 rounding: STFT kernels differ by device).

    Args:
        feature_extractor: a ``WhisperFeatureExtractor`` (``n_fft``, ``hop_length``, ``n_samples``, ``mel_filters``
            ``[n_fft // 2 + 1, n_mels]``); audios: float32 mono waveforms at its sampling rate.

    Raises:
        ValueError: an extractor :func:`supports` rejects.
    """
    fe = feature_extractor
    if not supports(fe):
        raise ValueError("log_mel reproduces extractors without dither or normalisation only")
    batch = np.zeros((len(audios), fe.n_samples), dtype=np.float32)
    for i, a in enumerate(audios):
        n = min(len(a), fe.n_samples)
        batch[i, :n] = a[:n]
    wave = torch.from_numpy(batch).to(device, non_blocking=True)
    window, filters = window_and_filters(fe, device)
    return log_mel_power(wave, fe.n_fft, fe.hop_length, window, filters)


def log_mel_power(wave: torch.Tensor, n_fft: int, hop_length: int, window: torch.Tensor,
                  filters: torch.Tensor) -> torch.Tensor:
    """Whisper's log-mel features of float32 waveforms ``wave`` ``[B, N]`` (already padded or cut): float32
    ``[B, n_mels, N // hop_length]``. The operations of transformers' ``WhisperFeatureExtractor`` with PyTorch, in
    its order, so a CPU gives its result bitwise: a centred STFT under ``window`` (float32 ``[n_fft]``), power
    spectrum with the last frame dropped, mel ``filters`` (float32 ``[n_fft // 2 + 1, n_mels]``), log10 clamped at
    1e-10, floored 8 below each row's maximum, then ``(x + 4) / 4``."""
    spec = torch.stft(wave, n_fft, hop_length, window=window, return_complex=True)
    power = (spec[..., :-1].abs() ** 2).contiguous()  # [B, F, T]: the last frame dropped, as the extractor does
    mel = filters.T @ power  # [B, M, T]
    logs = torch.clamp(mel, min=1e-10).log10()
    logs = torch.maximum(logs, logs.max(dim=2, keepdim=True)[0].max(dim=1, keepdim=True)[0] - 8.0)
    return (logs + 4.0) / 4.0


def window_and_filters(feature_extractor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The extractor's float32 Hann window ``[n_fft]`` and mel filter bank ``[n_fft // 2 + 1, n_mels]`` on
    ``device``: built once per extractor and device (cached in ``_CONSTANTS``), not at every batch."""
    per_device = _CONSTANTS.setdefault(feature_extractor, {})
    device = torch.device(device)
    if device not in per_device:
        per_device[device] = (
            torch.hann_window(feature_extractor.n_fft, device=device),
            torch.as_tensor(np.asarray(feature_extractor.mel_filters), dtype=torch.float32, device=device),
        )
    return per_device[device]


def stack_frames(features: torch.Tensor | np.ndarray, k: int):
    """Stack ``k`` consecutive log-mel frames into one: ``[..., M, T]`` -> ``[..., k * M, T // k]``.

    Stacked bin ``m * k + j`` of output frame ``t`` is bin ``m`` of input frame ``t * k + j`` (a trailing partial
    group is dropped). With a 10 ms hop and ``k = 2`` Whisper's stride-2 convolution then yields 25 encoder positions
    per second (4x time subsampling, as ESPnet's conv2d front-end) without discarding the 10 ms resolution.
    """
    if k == 1:
        return features
    *lead, m, t = features.shape
    x = features[..., : t - t % k].reshape(*lead, m, t // k, k)
    x = x.swapaxes(-1, -2) if isinstance(x, np.ndarray) else x.transpose(-1, -2)
    return x.reshape(*lead, k * m, t // k)
