"""Word boundaries refined with the audio's speech activity (a step after openai/whisper's word timing).

Whisper's word times (:func:`rayspec.timing.word_timestamps`: DTW over the alignment heads' cross-attention) give two
neighbouring words one shared boundary near the end of the first word, so the pause or quiet transition before a word
is counted in it: on Piper speech 98% of word starts come early (by about 100 ms) while ends are close. Forced
aligners avoid this by modelling silence explicitly; WhisperX (Bain et al. 2023, "WhisperX: Time-Accurate Speech
Transcription of Long-Form Audio", arXiv:2303.00747, section 3) and stable-ts (jianfch/stable-ts,
``suppress_silence``) use voice activity for the same purpose. Here the activity is a frame-energy detector on the
row's own audio (:func:`speech_activity`: a frame is speech when within :data:`DROP_DB` dB of the row's loudest frame
and above :data:`FLOOR_DBFS`), and a word is only ever shrunk inside its own span:

* a start that falls in non-speech moves forward to the first speech frame inside the word;
* with ``ends=True``, an end that falls in non-speech moves back to the end of the last speech frame inside the word;
* a word with no speech frame inside keeps its times.

A word never grows, so it never crosses its neighbours and the order is kept.

Chosen on a dev split of Piper sentences (20 held-out ``metadata_text_only.csv`` sentences, seed 1, disjoint from the
benchmark's 30 and from the LJSpeech clips; ``docs/benchmarks/timestamps.md``), never on the benchmark's sentences:
:data:`DROP_DB` = 15 (of 6 to 60 dB), and starts only (moving ends back made them worse there, 56 -> 94 ms: Piper's
word ends carry quiet sounds, and Whisper's ends were already close).
"""

from __future__ import annotations

import numpy as np

HOP_S = 0.01  # 10 ms hop: finer than WebRTC's 30 ms VAD frames
FRAME_S = 0.02  # 20 ms analysis window
DROP_DB = 15.0  # speech: within this many dB of the row's loudest frame (chosen on the dev split)
FLOOR_DBFS = -60.0  # ... and louder than this: digital silence and dither are never speech


def frame_energy_db(audio: np.ndarray, rate: int) -> np.ndarray:
    """Frame energy of a waveform in dB relative to full scale.

    Args:
        audio: float32 ``[num_samples]`` in [-1, 1]; rate: its sample rate in Hz.

    Returns:
        float32 ``[F]``: frame ``f`` covers ``[f * HOP_S, f * HOP_S + FRAME_S)`` seconds (zero-padded past the end);
        ``F = ceil(num_samples / hop)``, empty for empty audio.
    """
    hop, width = max(1, round(HOP_S * rate)), max(1, round(FRAME_S * rate))
    n = -(-len(audio) // hop)
    if n == 0:
        return np.zeros(0, dtype=np.float32)
    x = np.pad(np.asarray(audio, dtype=np.float64), (0, n * hop + width - len(audio)))
    frames = np.lib.stride_tricks.sliding_window_view(x, width)[::hop][:n]
    return (10 * np.log10((frames ** 2).mean(axis=1) + 1e-12)).astype(np.float32)


def speech_activity(audio: np.ndarray, rate: int, drop_db: float = DROP_DB) -> np.ndarray:
    """bool ``[F]`` per :func:`frame_energy_db` frame: speech when within ``drop_db`` dB of the loudest frame and
    above :data:`FLOOR_DBFS` (``audio``: float32 ``[num_samples]`` at ``rate`` Hz; empty for empty audio)."""
    db = frame_energy_db(audio, rate)
    if not len(db):
        return np.zeros(0, dtype=bool)
    return (db > db.max() - drop_db) & (db > FLOOR_DBFS)


def refine_words(words: list[dict], speech: np.ndarray, ends: bool = False, hop_s: float = HOP_S) -> None:
    """Shrink each word's ``start_s`` (and with ``ends`` its ``end_s``) onto its speech frames, in place (see the
    module docstring).

    Args:
        words: dicts with ``start_s``/``end_s`` in seconds from the start of the audio ``speech`` describes.
        speech: bool ``[F]`` from :func:`speech_activity`; ends: also move ends in non-speech back; hop_s: the
            frames' hop in seconds.
    """
    n = len(speech)
    for w in words:
        start, end = w["start_s"], w["end_s"]
        first, last = int(np.floor(start / hop_s + 1e-9)), int(np.ceil(end / hop_s - 1e-9))  # frames [first, last)
        first, last = max(0, first), min(n, last)
        inside = np.flatnonzero(speech[first:last]) + first if last > first else []
        if not len(inside):
            continue
        if not speech[first]:
            start = max(start, inside[0] * hop_s)
        if ends and not speech[last - 1]:
            end = min(end, (inside[-1] + 1) * hop_s)
        if start <= end:
            w["start_s"], w["end_s"] = start, end
