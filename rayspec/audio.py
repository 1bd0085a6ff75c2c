"""Audio decoding: any file libsndfile or FFmpeg reads -> mono float32 at the model's sample rate, in chunks.

Decoders, tried in order: libsndfile (``soundfile``, a required dependency: WAV, FLAC, OGG/Vorbis/Opus, MP3, AIFF,
NIST SPHERE), then FFmpeg for every other container and codec (m4a/AAC, webm/Opus, mp4 and other video files' first
audio stream, ...): through PyAV where it is installed (``pip install 'rayspec[media]'``: PyAV's source is BSD, but its
PyPI wheels bundle an FFmpeg that links GPL libraries, so it is never required), else through an ``ffmpeg`` executable
on ``PATH``. Audio is decoded, down-mixed and resampled chunk by chunk (:data:`CHUNK_FRAMES`), a long file into one
buffer at the target rate, so a multi-hour file is held once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

DEFAULT_MAX_SECONDS = 4 * 3600.0  # a guard: longer recordings are segmented up to this (see rayspec.vad)
DEFAULT_MIN_SECONDS = 0.05  # 800 samples at 16 kHz: two STFT windows; shorter holds no word
DEFAULT_MAX_BYTES = 25 * 1024 * 1024  # OpenAI's audio API upload limit (Serve's uploads)
DEFAULT_MAX_FILE_BYTES = 4 * 1024 ** 3  # files, manifest bytes: decoding holds its output only (duration bounds memory)
MEDIA_HINT = "pip install 'rayspec[media]' (PyAV) or put ffmpeg on PATH"
"""How to add FFmpeg's decoders, as error messages name it."""
CHUNK_FRAMES = 1 << 20  # decoded frames per chunk (24-65 s): down-mixed and resampled a chunk at a time


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
        max_bytes: largest accepted encoded size in bytes (default 4 GiB: decoding holds the decoded audio only, so
            ``max_seconds`` bounds memory; Serve sets its own upload limit, 25 MB by default).
        min_seconds: shortest accepted duration in seconds (shorter audio cannot hold a word, and breaks
            feature extraction below one STFT window).
    """

    max_seconds: float = DEFAULT_MAX_SECONDS
    max_bytes: int = DEFAULT_MAX_FILE_BYTES
    min_seconds: float = DEFAULT_MIN_SECONDS



def load_audio(source, sample_rate: int = 16000, limits: AudioLimits = AudioLimits(),
               decoder: Optional[str] = None) -> np.ndarray:
    """Decode, down-mix and resample one audio file, chunk by chunk.

    Args:
        source: a path, or a seekable binary file-like object (an upload, a manifest row's bytes); its ``name``, if
            any, names it in errors. Formats: libsndfile's (WAV, FLAC, OGG, MP3, ...), and with FFmpeg (PyAV or an
            ``ffmpeg`` executable) every container and codec FFmpeg reads; in a video file, its first audio stream.
        sample_rate: target rate in Hz; resampling uses soxr's high-quality filter (FFmpeg's own resampler on the
            ``ffmpeg`` executable's path).
        limits: byte and duration limits.
        decoder: one of :data:`DECODERS` alone (to compare them); default: libsndfile, then FFmpeg (PyAV where
            installed, else an ``ffmpeg`` on PATH) for what libsndfile cannot read.

    Returns:
        float32 array of shape ``[num_samples]`` in [-1, 1] at ``sample_rate`` Hz, channels averaged.

    Raises:
        AudioError: missing, unreadable (a directory, a symlink loop), empty, undecodable (damaged, truncated, no
            audio stream, or a format no installed decoder reads: the message then names :data:`MEDIA_HINT`),
            shorter than ``limits.min_seconds``, or with NaN/Inf samples; ``code`` says which.
        AudioTooLargeError: over ``limits.max_bytes`` or ``limits.max_seconds``.
        ValueError: a ``decoder`` not in :data:`DECODERS`.
    """
    if decoder is not None and decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {', '.join(DECODERS)}, not {decoder!r}")
    name, size = _check_source(source)
    if size == 0:
        raise AudioError(f"audio file is empty (0 bytes): {name}", "empty")
    if size > limits.max_bytes:
        raise AudioTooLargeError(f"audio file is {size} bytes, over the limit of {limits.max_bytes}: {name}")
    start = None if isinstance(source, (str, os.PathLike)) else source.tell()
    reason = ""
    for read in _decoders() if decoder is None else [DECODERS[decoder]]:
        if start is not None:
            source.seek(start)
        try:
            return read(source, _Sink(name, sample_rate, limits))
        except AudioError:
            raise
        except Exception as exc:  # each decoder's own error types: the next decoder tries; the last one's reason
            reason = _reason(exc)
            if read is _read_soundfile and getattr(exc, "code", None) == SF_ERR_UNRECOGNISED_FORMAT:
                reason += f" (libsndfile reads WAV, FLAC, OGG and MP3; for other formats: {MEDIA_HINT})"
    raise AudioError(f"cannot decode audio {name}: {reason}", "undecodable")


SF_ERR_UNRECOGNISED_FORMAT = 1
"""libsndfile's error code for a format it does not read (``soundfile.LibsndfileError.code``)."""


