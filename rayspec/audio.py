"""Audio decoding: any soundfile-readable file -> mono float32 at the model's sample rate."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

DEFAULT_MAX_SECONDS = 4 * 3600.0  # a guard: longer recordings are segmented up to this (see rayspec.vad)
DEFAULT_MIN_SECONDS = 0.05  # 800 samples at 16 kHz: two STFT windows; shorter holds no word
DEFAULT_MAX_BYTES = 25 * 1024 * 1024  # OpenAI's audio API upload limit


class AudioError(ValueError):
    """An audio file that cannot be used: missing, empty, undecodable, or over a limit.

    Attributes:
        code: a stable machine-readable reason (the ``error_code`` column of results): "not_found", "unreadable",
            "empty", "undecodable", "too_short", "too_long", "too_large" or "non_finite".
    """

    def __init__(self, message: str, code: str = "undecodable") -> None:
        super().__init__(message)
        self.code = code


class AudioTooLargeError(AudioError):
    """An audio file over the byte or duration limit (``code`` "too_large" or "too_long")."""

    def __init__(self, message: str, code: str = "too_large") -> None:
        super().__init__(message, code)


@dataclass(frozen=True)
class AudioLimits:
    """Limits checked before and after decoding.

    Attributes:
        max_seconds: longest accepted duration in seconds (after decoding, before resampling). Longer than the
            model's window is fine: the pipeline segments it.
        max_bytes: largest accepted encoded size in bytes.
        min_seconds: shortest accepted duration in seconds (shorter audio cannot hold a word, and breaks
            feature extraction below one STFT window).
    """

    max_seconds: float = DEFAULT_MAX_SECONDS
    max_bytes: int = DEFAULT_MAX_BYTES
    min_seconds: float = DEFAULT_MIN_SECONDS


def load_audio(source, sample_rate: int = 16000, limits: AudioLimits = AudioLimits()) -> np.ndarray:
    """Decode, down-mix and resample one audio file.

    Args:
        source: a path, or a binary file-like object (e.g. an upload). Formats are those of libsndfile: WAV, FLAC,
            OGG/Vorbis, NIST SPHERE, AIFF, ...
        sample_rate: target rate in Hz; resampling uses soxr's high-quality filter.
        limits: byte and duration limits.

    Returns:
        float32 array of shape ``[num_samples]`` in [-1, 1] at ``sample_rate`` Hz.

    Raises:
        AudioError: missing, unreadable (a directory, a symlink loop), empty, undecodable, shorter than
            ``limits.min_seconds``, or with NaN/Inf samples; ``code`` says which.
        AudioTooLargeError: over ``limits.max_bytes`` or ``limits.max_seconds``.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            if os.path.lexists(path):
                raise AudioError(f"audio path is a broken symlink or a symlink loop: {path}", "unreadable")
            raise AudioError(f"audio file not found: {path}", "not_found")
        if not os.path.isfile(path):
            raise AudioError(f"audio path is not a regular file: {path}", "unreadable")
        size = os.path.getsize(path)
        name = path
    else:
        pos = source.tell()
        source.seek(0, os.SEEK_END)
        size = source.tell() - pos
        source.seek(pos)
        name = getattr(source, "name", "<upload>")
    if size == 0:
        raise AudioError(f"audio file is empty (0 bytes): {name}", "empty")
    if size > limits.max_bytes:
        raise AudioTooLargeError(f"audio file is {size} bytes, over the limit of {limits.max_bytes}: {name}")
    import soundfile as sf  # here, not at import: the library's decoding path runs without it (a GPU host's
    import soxr  # benchmark of pre-packed arrays, rayspec bench --suite gpu --random-weights)

    try:
        with sf.SoundFile(source) as f:
            seconds = f.frames / f.samplerate
            if seconds > limits.max_seconds:
                raise AudioTooLargeError(
                    f"audio is {seconds:.1f} s long, over the limit of {limits.max_seconds:.1f} s: {name}", "too_long"
                )
            rate = f.samplerate
            data = f.read(dtype="float32", always_2d=True)
    except AudioError:
        raise
    except Exception as exc:  # libsndfile raises LibsndfileError / RuntimeError for undecodable input
        # LibsndfileError's str() names the file object (a BytesIO repr for uploads); its error_string does not.
        reason = getattr(exc, "error_string", None) or type(exc).__name__
        raise AudioError(f"cannot decode audio {name}: {reason}", "undecodable") from exc
    if data.shape[0] == 0:
        raise AudioError(f"audio has no samples: {name}", "empty")
    if data.shape[0] < limits.min_seconds * rate:
        raise AudioError(f"audio is {1000 * data.shape[0] / rate:.1f} ms long, under the minimum of "
                         f"{1000 * limits.min_seconds:.0f} ms: {name}", "too_short")
    if not np.isfinite(data).all():
        raise AudioError(f"audio has NaN or infinite samples: {name}", "non_finite")
    mono = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    if rate != sample_rate:
        mono = soxr.resample(mono, rate, sample_rate, quality="HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)
