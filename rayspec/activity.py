"""Word boundaries refined with the audio's speech activity (a step after openai/whisper's word timing).

Whisper's word times (:func:`rayspec.timing.word_timestamps`: DTW over the alignment heads' cross-attention) put the
boundary between two words somewhere in the pause between them, so a word after a pause starts early (it carries the
pause) and a word before one ends late. Forced aligners avoid this by modelling silence explicitly; WhisperX (Bain et
al. 2023, "WhisperX: Time-Accurate Speech Transcription of Long-Form Audio", arXiv:2303.00747, section 3) and
stable-ts (jianfch/stable-ts, "suppress_silence") use voice activity for the same purpose. Here the activity is a
frame-energy detector on the row's own audio, and each word is only ever shrunk inside its own span:

* a start that falls in non-speech moves forward to the first speech frame inside the word;
* an end that falls in non-speech moves back to the end of the last speech frame inside the word;
* a word with no speech frame inside keeps its times.

A word never grows, so it never crosses its neighbours and the order is kept.

The detector: frames of :data:`FRAME_S` every :data:`HOP_S`; a frame is speech when its energy is within
:data:`DROP_DB` dB of the row's loudest frame and above :data:`FLOOR_DBFS`. ``DROP_DB`` was chosen on a dev split of
Piper sentences (20 held-out ``metadata_text_only.csv`` sentences, seed 1, disjoint from the benchmark's 30 and from
the LJSpeech clips; see ``docs/benchmarks/timestamps.md``), never on the benchmark's sentences.
"""

from __future__ import annotations

import numpy as np

HOP_S = 0.01  # 10 ms hop: finer than WebRTC's 30 ms VAD frames
FRAME_S = 0.02  # 20 ms analysis window
DROP_DB = 40.0  # speech: within this many dB of the loudest frame (chosen on the dev split)
FLOOR_DBFS = -60.0  # ... and louder than this (digital silence and dither are never speech)


def speech_activity(audio: np.ndarray, rate: int, drop_db: float = DROP_DB,
                    floor_dbfs: float = FLOOR_DBFS) -> np.ndarray:
    """Per-frame speech activity of a waveform by frame energy.

    Args:
        audio: float32 ``[num_samples]`` in [-1, 1]; rate: its sample rate in Hz.
        drop_db: a frame is speech when its energy is at most this many dB below the loudest frame's.
        floor_dbfs: ... and above this level (dB relative to full scale).

    Returns:
        bool ``[F]``, frame ``f`` covering ``[f * HOP_S, f * HOP_S + FRAME_S)`` seconds; ``F = ceil(len / hop)``
        (empty for empty audio).
    """
    hop, width = max(1, round(HOP_S * rate)), max(1, round(FRAME_S * rate))
    n = -(-len(audio) // hop)
    if n == 0:
        return np.zeros(0, dtype=bool)
    x = np.pad(np.asarray(audio, dtype=np.float64), (0, n * hop + width - len(audio)))
    frames = np.lib.stride_tricks.sliding_window_view(x, width)[::hop][:n]
    db = 10 * np.log10((frames ** 2).mean(axis=1) + 1e-12)
    return (db > db.max() - drop_db) & (db > floor_dbfs)


def refine_words(words: list[dict], speech: np.ndarray, hop_s: float = HOP_S) -> None:
    """Shrink each word's ``start_s``/``end_s`` (seconds from the start of the audio ``speech`` describes) onto its
    speech frames, in place (see the module docstring). ``speech``: bool ``[F]`` from :func:`speech_activity`."""
    n = len(speech)
    if n == 0:
        return
    for w in words:
        start, end = w["start_s"], w["end_s"]
        first, last = int(np.floor(start / hop_s + 1e-9)), int(np.ceil(end / hop_s - 1e-9))  # frames [first, last)
        first, last = max(0, first), min(n, last)
        inside = np.flatnonzero(speech[first:last]) + first
        if last <= first or not len(inside):
            continue
        if not speech[first]:
            start = max(start, inside[0] * hop_s)
        if not speech[last - 1]:
            end = min(end, (inside[-1] + 1) * hop_s)
        if start <= end:
            w["start_s"], w["end_s"] = start, end