def _check_source(source) -> tuple[str, int]:
    """``(name, encoded size in bytes)`` of a path or file-like object; raises AudioError for a bad path."""
    if not isinstance(source, (str, os.PathLike)):
        pos = source.tell()
        source.seek(0, os.SEEK_END)
        size = source.tell() - pos
        source.seek(pos)
        return getattr(source, "name", "<upload>"), size
    path = os.fspath(source)
    if not os.path.exists(path):
        if os.path.lexists(path):
            raise AudioError(f"audio path is a broken symlink or a symlink loop: {path}", "unreadable")
        raise AudioError(f"audio file not found: {path}", "not_found")
    if not os.path.isfile(path):
        raise AudioError(f"audio path is not a regular file: {path}", "unreadable")
    return path, os.path.getsize(path)


def _reason(exc: Exception) -> str:
    """A decoder error's reason without the file's repr: libsndfile's ``error_string``, FFmpeg's ``strerror``."""
    text = getattr(exc, "error_string", None) or getattr(exc, "strerror", None) or str(exc)
    return " ".join(str(text).split()) or type(exc).__name__


def _decoders() -> list:
    """The decoders to try, in order: libsndfile, then FFmpeg through PyAV if installed, else an ``ffmpeg`` on PATH."""
    import importlib.util
    import shutil

    out = [_read_soundfile]
    if importlib.util.find_spec("av") is not None:
        out.append(_read_pyav)
    elif shutil.which("ffmpeg"):
        out.append(_read_ffmpeg)
    return out


class _Sink:
    """Down-mixed chunks at the source's rate -> float32 samples at ``sample_rate`` Hz.

    A file that comes in one chunk (up to :data:`CHUNK_FRAMES` frames) is resampled at once (soxr HQ). A longer one
    is resampled as a stream (the same samples) into one buffer sized from the duration its header states (grown if
    it understated it), so it is held once, at ``sample_rate``. The limits are checked as chunks arrive.
    """

    def __init__(self, name: str, sample_rate: int, limits: AudioLimits) -> None:
        self.name, self.sample_rate, self.limits = name, sample_rate, limits
        self.rate = 0
        self.seconds: Optional[float] = None  # the duration the header states
        self.frames = 0  # input frames seen
        self.first: Optional[np.ndarray] = None  # the first chunk, until a second one comes
        self.n = 0  # output samples written
        self.out = self.resampler = None

    def start(self, rate: int, seconds: Optional[float]) -> None:
        """Open for a source at ``rate`` Hz stating ``seconds`` (None: unknown); raises AudioTooLargeError if over."""
        if seconds is not None and seconds > self.limits.max_seconds:
            self._too_long(seconds)
        self.rate, self.seconds = int(rate), seconds

    def add(self, mono: np.ndarray) -> None:
        """Append float32 mono samples ``[frames]`` at the source's rate (an array the caller no longer writes)."""
        self.frames += len(mono)
        if self.frames > self.limits.max_seconds * self.rate:
            self._too_long(self.frames / self.rate)
        if not np.isfinite(mono).all():
            raise AudioError(f"audio has NaN or infinite samples: {self.name}", "non_finite")
        if self.out is None and self.first is None:
            self.first = mono
            return
        if self.out is None:  # a second chunk: stream from here on
            import soxr

            expected = 1.01 * self.seconds + 1.0 if self.seconds else 60.0  # headers may understate (codec padding)
            self.out = np.empty(int(expected * self.sample_rate), np.float32)
            if self.rate != self.sample_rate:
                self.resampler = soxr.ResampleStream(self.rate, self.sample_rate, 1, dtype="float32", quality="HQ")
            first, self.first = self.first, None
            self._resample(first)
        self._resample(mono)

    def finish(self) -> np.ndarray:
        """The decoded audio, ``[num_samples]`` float32 at ``sample_rate``; raises AudioError if empty or too short."""
        if self.frames == 0:
            raise AudioError(f"audio has no samples: {self.name}", "empty")
        if self.frames < self.limits.min_seconds * self.rate:
            raise AudioError(f"audio is {1000 * self.frames / self.rate:.1f} ms long, under the minimum of "
                             f"{1000 * self.limits.min_seconds:.0f} ms: {self.name}", "too_short")
        if self.first is not None:  # one chunk
            import soxr  # here, not at import: the library's decoding path runs without it (a GPU host's
            # benchmark of pre-packed arrays, rayspec bench --suite gpu --random-weights)

            mono = self.first
            if self.rate != self.sample_rate:
                mono = soxr.resample(mono, self.rate, self.sample_rate, quality="HQ")
            return np.ascontiguousarray(mono, dtype=np.float32)
        if self.resampler:
            self._put(self.resampler.resample_chunk(np.zeros(0, np.float32), last=True))
        self.out.resize(self.n, refcheck=False)  # shrinks in place: the buffer is never copied whole
        return self.out

    def _resample(self, mono: np.ndarray) -> None:
        self._put(self.resampler.resample_chunk(mono) if self.resampler else mono)

    def _put(self, samples: np.ndarray) -> None:
        end = self.n + len(samples)
        if end > len(self.out):
            self.out.resize(max(end, int(1.5 * len(self.out))), refcheck=False)
        self.out[self.n:end] = samples
        self.n = end

    def _too_long(self, seconds: float) -> None:
        raise AudioTooLargeError(f"audio is {seconds:.1f} s long, over the limit of {self.limits.max_seconds:.1f} s: "
                                 f"{self.name}", "too_long")


