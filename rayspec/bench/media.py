"""Audio through FFmpeg: clips re-encoded in the formats users have (phone m4a, browser webm, mp4 video, mp3, stereo
44.1 kHz m4a), transcribed beside the originals; libsndfile's and FFmpeg's decoding speed; the memory of a long file.

    python -m rayspec.bench.media ../shared/data/ljspeech/clips.jsonl --skip 200 --clips 20 -o bench/media

Needs the media extra (PyAV: ``pip install 'rayspec[media]'``), which also encodes the clips (:func:`encode`, used by
the tests too). Writes ``<output>/bench-media.md``: per format, failures and WER against the same clips as read from
the manifest; decoding seconds per format and decoder; with ``--long-minutes``, the peak RSS of ``rayspec transcribe``
on a 1-minute and a long m4a made by looping the clips.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

FORMATS = {
    # name: (suffix, container, codec, rate in Hz or None for the clip's own, channels, with a video track,
    #        bit rate in bit/s or None for the encoder's default)
    "m4a": (".m4a", "ipod", "aac", None, 1, False, None),
    "webm": (".webm", "webm", "libopus", 48000, 1, False, None),
    "mp4-video": (".mp4", "mp4", "aac", None, 1, True, None),
    "mp3": (".mp3", "mp3", "libmp3lame", None, 1, False, 64_000),  # lame's default at 22 kHz is 24 kbit/s
    "m4a-stereo-44k": (".m4a", "ipod", "aac", 44100, 2, False, None),
}
"""The formats :func:`encode` writes, as phones (m4a/AAC), browsers (MediaRecorder's webm/Opus), cameras and screen
recorders (mp4 with a video track) and podcasts (mp3) make them."""


def encode(samples: np.ndarray, rate: int, kind: str, video: bool | None = None) -> bytes:
    """Encode a waveform as one of :data:`FORMATS` with PyAV (FFmpeg's encoders at their default bit rates).

    Args:
        samples: float32 mono waveform ``[num_samples]`` in [-1, 1]; rate: its rate in Hz (resampled by the encoder
            where the format has its own); kind: a key of :data:`FORMATS`; video: override the format's video track
            (False: an mp4 with audio only; True on an ``mp4``: a 64x64 black video beside it).

    Returns:
        The encoded file's bytes.

    Raises:
        ImportError: PyAV is not installed (``pip install 'rayspec[media]'``).
    """
    import av

    _, container, codec, out_rate, channels, with_video, bit_rate = FORMATS[kind]
    with_video = with_video if video is None else video
    buf = io.BytesIO()
    if out_rate and out_rate != rate:
        import soxr

        samples, rate = soxr.resample(samples.astype(np.float32), rate, out_rate), out_rate
    with av.open(buf, "w", format=container) as out:
        audio = out.add_stream(codec, rate=rate, layout="stereo" if channels == 2 else "mono")
        if bit_rate:
            audio.bit_rate = bit_rate
        picture = out.add_stream("mpeg4", rate=10) if with_video else None  # every stream before the first packet
        if picture is not None:
            picture.width = picture.height = 64
            picture.pix_fmt = "yuv420p"
        planes = np.ascontiguousarray(np.stack([samples.astype(np.float32)] * channels))
        frame = av.AudioFrame.from_ndarray(planes, format="fltp", layout=audio.layout.name)
        frame.sample_rate, frame.pts = rate, 0
        out.mux(audio.encode(frame))
        out.mux(audio.encode(None))
        if picture is not None:
            black = np.zeros((64, 64, 3), np.uint8)
            for k in range(max(1, int(10 * len(samples) / rate))):
                still = av.VideoFrame.from_ndarray(black, format="rgb24")
                still.pts = k
                out.mux(picture.encode(still))
            out.mux(picture.encode(None))
    return buf.getvalue()
