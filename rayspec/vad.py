"""Voice activity: whether a recording holds speech, and where to cut one longer than the model's window.

Frames of 30 ms are classified by WebRTC's VAD (the ``webrtcvad`` package, aggressiveness 3). WebRTC's VAD calls any
loud broadband noise speech, so a frame also needs a spectral flatness (Wiener entropy: geometric over arithmetic
mean of the power spectrum) below :data:`MAX_SPEECH_FLATNESS`: white noise sits near 0.56, voiced speech far below.

Long recordings are cut in pauses, as faster-whisper's VAD batching and Whisper's long-form transcription do: speech
regions separated by at least ``min_pause_s`` of non-speech become segments (with a little context on each side), and
a region longer than the window is cut at its quietest frame. Segments are decoded as independent rows of a batch and
their texts re-joined.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRAME_S = 0.03
VAD_RATE = 16000
MAX_SPEECH_FLATNESS = 0.4
MIN_SPEECH_S = 0.09  # three frames
BLOCK_FRAMES = 2000  # frames analysed at once by segments() (60 s)


@dataclass(frozen=True)
class SegmentOptions:
    """How long recordings are cut.

    Attributes:
        max_seconds: longest segment in seconds (the model's window, or less).
        min_pause_s: non-speech this long (seconds) separates two segments.
        pad_s: context kept on each side of a speech region (seconds, within the pause).
    """

    max_seconds: float = 30.0
    min_pause_s: float = 0.3
    pad_s: float = 0.15


def _frames(audio: np.ndarray, rate: int) -> np.ndarray:
    """``[F, n]`` float32 frames of :data:`FRAME_S` at :data:`VAD_RATE` (resampled if needed)."""
    if rate != VAD_RATE:
        import soxr

        audio = soxr.resample(audio, rate, VAD_RATE)
    n = int(VAD_RATE * FRAME_S)
    count = len(audio) // n
    return np.asarray(audio[: count * n], dtype=np.float32).reshape(count, n)


def _speech(frames: np.ndarray, vad) -> np.ndarray:
    """bool ``[F]``: WebRTC says voiced and the spectral flatness is below :data:`MAX_SPEECH_FLATNESS` (computed
    for the voiced frames only: the FFT is the expensive part)."""
    pcm = (np.clip(frames, -1.0, 1.0) * 32767).astype(np.int16)
    out = np.array([vad.is_speech(f.tobytes(), VAD_RATE) for f in pcm], dtype=bool)
    voiced = np.flatnonzero(out)
    if len(voiced):
        windowed = frames[voiced] * np.hanning(frames.shape[1]).astype(np.float32)
        power = np.abs(np.fft.rfft(windowed, axis=1)[:, 1:]) ** 2 + 1e-12
        flatness = np.exp(np.log(power).mean(axis=1)) / power.mean(axis=1)
        out[voiced] = flatness < MAX_SPEECH_FLATNESS
    return out


def has_speech(audio: np.ndarray, rate: int, min_speech_s: float = MIN_SPEECH_S) -> bool:
    """Whether at least ``min_speech_s`` seconds of ``audio`` (float32 ``[num_samples]`` at ``rate`` Hz) are speech,
    by WebRTC's VAD (aggressiveness 3; silence and noise are not).

    Reads the recording a second at a time and stops as soon as enough speech is found, so a speech file costs
    about one second's analysis whatever its length.
    """
    import webrtcvad

    frames = _frames(audio, rate)
    vad, need, found = webrtcvad.Vad(3), min_speech_s / FRAME_S - 1e-9, 0
    block = round(1.0 / FRAME_S)
    for start in range(0, len(frames), block):
        found += int(_speech(frames[start : start + block], vad).sum())
        if found >= need:
            return True
    return False


def segments(audio: np.ndarray, rate: int, options: SegmentOptions = SegmentOptions()) -> list[tuple[int, int]]:
    """Cut a recording into speech segments no longer than ``options.max_seconds``.

    Args:
        audio: float32 ``[num_samples]``; rate: its sample rate in Hz.

    Returns:
        ``(start, end)`` sample indices into ``audio``, in order, non-overlapping; empty if there is no speech.
    """
    import webrtcvad

    frames = _frames(audio, rate)
    # a block of frames at a time (the same frames, one VAD state in order): a long recording's spectra and float64
    # energies are never held whole (2 h at once: ~2 GB of temporaries)
    vad, block = webrtcvad.Vad(3), BLOCK_FRAMES
    speech = np.concatenate([_speech(frames[s : s + block], vad) for s in range(0, len(frames), block)] or
                            [np.zeros(0, bool)])
    energy = np.concatenate([(frames[s : s + block].astype(np.float64) ** 2).mean(axis=1)  # where quiet frames are cut
                             for s in range(0, len(frames), block)] or [np.zeros(0)])
    hop = FRAME_S * rate
    pause = max(1, round(options.min_pause_s / FRAME_S))
    regions: list[list[int]] = []  # [first, last + 1] frames
    for f in np.flatnonzero(speech):
        if regions and f - regions[-1][1] < pause:
            regions[-1][1] = f + 1
        else:
            regions.append([f, f + 1])
    pad = round(options.pad_s / FRAME_S)
    longest = max(1, int(options.max_seconds / FRAME_S) - 2 * pad)
    out = []
    for first, end in regions:
        while end - first > longest:
            # Cut a too-long region at its quietest frame in the second half of the window.
            lo = first + longest // 2
            cut = lo + int(np.argmin(energy[lo : first + longest]))
            out.append((first, cut))
            first = cut
        out.append((first, end))
    n = len(audio)
    return [(int(max(0, (a - pad) * hop)), int(min(n, (b + pad) * hop))) for a, b in out]