def _read_soundfile(source, sink: _Sink) -> np.ndarray:
    """Decode with libsndfile, :data:`CHUNK_FRAMES` frames at a time."""
    import soundfile as sf

    with sf.SoundFile(source) as f:
        sink.start(f.samplerate, f.frames / f.samplerate)
        for block in f.blocks(CHUNK_FRAMES, dtype="float32", always_2d=True):
            sink.add(block.mean(axis=1) if block.shape[1] > 1 else block[:, 0])
    return sink.finish()


def _read_pyav(source, sink: _Sink) -> np.ndarray:
    """Decode the first audio stream with FFmpeg through PyAV, in frames of :data:`CHUNK_FRAMES` samples."""
    import itertools

    import av

    with av.open(source, metadata_errors="ignore") as container:
        if not container.streams.audio:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise AudioError(f"no audio stream in {sink.name} (its streams: {', '.join(kinds)})", "undecodable")
        stream = container.streams.audio[0]
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
        else:
            seconds = container.duration / 1e6 if container.duration else None
        # float planar at the first frame's layout and rate (later frames converted to them), fixed-size frames
        resampler = av.AudioResampler(format="fltp", frame_size=CHUNK_FRAMES)
        for frame in itertools.chain(container.decode(stream), [None]):  # None: flush the resampler
            if frame is not None and not sink.rate:
                sink.start(frame.sample_rate, seconds)
            for out in resampler.resample(frame):
                x = out.to_ndarray()  # [channels, frames]
                sink.add(x.mean(axis=0) if x.shape[0] > 1 else x[0])
    if not sink.rate:
        sink.start(stream.rate or sink.sample_rate, 0.0)
    return sink.finish()


def _read_ffmpeg(source, sink: _Sink) -> np.ndarray:
    """Decode the first audio stream with an ``ffmpeg`` executable (openai/whisper's way), mono float32 at the
    target rate (FFmpeg down-mixes and resamples); a file-like source goes through a temporary file (an mp4's index
    may sit at its end, out of a pipe's reach)."""
    import shutil
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rayspec-ffmpeg-") as tmp:
        path = source
        if not isinstance(source, (str, os.PathLike)):
            path = os.path.join(tmp, "input")
            with open(path, "wb") as f:
                shutil.copyfileobj(source, f)
        cmd = [shutil.which("ffmpeg") or "ffmpeg", "-nostdin", "-hide_banner", "-loglevel", "error", "-i",
               os.path.abspath(path), "-map", "0:a:0", "-vn", "-sn", "-dn", "-ac", "1", "-ar", str(sink.sample_rate),
               "-f", "f32le", "pipe:1"]
        with open(os.path.join(tmp, "stderr"), "w+b") as err:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
            try:
                sink.start(sink.sample_rate, None)
                while chunk := proc.stdout.read(4 * CHUNK_FRAMES):
                    sink.add(np.frombuffer(chunk[: len(chunk) // 4 * 4], "<f4"))
            except BaseException:
                proc.kill()
                raise
            finally:
                proc.stdout.close()
                proc.wait()
            if proc.returncode:
                err.seek(0)
                text = err.read().decode(errors="replace").strip()
                if "matches no streams" in text:
                    raise AudioError(f"no audio stream in {sink.name}", "undecodable")
                raise RuntimeError(text.splitlines()[-1] if text else f"ffmpeg exit status {proc.returncode}")
    return sink.finish()


DECODERS = {"libsndfile": _read_soundfile, "pyav": _read_pyav, "ffmpeg": _read_ffmpeg}
"""The decoders by name (``load_audio(decoder=...)``): libsndfile (soundfile), FFmpeg through PyAV, an ``ffmpeg``
executable."""
