"""Audio decoding: any soundfile-readable file -> mono float32 at the model's sample rate."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import soxr

DEFAULT_MAX_SECONDS = 30.0
DEFAULT_MAX_BYTES = 25 * 1024 * 1024  # OpenAI's audio API upload limit


class AudioError(ValueError):
    """An audio file that cannot be used: missing, empty, undecodable, or over a limit."""


class AudioTooLargeError(AudioError):
    """An audio file over the byte or duration limit."""


@dataclass(frozen=True)
class AudioLimits:
    """Limits checked before and after decoding.

    Attributes:
        max_seconds: longest accepted duration in seconds (after decoding, before resampling).
        max_bytes: largest accepted encoded size in bytes.
    """

    max_seconds: float = DEFAULT_MAX_SECONDS
    max_bytes: int = DEFAULT_MAX_BYTES


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
        AudioError: missing, empty or undecodable file.
        AudioTooLargeError: over ``limits.max_bytes`` or ``limits.max_seconds``.
    """
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise AudioError(f"audio file not found: {path}")
        size = os.path.getsize(path)
        name = path
    else:
        pos = source.tell()
        source.seek(0, os.SEEK_END)
        size = source.tell() - pos
        source.seek(pos)
        name = getattr(source, "name", "<upload>")
    if size == 0:
        raise AudioError(f"audio file is empty (0 bytes): {name}")
    if size > limits.max_bytes:
        raise AudioTooLargeError(f"audio file is {size} bytes, over the limit of {limits.max_bytes}: {name}")
    try:
        with sf.SoundFile(source) as f:
            seconds = f.frames / f.samplerate
            if seconds > limits.max_seconds:
                raise AudioTooLargeError(
                    f"audio is {seconds:.1f} s long, over the limit of {limits.max_seconds:.1f} s: {name}"
                )
            rate = f.samplerate
            data = f.read(dtype="float32", always_2d=True)
    except AudioError:
        raise
    except Exception as exc:  # libsndfile raises LibsndfileError / RuntimeError for undecodable input
        raise AudioError(f"cannot decode audio {name}: {exc}") from exc
    if data.shape[0] == 0:
        raise AudioError(f"audio has no samples: {name}")
    mono = data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]
    if rate != sample_rate:
        mono = soxr.resample(mono, rate, sample_rate, quality="HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)
